"""Rollout-trainer mismatch bursts: where FP8 rollout and trainer log-probs of the same tokens part (CPU or CUDA).

The H200 evidence runs (docs/evidence/2026-12-01-smollm2*) logged FP8 rollout-vs-trainer gaps above 1 nat in
44-91% of steps, and 5-10 nats on single tokens (mismatch_outliers.jsonl), with the same FP8 weight codes on both
sides; BF16 stayed below 0.85 nats. This probe rebuilds that setting without the trainer (no trl, datasets or
wandb needed): SmolLM2-135M-Instruct, fp32 master weights under bf16 autocast, block FP8 (``--fp8-decode``: the
evidence runs' ``fp8_decode_fused_max_m 0`` and no split-K GEMM, or today's defaults), 8 arithmetic prompts of 54-56
tokens x 8 rollouts in one left-padded batch, HF ``generate`` with the KV cache, sampled at temperature 1, the sampled
tokens' log-probs taken from the processed scores as calclip's trainer records them. The finished batch then goes
through full forwards as the trainer computes its old log-probs:

    trainer, TRL pos   no position_ids: positions count from each row's first column, pads included (TRL 1.16)
    trainer, gen pos   positions from the attention mask, as generate numbered them (calclip.rollout.positions)
    shadow, gen pos    the FP8 model's BF16 shadow (same Parameters, FP8 off): the size of FP8's own noise

Per pair it prints the max |dlogp| over completion tokens, token_mult_prob_error (mean exp|dlogp|), the share and
count of tokens more than 1 nat apart, and the share of bit-identical log-probs. Full forwards use the model's plain
LM head; TRL's fused LM head gave the same log-probs to 1.7e-5 (CPU, SmolLM2, the same batch).

    python benchmarks/probes/probe_mismatch_bursts.py --arms fp8,bf16            # CPU: 14 min on 2 shared cores
    python benchmarks/probes/probe_mismatch_bursts.py --device cuda --new-tokens 128 --attn sdpa,eager \
        --arms fp8,bf16 --fp8-decode evidence,default                          # H200: the evidence runs' batch

Measured on CPU (2026-12-02, torch 2.13, transformers 5.24, the first command with ``--model-dir`` a save_pretrained
copy of the embedded model; max |dlogp| / tokens > 1 nat / tmpe):

    FP8, eager    rollout vs trainer: TRL pos 1.357 / 4 of 2253 / 1.093 (identical: the 30% of tokens on unpadded rows);
                  gen pos 0.000 / 0 / 1.0000 (every log-prob identical); trainer vs BF16 shadow 1.656 / 14 / 1.169
    BF16, eager   TRL pos 0.273 / 0 of 2462 / 1.024; gen pos every log-prob identical
    FP8, sdpa     TRL pos 1.864 / 11 of 2316 / 1.137; gen pos 1.317 / 8 / 1.128; vs BF16 shadow 2.571 / 20 / 1.189
    BF16, sdpa    TRL pos 0.310 / 0 of 2505 / 1.032; gen pos 0.357 / 0 / 1.031

CPU's sdpa sums a decode step's attention in another order than a full forward (its unpadded rows differ too); eager
attention computes both alike, so there the positions are the whole difference.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _load(model_dir: str | None, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        from calclip.models import load_default_model

        model, tokenizer = load_default_model(dtype=torch.float32)
    return model.to(device).eval(), tokenizer


def arithmetic_prompts(tokenizer, num_prompts: int, seed: int) -> list[list[int]]:
    """The prompts of calclip's `arithmetic` task (same messages and operand ranges), tokenized with the chat
    template as TRL does; built here so that the probe needs no `datasets`."""
    from calclip.tasks import ARITHMETIC_SYSTEM_PROMPT

    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-*")
        messages = [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT},
                    {"role": "user", "content": f"What is {a} {op} {b}?"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def left_padded(prompts: list[list[int]], repeats: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [p for p in prompts for _ in range(repeats)]
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
    return ids, mask


def rollout(model: nn.Module, ids, mask, new_tokens: int, pad: int, seed: int):
    """generate with the KV cache; returns completions [B, T], their mask (through the first EOS) and the sampled
    tokens' log-probs under the processed scores [B, T]."""
    torch.manual_seed(seed)
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=pad, eos_token_id=pad)
    completion = out.sequences[:, ids.shape[1]:]
    logps = torch.stack([torch.log_softmax(s.float(), -1).gather(-1, completion[:, t, None])[:, 0]
                         for t, s in enumerate(out.scores)], 1)
    eos = completion == pad
    first = torch.where(eos.any(1), eos.int().argmax(1), completion.shape[1])
    completion_mask = (torch.arange(completion.shape[1], device=ids.device)[None] <= first[:, None]).long()
    return completion, completion_mask, logps


