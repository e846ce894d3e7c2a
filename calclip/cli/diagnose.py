"""``calclip diagnose``: versions, CUDA / Triton / ``torch._scaled_mm`` availability, and the FP8-vs-BF16 log-ratio
spread of a model on a fixed batch (``--plot``: of a policy moved a few steps, drawn)."""

from __future__ import annotations

import argparse
import time


def environment_report() -> dict[str, str]:
    """Versions and accelerator facts that decide which FP8 path calclip takes."""
    import platform

    import torch

    report = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "trl", "accelerate", "datasets", "wandb", "triton", "gguf", "vllm"):
        try:
            module = __import__(package)
            report[package] = getattr(module, "__version__", "installed")
        except Exception:  # not installed, or broken on this machine (triton without a GPU toolchain)
            report[package] = "not installed"
    try:
        import calclip

        report["calclip"] = calclip.__version__
    except Exception:
        report["calclip"] = "?"
    report["cuda"] = (
        f"{torch.version.cuda}, {torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "not available"
    )
    report["float8_e4m3fn dtype"] = "yes" if hasattr(torch, "float8_e4m3fn") else "no"
    report["torch._scaled_mm"] = _scaled_mm_status()
    report["cpu threads"] = str(torch.get_num_threads())
    return report


def _scaled_mm_status() -> str:
    import torch

    if not hasattr(torch, "_scaled_mm"):
        return "missing"
    if not torch.cuda.is_available():
        return "present (no CUDA: calclip emulates block FP8 GEMMs)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"present, but compute capability {major}.{minor} < 8.9 has no FP8 tensor cores"
    return f"present, compute capability {major}.{minor}"


DIAGNOSE_TEXT = (
    "Reinforcement learning fine-tunes a language model by sampling answers, scoring them and pushing up the "
    "log-probability of the good ones. In eight-bit floating point every matrix product is rounded, so the same "
    "tokens get slightly different probabilities than in full precision, and the importance ratio spreads out."
)


def fp8_logratio_spread(model, input_ids) -> dict[str, float]:
    """Quantize ``model`` to block FP8 (in place) and compare its next-token log-probs on ``input_ids`` [B, T]
    with the unquantized shadow's (master precision, `bf16_shadow`): std and max |log r| and
    token-mult-prob-error of log r = logp_fp8 - logp_shadow."""
    import torch

    from calclip.fp8.convert import quantize_model
    from calclip.fp8.shadow import bf16_shadow
    from calclip.losses.metrics import token_mult_prob_error

    input_ids = input_ids.to(next(model.parameters()).device)
    model = quantize_model(model)
    model.eval()

    def token_logps():
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    logp_fp8 = token_logps()
    with bf16_shadow(model):
        logp_shadow = token_logps()
    log_ratio = logp_fp8 - logp_shadow
    mask = torch.ones_like(log_ratio)
    return {
        "tokens": float(log_ratio.numel()),
        "log_ratio_std": float(log_ratio.std()),
        "log_ratio_max_abs": float(log_ratio.abs().max()),
        "token_mult_prob_error": float(token_mult_prob_error(logp_fp8, logp_shadow, mask)),
    }


