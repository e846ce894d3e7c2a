"""The host work of one decode step of the colocated GRPO engine, in vLLM 0.24.0's own Python, on a CPU.

    SITE=$(bash benchmarks/vllm_cpu_site.sh .vllm-cpu | tail -n 1)
    PYTHONPATH=$SITE python benchmarks/probe_vllm_host_cpu.py [--batch 128] [--tokens 256] [--rounds 3] \
        [--gc on|off] [--prefix-caching on|off] [--block-size 16]

Why: on an H100 the 8-layer GRPO rollout kept the GPU busy 8% of its wall (docs/benchmarks-log.md,
seventh session): the host sets the rollout's speed, for BF16 and FP8 alike. This probe times the parts of
that host work that need no GPU, with vLLM's real classes: the scheduler (``Scheduler.schedule`` and
``update_from_output``, with a KV cache manager of the engine's block size) and the front end's
``OutputProcessor.process_outputs`` (incremental detokenization, the per-token log-prob dicts, the request
outputs), for ``--batch`` requests decoding ``--tokens`` tokens each, one token per request per step, as the engine
does at batch size ``--batch`` after the prefill. The model runner's part (input preparation, the sampler, the
copies) and the executor's need CUDA and are not here.

Settings (each a column): ``trl`` is what TRL 1.16's colocated ``VLLMGeneration.generate`` asks (``logprobs=0``,
detokenize on, ``min_tokens`` as the benchmark's workers set it, ``output_kind`` FINAL_ONLY as ``LLM.generate``
sets it); ``trl_no_detokenize`` the same with ``detokenize=False`` (``--grpo-detokenize off``; TRL reads token ids
and log-probs only); ``no_logprobs`` the decode benchmark's requests (``detokenize=False``, no log-probs);
``trl_flat`` is ``trl_no_detokenize`` with vLLM's ``flat_logprobs`` (log-probs kept in a few flat lists instead of a
dict and a ``Logprob`` per token; TRL's ``extract_logprobs`` reads them through the same sequence interface). The
``read_logprobs`` part reads every log-prob of the finished outputs as TRL's extraction does (once per rollout, shown
per decode step).
Model outputs are synthetic (token ids drawn from the tokenizer's vocabulary, log-prob -0.5, rank 1); what the
engine returns is checked against them (``check_outputs``). Printed: microseconds per step of each part, median
over ``--rounds`` rounds, each round a fresh scheduler and output processor. Timings depend on the host; compare
columns measured in one run. Python's garbage collector runs as in the engine (``--gc on``, the default): the
collections that a part's allocations trigger are charged to that part, and their cost grows with everything else the
process holds (a trainer holds far more than this probe); ``--gc off`` times the parts' own work. Prefix caching is on
(``--prefix-caching on``, the default: vLLM's own, which TRL's colocated ``LLM(...)`` keeps): each request then hashes
every block of 16 tokens it fills, as the engine's requests do; before 2026-12-05 (eighth session) the probe ran
without it, as ``--prefix-caching off`` does now.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import _common  # noqa: E402  (puts the repository root on sys.path)

SETTINGS = {  # SamplingParams beyond TRL's fixed ones (n=1, temperature 1, top_p 1, top_k 0, min_p 0, penalty 1)
    "trl": {"logprobs": 0, "detokenize": True},
    "trl_no_detokenize": {"logprobs": 0, "detokenize": False},
    "no_logprobs": {"logprobs": None, "detokenize": False},
    "trl_flat": {"logprobs": 0, "detokenize": False, "flat_logprobs": True},
}
PARTS = ("schedule", "update_from_output", "process_outputs", "read_logprobs")


def build_config(batch: int, tokens: int, prompt_len: int, model_dir: str, prefix_caching: bool = True,
                 block_size: int = 16):
    """vLLM's engine config for a tiny Llama at ``model_dir`` with TRL 1.16's colocated arguments
    (``max_num_seqs`` = the batch, ``max_num_batched_tokens=4096``), on vLLM's CPU platform (the GPU wheel reports
    none on a CPU; the scheduler's code is the same)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=batch,
                      max_num_batched_tokens=4096, max_model_len=prompt_len + tokens + 16, enforce_eager=True,
                      enable_prefix_caching=prefix_caching, block_size=block_size, seed=0)
    return args.create_engine_config()