def trainer_logps(model, ids, mask, completion, completion_mask, positions: str, chunk: int = 16) -> torch.Tensor:
    """Full forwards of prompt + completion, as the trainer's old log-probs (chunks of ``chunk`` rows, like TRL's
    per_device_train_batch_size): ``positions`` "trl" passes none, "gen" passes generate's."""
    from calclip.rollout.positions import positions_from_attention_mask

    full, attention = torch.cat([ids, completion], 1), torch.cat([mask, completion_mask], 1)
    out = []
    for start in range(0, full.shape[0], chunk):
        rows = slice(start, start + chunk)
        extra = {"position_ids": positions_from_attention_mask(attention[rows])} if positions == "gen" else {}
        with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
            logits = model(input_ids=full[rows], attention_mask=attention[rows], use_cache=False, **extra).logits
        logits = logits[:, ids.shape[1] - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, completion[rows, :, None])[..., 0])
    return torch.cat(out)


def compare(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> str:
    gap = (a - b).abs()[mask.bool()]
    above = int((gap > 1.0).sum())
    return (f"{float(gap.max()):.3f} | {float(torch.exp(gap).mean()):.4f} | "
            f"{above / gap.numel() * 100:.2f}% ({above}) | {float((gap == 0).float().mean()) * 100:.1f}%")


@contextlib.contextmanager
def fp8_decode_setting(name: str):
    """'evidence': the two-launch decode and no split-K GEMM (the code and flags of the 2026-12-01 runs);
    'default': today's automatic choices (fused decode in eager CUDA calls, split-K for small-M GEMMs)."""
    import calclip.fp8.gemm as gemm
    import calclip.fp8.linear_math as linear

    saved = gemm.SPLITK_MAX_M
    if name == "evidence":
        gemm.SPLITK_MAX_M = 0
    linear._gemm_choice.clear()  # backend decisions are cached per shape
    try:
        yield 0 if name == "evidence" else None
    finally:
        gemm.SPLITK_MAX_M = saved
        linear._gemm_choice.clear()


def run_arm(opts, base: nn.Module, tokenizer, device, attn: str, arm: str, decode: str) -> None:
    from calclip.fp8 import Fp8Config, bf16_shadow, quantize_model

    model = copy.deepcopy(base)
    model.config._attn_implementation = attn  # looked up on every forward
    pad = tokenizer.pad_token_id
    ids, mask = left_padded(arithmetic_prompts(tokenizer, opts.prompts, opts.seed), opts.rollouts, pad, device)
    with fp8_decode_setting(decode) if arm == "fp8" else contextlib.nullcontext(None) as fused_max_m:
        if arm == "fp8":
            model = quantize_model(model, Fp8Config(decode_fused_max_m=fused_max_m))
        start = time.time()
        completion, completion_mask, rollout_logps = rollout(model, ids, mask, opts.new_tokens, pad, opts.seed + 1)
        seconds = time.time() - start
        trl = trainer_logps(model, ids, mask, completion, completion_mask, "trl")
        gen = trainer_logps(model, ids, mask, completion, completion_mask, "gen")
        shadow = None
        if arm == "fp8":
            with bf16_shadow(model):
                shadow = trainer_logps(model, ids, mask, completion, completion_mask, "gen")
    name = f"{arm}{'/' + decode if arm == 'fp8' and device.type == 'cuda' else ''}, {attn}"
    tokens = int(completion_mask.sum())
    pads = sorted({int(n) for n in (mask == 0).sum(1).tolist()})
    print(f"\n{name}: {ids.shape[0]} rollouts, prompt pads {pads}, {tokens} completion tokens, "
          f"generate {seconds:.0f} s")
    print("| pair | max abs dlogp | token_mult_prob_error | > 1 nat | identical |\n|---|---|---|---|---|")
    print(f"| rollout vs trainer, TRL pos | {compare(rollout_logps, trl, completion_mask)} |")
    print(f"| rollout vs trainer, gen pos | {compare(rollout_logps, gen, completion_mask)} |")
    print(f"| trainer TRL pos vs gen pos | {compare(trl, gen, completion_mask)} |")
    if shadow is not None:
        print(f"| trainer vs BF16 shadow, gen pos | {compare(gen, shadow, completion_mask)} |")
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-dir", default=None, help="a save_pretrained folder; default: the embedded GGUF")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per prompt (num_generations)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn", default="eager,sdpa", help="attention implementations, comma-separated")
    parser.add_argument("--arms", default="fp8", help="fp8 and/or bf16 (the same model unquantized)")
    parser.add_argument("--fp8-decode", default="evidence", help="evidence and/or default (CUDA only)")
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    import transformers

    print(f"probe_mismatch_bursts: {where}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"{opts.prompts} prompts x {opts.rollouts} rollouts, {opts.new_tokens} new tokens, seed {opts.seed}")
    decodes = opts.fp8_decode.split(",") if device.type == "cuda" else ["evidence"]
    base, tokenizer = _load(opts.model_dir, device)
    for attn in opts.attn.split(","):
        for arm in opts.arms.split(","):
            for decode in decodes if arm == "fp8" else ["-"]:
                run_arm(opts, base, tokenizer, device, attn, arm, decode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