def diagnose(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="calclip diagnose", description="environment + FP8-vs-BF16 spread")
    parser.add_argument("--model", default="tiny", help="'tiny' (random test model, seconds), 'default' "
                        "(SmolLM2-135M-Instruct, ~30 s) or a local directory")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row of the measurement batch")
    parser.add_argument("--plot", metavar="PATH", help="also move the policy a few AdamW steps with synthetic "
                        "advantages (calclip/monitoring/ratio_probe.py) and draw the FP8 and BF16-shadow log-ratio "
                        "histograms with the static and calibrated bounds to PATH (.png/.pdf/.svg; the plot extra)")
    parser.add_argument("--update-steps", type=int, default=4, help="AdamW steps between old and new log-probs "
                        "(--plot)")
    # 1e-6: docs/DESIGN.md's measured setting for SmolLM2; 4 steps at 1e-5 on one fixed batch move it so far (std of
    # log r ~1 for BF16 too) that most tokens of both precisions fall outside the bounds and the picture says
    # nothing about FP8. The random tiny model needs ~1e-3 to move visibly.
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of those steps (--plot)")
    parser.add_argument("--epsilon", type=float, default=0.2, help="static bounds 1-eps / 1+eps (--plot)")
    options = parser.parse_args(argv)
    if options.plot:
        from calclip.monitoring.plots import require_matplotlib

        require_matplotlib()  # the install hint now, not after the model load

    report = environment_report()
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key.ljust(width)}  {value}")

    from calclip.models import load_model

    import torch

    model, tokenizer = load_model(options.model)
    # Natural text through the model's own tokenizer (random token ids put a real model far off its data and
    # exaggerate the spread); four copies so the batch has more than one row.
    input_ids = tokenizer(DIAGNOSE_TEXT, return_tensors="pt")["input_ids"][:, : options.seq_len].repeat(4, 1)
    if options.model == "tiny":  # a random model has no data distribution: random ids are as good as text
        input_ids = torch.randint(0, model.config.vocab_size, (4, options.seq_len),
                                  generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    spread = fp8_logratio_spread(model, input_ids)
    print(f"\nFP8 (blocks 128x128 / 1x128) vs unquantized shadow, model {options.model!r}, "
          f"{int(spread['tokens'])} tokens, {time.perf_counter() - started:.1f} s:")
    print(f"  std of log r             {spread['log_ratio_std']:.4f}")
    print(f"  max |log r|              {spread['log_ratio_max_abs']:.4f}")
    print(f"  token-mult-prob-error    {spread['token_mult_prob_error']:.4f}   (1.0 perfect, < 1.03-1.05 acceptable)")
    if options.plot:
        spread.update(_diagnose_plot(model, tokenizer, options))
    return {**report, **spread}


def _diagnose_plot(model, tokenizer, options) -> dict:
    """``diagnose --plot``: the moved-policy probe on natural text (random ids for the tiny model), drawn."""
    import torch

    from calclip.monitoring.plots import probe_and_plot
    from calclip.monitoring.ratio_probe import PROBE_TEXTS, text_batch

    if options.model == "tiny":
        input_ids = torch.randint(0, model.config.vocab_size, (len(PROBE_TEXTS), options.seq_len),
                                  generator=torch.Generator().manual_seed(0))
        attention_mask = torch.ones_like(input_ids)
    else:
        input_ids, attention_mask = text_batch(tokenizer, seq_len=options.seq_len)
    started = time.perf_counter()
    torch.manual_seed(0)
    title = (f"model {options.model!r}: log r after {options.update_steps} AdamW steps (lr {options.lr:g}, synthetic "
             f"advantages), FP8 vs BF16 shadow, same tokens")
    result = probe_and_plot(model, input_ids, attention_mask, options.plot, update_steps=options.update_steps,
                            lr=options.lr, eps_low=options.epsilon, eps_high=options.epsilon, title=title)
    print(f"\nmoved policy ({options.update_steps} AdamW steps, lr {options.lr:g}; {result['tokens_neg']} A<0 and "
          f"{result['tokens_pos']} A>0 tokens, {time.perf_counter() - started:.1f} s):")
    print(f"  std of log r             FP8 {result['log_ratio_std_fp8']:.4f}, "
          f"BF16 shadow {result['log_ratio_std_bf16']:.4f}")
    print(f"  calibrated bounds        L {result['low']:.4f}, H {result['high']:.4f}")
    print(f"  A<0 dropped (r < bound)  FP8 at 1-eps {result['neg_low_frac_fp8_static']:.1%}, BF16 at 1-eps "
          f"{result['neg_low_frac_bf16']:.1%}, FP8 at L {result['neg_low_frac_fp8']:.1%}")
    print(f"  A>0 dropped (r > bound)  FP8 at 1+eps {result['pos_high_frac_fp8_static']:.1%}, BF16 at 1+eps "
          f"{result['pos_high_frac_bf16']:.1%}, FP8 at H {result['pos_high_frac_fp8']:.1%}")
    print(f"  figure                   {options.plot}")
    return {f"plot/{key}": value for key, value in result.items()}