def save_tiny_llama(model_dir: str, tokenizer) -> None:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                   max_position_embeddings=4096)
    cfg.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def sampling_params(setting: str, tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                            max_tokens=tokens, min_tokens=tokens, **SETTINGS[setting])
    params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate sets it
    return params


def run_round(setting: str, vllm_config, tokenizer, batch: int, tokens: int, prompt_len: int, seed: int) -> dict:
    """One rollout of ``batch`` requests x ``tokens`` decode steps through a fresh scheduler and output processor;
    returns the seconds spent in each part per decode step (the prefill step left out), the final outputs, and the
    block hashes each request held before the last step (0 without prefix caching)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    block = vllm_config.cache_config.block_size
    blocks = batch * (-(-(prompt_len + tokens) // block)) + 16
    kv_config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["model.layers.0.self_attn.attn"], FullAttentionSpec(block_size=block, num_kv_heads=8, head_size=128,
                                                             dtype=torch.bfloat16))])
    vllm_config.cache_config.num_gpu_blocks = blocks  # what EngineCore sets after profiling the memory
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_config,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=block,
                          log_stats=False)
    processor = OutputProcessor(tokenizer, log_stats=False)
    hasher = None
    if vllm_config.cache_config.enable_prefix_caching:  # what EngineCore.__init__ builds for its requests
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(block, hash_fn)
    params = sampling_params(setting, tokens)
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    # characters only (ids past the special tokens), never EOS
    first = max(tokenizer.all_special_ids) + 1
    sampled = rng.integers(first, vocab, size=(tokens, batch))
    for i in range(batch):
        request = EngineCoreRequest(request_id=str(i), prompt_token_ids=rng.integers(first, vocab, prompt_len).tolist(),
                                    mm_features=None, sampling_params=params, pooling_params=None,
                                    arrival_time=time.time(), lora_request=None, cache_salt=None,
                                    data_parallel_rank=None, external_req_id=str(i))
        processor.add_request(request, prompt=None)
        scheduler.add_request(Request.from_engine_core_request(request, block_hasher=hasher))
    spent = {part: 0.0 for part in PARTS}
    finished = []
    hashed = []
    for step in range(tokens):
        if step == tokens - 1:
            hashed = [len(r.block_hashes) for r in scheduler.requests.values()]
        clock = time.perf_counter()
        scheduled = scheduler.schedule()
        after_schedule = time.perf_counter()
        ids = sorted(scheduled.num_scheduled_tokens, key=int)
        rows = [int(r) for r in ids]
        token_col = sampled[step, rows]
        logprobs = None
        if params.logprobs is not None:
            logprobs = LogprobsLists(token_col[:, None].astype(np.int32), np.full((len(ids), 1), -0.5, np.float32),
                                     np.ones(len(ids), np.int32))
        runner_output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=[[int(t)] for t in token_col], logprobs=logprobs)
        before_update = time.perf_counter()
        core_outputs = scheduler.update_from_output(scheduled, runner_output)
        after_update = time.perf_counter()
        outs = [o for engine_outputs in core_outputs.values() for o in engine_outputs.outputs]
        result = processor.process_outputs(outs)
        done = time.perf_counter()
        finished += result.request_outputs
        if step:  # the first step is the prefill (every prompt scheduled); decode steps from here
            spent["schedule"] += after_schedule - clock
            spent["update_from_output"] += after_update - before_update
            spent["process_outputs"] += done - after_update
    if params.logprobs is not None:  # what TRL then does once with the outputs, charged per decode step
        clock = time.perf_counter()
        read_logprobs(finished)
        spent["read_logprobs"] = time.perf_counter() - clock
    return {"per_step_s": {part: s / (tokens - 1) for part, s in spent.items()}, "outputs": finished,
            "sampled": sampled, "block_hashes": hashed}


def read_logprobs(outputs) -> int:
    """Read every log-prob of ``outputs`` as TRL 1.16's ``extract_logprobs`` does (each position's {token id:
    Logprob} mapping, its items by rank, each logprob and rank); returns how many were read. (TRL's module itself
    imports vLLM's ``LLM``, whose server dependencies this CPU site lacks.)"""
    count = 0
    for out in outputs:
        for completion in out.outputs:
            for position in completion.logprobs:
                for _, item in sorted(position.items(), key=lambda pair: pair[1].rank):
                    count += item.logprob is not None and item.rank is not None
    return count


def check_outputs(outputs, sampled: np.ndarray, setting: str, tokenizer) -> None:
    """What the engine would hand TRL: every request finished once, with the sampled ids, one log-prob dict per
    token holding that id (-0.5, rank 1) when log-probs were asked, and text only with detokenization on."""
    batch = sampled.shape[1]
    assert sorted(int(o.request_id) for o in outputs) == list(range(batch)), "each request finishes once"
    for out in outputs:
        completion, = out.outputs
        expected = sampled[:, int(out.request_id)].tolist()
        assert list(completion.token_ids) == expected, f"request {out.request_id}: token ids"
        if SETTINGS[setting]["logprobs"] is None:
            assert completion.logprobs is None, f"request {out.request_id}: log-probs not asked"
        else:
            assert len(completion.logprobs) == len(expected)
            for token, step in zip(expected, completion.logprobs):
                assert step[token].logprob == -0.5 and step[token].rank == 1
        text = tokenizer.decode(expected)
        assert completion.text == (text if SETTINGS[setting]["detokenize"] else ""), f"request {out.request_id}: text"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=14)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    parser.add_argument("--gc", default="on", choices=("on", "off"),
                        help="Python's garbage collector during the rounds (on: as in the engine; off: each part's own "
                             "work, without the collections its allocations trigger)")
    parser.add_argument("--prefix-caching", default="on", choices=("on", "off"),
                        help="vLLM's prefix caching (on: its default and the colocated engine's; every request hashes "
                             "each full block of tokens)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="the KV cache's tokens per block (vLLM's default on CUDA: 16): each request allocates, "
                             "and with prefix caching hashes, one block per that many tokens")
    opts = parser.parse_args(argv)
    settings = [s.strip() for s in opts.settings.split(",") if s.strip()]
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        parser.error(f"--settings: unknown {sorted(unknown)}; choose from {list(SETTINGS)}")
    from calclip.models.tiny import build_tiny_tokenizer
    from calclip.rollout.vllm_sync import gc_paused

    tokenizer = build_tiny_tokenizer()
    model_dir = tempfile.mkdtemp(prefix="probe_vllm_host_")
    save_tiny_llama(model_dir, tokenizer)
    config = build_config(opts.batch, opts.tokens, opts.prompt_len, model_dir, opts.prefix_caching == "on",
                          opts.block_size)
    import vllm

    times = {s: {part: [] for part in PARTS} for s in settings}
    hashes = set()
    for round_index in range(opts.rounds):  # settings in turn within each round
        for setting in settings:
            if opts.gc == "off":
                gc.collect()
            with gc_paused(opts.gc == "off"):  # what the trainer's vllm_pause_gc does around a rollout
                result = run_round(setting, config, tokenizer, opts.batch, opts.tokens, opts.prompt_len,
                                   round_index)
            check_outputs(result["outputs"], result["sampled"], setting, tokenizer)
            hashes.update(result["block_hashes"])
            for part in PARTS:
                times[setting][part].append(result["per_step_s"][part])
    print(f"vLLM {vllm.__version__} host work per decode step, batch {opts.batch}, {opts.tokens} tokens per request, "
          f"median of {opts.rounds} round(s), garbage collector {opts.gc}, KV blocks of {opts.block_size} tokens, "
          f"prefix caching {opts.prefix_caching} (block "
          f"hashes per request before the last step: {','.join(map(str, sorted(hashes)))}), us (CPU: {os.cpu_count()} "
          f"cores; outputs checked)")
    header = ["part", *settings]
    rows = [[part, *(f"{1e6 * statistics.median(times[s][part]):.0f}" for s in settings)] for part in PARTS]
    rows.append(["total", *(f"{1e6 * sum(statistics.median(times[s][p]) for p in PARTS):.0f}" for s in settings)])
    _common.table(header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
