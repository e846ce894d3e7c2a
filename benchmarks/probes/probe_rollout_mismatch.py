"""Why FP8 rollout and trainer log-probs disagree although both use the same FP8 codes (CPU, the real SmolLM2).

The evidence runs log ``mismatch/token_mult_prob_error`` (rollout vs trainer log-probs of the sampled tokens) at
1.05-1.10 for FP8 against 1.01 for BF16 (docs/evidence.md), and ``calclip demo`` on CPU shows ~1.10 for FP8 and
1.0000 with ``--no-fp8``. This probe measures it without the trainer and says where it comes from:

    python benchmarks/probes/probe_rollout_mismatch.py                # CPU, SmolLM2-135M-Instruct, ~1 min
    python benchmarks/probes/probe_rollout_mismatch.py --model tiny   # a random 4-layer model (no GGUF)
    python benchmarks/probes/probe_rollout_mismatch.py --device cuda  # the same on a GPU (its attention kernels)

1. Per arm (fp32; bf16 autocast; FP8 on fp32 masters; FP8 under bf16 autocast): HF ``generate`` (KV cache, one
   token per decode step) samples completions and keeps the raw logits of each step; a single full forward of
   the finished sequences (what the trainer computes) gives the same tokens' log-probs. Printed: max and mean
   |log-prob difference|, token_mult_prob_error (mean of exp|diff|, as calclip logs it) and the share of tokens
   whose log-probs are equal.
2. Full forwards of different lengths and batch sizes (a prefix and the whole sequence; one row and four), over
   every prefix position: whether the result depends on what else is in the forward (the FP8 layers' scales are
   per token; the attention and the GEMMs may still sum in another order).
3. For the FP8 arm: the relative difference between each layer's input in the first decode step and in the full
   forward, at the same token, layer by layer: where the two paths part and how the difference grows.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _load(name: str, device: torch.device) -> nn.Module:
    if name == "tiny":
        from calclip.models.tiny import build_tiny_model, build_tiny_tokenizer

        model = build_tiny_model(build_tiny_tokenizer(), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, seed=0).float()
    else:
        from calclip.models import load_default_model

        loaded = load_default_model(dtype=torch.float32)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
    return model.to(device).eval()


def rollout_vs_full(model: nn.Module, prompt: torch.Tensor, new_tokens: int, autocast: bool) -> dict[str, float]:
    ctx = torch.autocast(prompt.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = gen.sequences[:, prompt.shape[1]:]
        rollout = torch.stack([torch.log_softmax(s.float(), -1) for s in gen.logits], 1)
        rollout = rollout.gather(-1, tokens[..., None])[..., 0]
        logits = model(gen.sequences).logits[:, prompt.shape[1] - 1:-1].float()
        full = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    diff = (rollout - full).abs()
    return {"max": float(diff.max()), "mean": float(diff.mean()), "tmpe": float(torch.exp(diff).mean()),
            "equal": float((diff == 0).float().mean()), "sequences": gen.sequences}


def full_forwards_agree(model: nn.Module, seq: torch.Tensor, prefix: int) -> tuple[float, float]:
    """Max |log-prob difference| over every position of the prefix: prefix alone vs the whole sequence, and one row
    alone vs the same row in the batch (the attention then runs over other lengths / batch sizes)."""
    with torch.no_grad():
        short = torch.log_softmax(model(seq[:, :prefix]).logits.float(), -1)
        whole = torch.log_softmax(model(seq).logits[:, :prefix].float(), -1)
        one = torch.log_softmax(model(seq[:1, :prefix]).logits.float(), -1)
    return float((short - whole).abs().max()), float((short[:1] - one).abs().max())


def layer_by_layer(model: nn.Module, prompt: torch.Tensor) -> list[tuple[str, float]]:
    """Relative max difference of every linear's input: first decode step vs the full forward, same token."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    decode: dict[str, list[torch.Tensor]] = {}
    full: dict[str, torch.Tensor] = {}

    def keep(store, name, many):
        def hook(module, args, output):
            x = args[0].detach().clone()
            store.setdefault(name, []).append(x) if many else store.setdefault(name, x)
        return hook

    handles = [m.register_forward_hook(keep(decode, n, True)) for n, m in linears]
    with torch.no_grad():
        seq = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2,
                             min_new_tokens=2, do_sample=False, pad_token_id=0)
    for h in handles:
        h.remove()
    handles = [m.register_forward_hook(keep(full, n, False)) for n, m in linears]
    with torch.no_grad():
        model(seq)
    for h in handles:
        h.remove()
    at = prompt.shape[1]  # the first decode step's token
    rows = []
    for name, _ in linears:
        a, b = decode[name][1][:, 0], full[name][:, at]
        rows.append((name, float((a - b).abs().max() / b.abs().max())))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct, GGUF) or 'tiny'")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args(argv)
    from calclip.fp8 import Fp8Config, quantize_model

    torch.manual_seed(0)
    device = torch.device(opts.device)
    base = _load(opts.model, device)
    vocab = base.config.vocab_size
    prompt = torch.randint(3, min(vocab, 20000), (opts.batch, opts.prompt),
                           generator=torch.Generator().manual_seed(1)).to(device)
    fp8 = quantize_model(copy.deepcopy(base), Fp8Config())
    print(f"probe_rollout_mismatch: {opts.model}, batch {opts.batch}, prompt {opts.prompt}, {opts.new_tokens} sampled "
          f"tokens, torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}\n")
    print("| arm | max abs dlogp | mean abs dlogp | token_mult_prob_error | equal log-probs |\n|---|---|---|---|---|")
    sequences = None
    for name, model, autocast in (("fp32", base, False), ("bf16 autocast", base, True),
                                  ("FP8, fp32 masters", fp8, False), ("FP8 + bf16 autocast", fp8, True)):
        torch.manual_seed(0)
        r = rollout_vs_full(model, prompt, opts.new_tokens, autocast)
        sequences = r["sequences"] if sequences is None else sequences
        print(f"| {name} | {r['max']:.3g} | {r['mean']:.3g} | {r['tmpe']:.4f} | {r['equal'] * 100:.1f}% |")
    print("\nfull forwards (no cache), max abs dlogp over the prefix: prefix vs whole sequence / 1 row vs 4 rows")
    for name, model in (("fp32", base), ("FP8", fp8)):
        a, b = full_forwards_agree(model, sequences, opts.prompt)
        print(f"  {name}: {a:.3g} / {b:.3g}")
    print("\nFP8 (fp32 masters): relative max difference of each linear's input, first decode step vs full forward")
    for name, rel in layer_by_layer(fp8, prompt):
        print(f"  {name:45s} {rel:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
