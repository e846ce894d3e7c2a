"""Each FP8 recipe (``fp8_recipe``: blockwise, rowwise, tensorwise) against BF16, in one run.

Speed: model-level fwd+bwd+AdamW step of a random-weight Llama (the model rows of docs/benchmarks.md: 8 layers hidden
2048 intermediate 8192, and 4 layers hidden 4096 intermediate 14336; 8 x 2048 tokens, bf16 weights, fused AdamW,
HF causal-LM loss; LM head and embeddings BF16 in every arm), eager and torch.compile'd. Every arm has its own
model built from the same seed; arms are interleaved (round r runs each arm's steps in turn) and each arm's
median step over the rounds is reported, with the ratio BF16 / arm in the same mode (> 1: faster than BF16).
``--stock`` adds torchao's own ``convert_to_float8_training`` modules (no calclip shadow flag or non-finite
count) to show what calclip's wrapper costs.

Noise: the real SmolLM2-135M-Instruct (embedded GGUF, ``calclip.models.load_default_model``; fp32 masters and
bf16 autocast on CUDA, fp32 on CPU). One rollout of the arithmetic_small prompts is sampled once by the
unconverted model and shared by every arm; advantages are group-normalized seeded random rewards (the ratio
noise does not depend on what a reward means, and every group gets non-zero advantages). Per arm: old
log-probs under the arm's FP8 forward and its BF16 shadow, ``--updates`` AdamW mini-batch updates of the
clipped surrogate (static [1-eps, 1+eps]) on the FP8 forward, then the same two forwards again. Reported:
token-mult-prob-error FP8 vs BF16 shadow (current weights, same tokens), the share of A<0 tokens whose ratio
falls below 1 - eps under FP8 and under the shadow (what static clipping drops, ``clip/neg_low_frac_fp8_static``
vs ``clip/neg_low_frac_bf16``), and the std of log r for both.

    python benchmarks/bench_recipes.py                       # H200: both sections
    python benchmarks/bench_recipes.py --section speed --rows 8x2048x8192 --modes eager
    python benchmarks/bench_recipes.py --tiny                # CPU dry run: tiny shapes and tiny model, eager
    python benchmarks/bench_recipes.py --tiny --section speed --modes compiled --stock   # CPU: compile paths trace

Needs torchao (>= 0.18, pure Python on this path) for rowwise/tensorwise; an arm that fails prints its error and
the table goes on.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from _common import table  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

RECIPES = ("blockwise", "rowwise", "tensorwise")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


def _convert(model, arm: str):
    """The arm's model, converted in place: 'bf16' leaves it; a recipe goes through calclip.fp8.quantize_model;
    'stock-<recipe>' through torchao's own convert_to_float8_training with calclip's layer selection."""
    from calclip.fp8 import Fp8Config, quantize_model

    if arm == "bf16":
        return model
    if arm.startswith("stock-"):
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(arm.removeprefix("stock-"))
        config = dataclasses.replace(config, emulate=next(model.parameters()).device.type != "cuda")
        return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    return quantize_model(model, Fp8Config(recipe=arm))


# ------------------------------------------------------------------------------------------------ speed


def _parse_row(text: str) -> tuple[int, int, int]:
    layers, hidden, inter = (int(v) for v in text.lower().split("x"))
    return layers, hidden, inter


def _build_llama(row, *, vocab: int, seq: int, device, dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, inter = row
    heads = max(hidden // 128, 1)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                         max_position_embeddings=seq, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype)


def speed(opts, device) -> None:
    arms = ["bf16", *opts.recipes] + ([f"stock-{r}" for r in opts.recipes if r != "blockwise"] if opts.stock else [])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for row_text in opts.rows:
        row = _parse_row(row_text)
        print(f"\n== speed: Llama {row[0]} layers, hidden {row[1]}, intermediate {row[2]}, heads {row[1] // 128} "
              f"(MHA), vocab {opts.vocab}; {opts.batch}x{opts.seq} tokens, {dtype}, "
              f"AdamW(fused={device.type == 'cuda'})"
              f"; {opts.rounds} rounds x {opts.steps} steps after {opts.warmup} warm-up steps ==", flush=True)
        ids = torch.randint(0, opts.vocab, (opts.batch, opts.seq), device=device,
                            generator=torch.Generator(device).manual_seed(0))
        runners: dict[tuple[str, str], object] = {}
        failed: dict[tuple[str, str], str] = {}
        peak: dict[tuple[str, str], float] = {}
        for arm in arms:
            try:
                model = _convert(_build_llama(row, vocab=opts.vocab, seq=opts.seq, device=device, dtype=dtype), arm)
            except Exception as err:  # noqa: BLE001 - one arm failing must not stop the table
                for mode in opts.modes:
                    failed[(arm, mode)] = _error_line(err)
                continue
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
            for mode in opts.modes:
                forward = torch.compile(model) if mode == "compiled" else model

                def step(forward=forward, optimizer=optimizer):
                    optimizer.zero_grad(set_to_none=True)
                    forward(input_ids=ids, labels=ids).loss.backward()
                    optimizer.step()

                started = time.perf_counter()
                try:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                    for _ in range(opts.warmup):
                        step()
                    _sync(device)
                    if device.type == "cuda":
                        peak[(arm, mode)] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
                    runners[(arm, mode)] = step
                    print(f"   {arm:>16} {mode:>8}: warm-up {time.perf_counter() - started:.1f} s", flush=True)
                except Exception as err:  # noqa: BLE001
                    failed[(arm, mode)] = _error_line(err)
                    print(f"   {arm:>16} {mode:>8}: FAILED {failed[(arm, mode)]}", flush=True)
                    if opts.traceback:
                        traceback.print_exc()
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
        for _ in range(opts.rounds):  # interleaved: A B C ... A B C ...
            for key, step in runners.items():
                _sync(device)
                started = time.perf_counter()
                for _ in range(opts.steps):
                    step()
                _sync(device)
                samples[key].append((time.perf_counter() - started) / opts.steps * 1e3)
        rows = []
        for mode in opts.modes:
            base = statistics.median(samples[("bf16", mode)]) if samples.get(("bf16", mode)) else None
            for arm in arms:
                key = (arm, mode)
                if key in failed:
                    rows.append([arm, mode, "failed", "-", "-", failed[key][:90]])
                    continue
                ms = statistics.median(samples[key])
                spread = f"{min(samples[key]):.1f}-{max(samples[key]):.1f}"
                ratio = f"{base / ms:.2f}x" if base else "-"
                memory = f"{peak[key]:.2f}" if key in peak else "-"
                rows.append([arm, mode, f"{ms:.1f}", ratio, memory, spread])
        table(["arm", "mode", "median step (ms)", "BF16/arm", "peak step mem (GiB)", "range over rounds (ms)"], rows)
        del runners, samples
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ noise


def _rollout(model, tokenizer, opts, device):
    """(sequences [N, P+T], attention mask [N, P+T], completion mask [N, T], prompt length P): one sampled
    rollout of the arithmetic_small prompts by ``model`` (unconverted)."""
    from calclip.tasks import get_task

    dataset = get_task("arithmetic_small").build_dataset(opts.prompts, seed=0)
    texts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
             for row in dataset]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    torch.manual_seed(0)
    with torch.no_grad(), _autocast(device):
        sequences = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   max_new_tokens=opts.max_new_tokens, num_return_sequences=opts.generations,
                                   pad_token_id=tokenizer.pad_token_id)
    prompt_len = enc["input_ids"].shape[1]
    completion = sequences[:, prompt_len:]
    # completion tokens up to and including the first EOS
    is_eos = completion == tokenizer.eos_token_id
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    completion_mask = ~after_eos
    prompt_mask = enc["attention_mask"].repeat_interleave(opts.generations, dim=0)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    return sequences, attention_mask, completion_mask.float(), prompt_len


def _autocast(device):
    import contextlib

    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _completion_logps(model, sequences, attention_mask, prompt_len, rows=None):
    rows = slice(None) if rows is None else rows
    with _autocast(device=sequences.device):
        logits = model(input_ids=sequences[rows], attention_mask=attention_mask[rows]).logits
    logits = logits[:, prompt_len - 1:-1].float()
    targets = sequences[rows, prompt_len:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def _batched_logps(model, sequences, attention_mask, prompt_len, chunk):
    with torch.no_grad():
        parts = [_completion_logps(model, sequences, attention_mask, prompt_len, slice(i, i + chunk))
                 for i in range(0, sequences.shape[0], chunk)]
    return torch.cat(parts)


def noise(opts, device) -> None:
    from calclip.fp8 import bf16_shadow
    from calclip.losses import clipped_surrogate, token_mult_prob_error
    from calclip.models import load_model

    started = time.perf_counter()
    base, tokenizer = load_model(opts.noise_model)
    base = base.to(device).float()
    print(f"\n== noise: model {opts.noise_model!r} loaded in {time.perf_counter() - started:.1f} s; "
          f"{'fp32 masters + bf16 autocast' if device.type == 'cuda' else 'fp32'} on {device.type} ==", flush=True)
    sequences, attention_mask, mask, prompt_len = _rollout(base, tokenizer, opts, device)
    n, t = mask.shape
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(opts.prompts, opts.generations, generator=generator)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    advantages = advantages.to(device)
    neg = (mask > 0) & (advantages[:, None] < 0)
    low, high = 1.0 - opts.epsilon, 1.0 + opts.epsilon
    print(f"   rollout: {n} completions x {t} tokens, {int(mask.sum())} completion tokens, {int(neg.sum())} with A<0; "
          f"{opts.updates} AdamW updates at lr {opts.lr}, mini-batches of {n // opts.updates}", flush=True)

    rows = []
    for arm in ["bf16", *opts.recipes]:
        started = time.perf_counter()
        try:
            policy = _convert(copy.deepcopy(base), arm)

            def logps(shadow: bool):
                with bf16_shadow(policy) if shadow else _nullcontext():  # noqa: F821
                    return _batched_logps(policy, sequences, attention_mask, prompt_len, opts.chunk)  # noqa: F821

            old_q, old_b = logps(False), logps(True)
            optimizer = torch.optim.AdamW(policy.parameters(), lr=opts.lr)
            per_update = n // opts.updates
            for update in range(opts.updates):
                mb = slice(update * per_update, (update + 1) * per_update)
                logp = _completion_logps(policy, sequences, attention_mask, prompt_len, mb)
                loss, _ = clipped_surrogate(logp, old_q[mb], advantages[mb], mask[mb], low=low, high=high)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            new_q, new_b = logps(False), logps(True)
        except Exception as err:  # noqa: BLE001
            rows.append([arm, "failed", "-", "-", "-", "-", "-", _error_line(err)[:90]])
            if opts.traceback:
                traceback.print_exc()
            continue
        keep = mask > 0
        log_r_q, log_r_b = (new_q - old_q)[keep], (new_b - old_b)[keep]
        share_q = ((neg & (torch.exp(new_q - old_q) < low)).sum() / neg.sum()).item()
        share_b = ((neg & (torch.exp(new_b - old_b) < low)).sum() / neg.sum()).item()
        tmpe = token_mult_prob_error(new_q, new_b, mask).item()
        tmpe_before = token_mult_prob_error(old_q, old_b, mask).item()
        rows.append([arm, f"{tmpe_before:.4f}", f"{tmpe:.4f}", f"{share_q:.4f}", f"{share_b:.4f}",
                     f"{log_r_q.std().item():.4f}", f"{log_r_b.std().item():.4f}",
                     f"{time.perf_counter() - started:.1f} s"])
        print(f"   {arm}: done in {time.perf_counter() - started:.1f} s", flush=True)
        # ruff checks logps above as if it ran after this del: its noqa F821 (astral-sh/ruff#9858)
        del policy, optimizer
    table(["arm", "tmpe FP8 vs shadow, before", "after updates", "A<0 below 1-eps FP8", "A<0 below 1-eps shadow",
           "std log r FP8", "std log r shadow", "time / error"], rows)
    print("('bf16' has no FP8 layers: its shadow is itself. tmpe: 1.0 perfect, < 1.03-1.05 acceptable.)")


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=("all", "speed", "noise"), default="all")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=None,
                        help="default: eager and compiled (--tiny: eager)")
    parser.add_argument("--rows", nargs="+", default=["8x2048x8192", "4x4096x14336"],
                        help="model rows LAYERSxHIDDENxINTERMEDIATE")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm (compilation happens here)")
    parser.add_argument("--stock", action="store_true", help="also time torchao's own Float8Linear modules")
    parser.add_argument("--noise-model", default=None,
                        help="'default' (SmolLM2; the default), 'tiny' (the default with --tiny) or a local directory")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--chunk", type=int, default=16, help="sequences per no-grad forward")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny shapes, the tiny model, eager only")
    parser.add_argument("--cpu", action="store_true", help="run the given sizes on CPU (emulated FP8)")
    parser.add_argument("--traceback", action="store_true", help="print full tracebacks of failing arms")
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.rows, opts.batch, opts.seq, opts.vocab = ["2x128x256"], 2, 64, 256
        opts.rounds, opts.steps, opts.warmup = 2, 1, 1
        opts.modes = opts.modes or ["eager"]
        opts.noise_model = opts.noise_model or "tiny"
        opts.prompts, opts.generations, opts.max_new_tokens = 2, 4, 8
        opts.updates, opts.lr = 2, 1e-2

    opts.modes = opts.modes or ["eager", "compiled"]
    opts.noise_model = opts.noise_model or "default"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import transformers

    print(f"bench_recipes: {time.strftime('%Y-%m-%d %H:%M:%S')}  torch {torch.__version__}  transformers "
          f"{transformers.__version__}  device {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    try:
        import torchao

        print(f"torchao {torchao.__version__}")
    except ImportError:
        print("torchao not installed: rowwise/tensorwise arms will fail (pip install torchao)")
    if device.type != "cuda" and not (opts.tiny or opts.cpu):
        print("no CUDA: use --tiny for a CPU dry run (or --cpu to run the given sizes on CPU)")
        return
    if opts.section in ("all", "speed"):
        speed(opts, device)
    if opts.section in ("all", "noise"):
        noise(opts, device)


if __name__ == "__main__":
    main()
