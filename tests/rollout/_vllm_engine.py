"""The tiny FP8 policy and colocated vLLM engine the GPU vLLM tests share (tests/rollout/test_gpu_vllm.py in process,
test_gpu_vllm_recipes.py in a child process per recipe): the policy built, the engine started from dummy weights
and synced the way CalibratedGRPOTrainer does it, a seeded rollout, and the trainer's log-probs of its tokens.
Needs CUDA and vllm; imported only by tests that have checked both."""

import torch

PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 8, 24


def tiny_policy(model_dir, **fp8_fields):
    """hidden 256, 4 heads of 64, 2 KV heads (k/v 128 rows): every FP8 block inside one shard; LM head sharpened
    (logits of std ~4 after the final norm: sharp, not uniform). Saved to ``model_dir`` in BF16; returns the BF16
    model and the FP8 policy (``Fp8Config(**fp8_fields)``)."""
    import transformers

    from calclip.fp8 import Fp8Config, quantize_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        base.lm_head.weight.normal_(0.0, 4.0 / 16.0)
    base.save_pretrained(model_dir)
    return base, quantize_model(base, Fp8Config(**fp8_fields)).eval()


def start_engine(model_dir, policy, attention_backend):
    """A colocated FP8 engine on ``model_dir`` with the trainer's engine and numerics arguments and CUDA graphs,
    started from dummy weights and then synced through vLLM's layerwise reload, as in the trainer. Returns the LLM and
    the quantization method the engine was given."""
    import vllm

    from calclip.fp8.export import fp8_weight_specs, shared_recipe
    from calclip.rollout.vllm_sync import fp8_engine_kwargs, fp8_engine_numerics_kwargs, sync_fp8_weights

    # the policy's recipe picks the linear backend, as the trainer's engine does: "fastest" is DeepGEMM for blockwise
    # where it runs, which has no per-channel kernel (a rowwise / tensorwise engine then fails in vLLM's model init)
    numerics = fp8_engine_numerics_kwargs(recipe=shared_recipe(fp8_weight_specs(policy)))
    compilation = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16], **numerics.pop("compilation_config")}
    kwargs = fp8_engine_kwargs(policy)
    llm = vllm.LLM(model=model_dir, dtype="bfloat16", gpu_memory_utilization=0.15, max_model_len=128,
                   max_num_seqs=PROMPTS, seed=0, logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
                   attention_backend=attention_backend, compilation_config=compilation, **kwargs, **numerics)
    sync_fp8_weights(llm, policy)
    return llm, kwargs["quantization"]


def seeded_prompts():
    return torch.randint(3, 512, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(0))


def rollout(llm, prompts):
    """NEW_TOKENS sampled tokens per prompt (temperature 1, seeded) and the engine's log-prob of each."""
    import vllm

    params = vllm.SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True,
                                 logprobs=0, seed=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
    ids = torch.tensor([list(o.outputs[0].token_ids) for o in outs])
    lps = torch.tensor([[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                        for o in outs])
    return ids, lps


def trainer_logprobs(model, prompts, completions):
    ids = torch.cat([prompts, completions], 1).cuda()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, PROMPT_LEN:, None])[..., 0].cpu()


def tmpe(a, b):
    from calclip.losses import token_mult_prob_error

    return float(token_mult_prob_error(a, b, torch.ones_like(a)))
