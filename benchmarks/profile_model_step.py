"""Where one model training step's GPU time goes: GEMMs (BF16 / FP8), FP8 quantizers, attention, optimizer, fused
elementwise (norms, RoPE, SiLU, loss), copies, other; BF16 compiled against calclip FP8 compiled (the model rows of
docs/benchmarks.md).

bench_speed.py's model rows say how fast a step is; this says where the time goes, from torch.profiler's CUDA kernel
names, so one GPU run tells which speed lever to pull (a quantizer share larger than the GEMM time FP8 saves, say):

    python benchmarks/profile_model_step.py --model qwen2.5-1.5b          # H200: BF16 compile vs FP8 compile
    python benchmarks/profile_model_step.py --model qwen2.5-7b --arms bf16c,fp8c,fp8xc \\
        --fp8-options scaled_mm_row_scales=false                                 # and a lever off
    python benchmarks/profile_model_step.py --tiny                        # CPU check that it runs (no kernels)

The model is bench_speed.py's row (random-weight Llama with the architecture's dims, bf16 weights, KV cache off,
fused AdamW, ``--models`` syntax). Per arm: warm-up (compile and autotuning; on a machine where bench_speed.py ran
first, Inductor's and Triton's caches make this short), then ``--steps`` profiled steps. Printed per step: wall ms,
summed kernel ms, the split by category (ms and share) side by side with the difference to the first arm, then each
arm's top kernels. A probe, not a benchmark: one round, arms not interleaved.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (bench_speed's helpers)

import torch  # noqa: E402

import _common  # noqa: E402,F401  (puts the repository root on sys.path)
from _common import LAUNCH_CALLS, WAIT_CALLS, gpu_idle, host_times, kernel_category, kernel_times, table  # noqa: E402

# (category, pattern on the kernel name), first match wins. cuBLAS' FP8 kernels carry a "q" after the SM in their
# nvjet names (nvjet_sm90_qqtst_... for e4m3 x e4m3, nvjet_sm90_qrtst_... with an e5m2 operand as torchao's
# tensorwise backward has; nvjet_sm90_tst_... for BF16). Attention comes before the BF16 GEMMs: cuDNN's SDPA kernels
# (cudnn_generated_fort_native_sdpa_sm90_...) carry "sm90_" as the GEMMs do.
CATEGORIES = (
    ("GEMM FP8", r"nvjet_sm\d+_q|_fp8_block_gemm|_fp8_splitk|_splitk_reduce|fp8_linear_fused_quant|blockwise_fp8_gemm|"
                 r"fp8.*gemm|gemm.*fp8|e4m3"),
    ("FP8 quantize", r"quantiz|_requantize|act_quant|weight_quant|to_fp8|amax"),
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("GEMM BF16", r"nvjet|gemm|cutlass|xmma|cublas|sm90_|ampere_|splitKreduce"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("fused elementwise (Inductor)", r"^triton_"),
    ("copy / fill", r"memcpy|memset|copy|fill|cat_|CatArray"),
    ("other", r""),
)


def category(kernel: str) -> str:
    """The CATEGORIES entry of a CUDA kernel name."""
    return kernel_category(kernel, CATEGORIES)


def split_by_category(times: dict[str, tuple[float, int]], steps: int) -> dict[str, float]:
    """category -> ms per step."""
    return _common.split_by_category(times, steps, CATEGORIES)


# The profiler range this probe puts around the weights' refresh before a compiled call (the pre-hook's eager
# ``refresh_fp8_weights``, the compiled step's one graph break), while it profiles: the product carries no range.
REFRESH_RANGE = "calclip::refresh_fp8_weights"


@contextlib.contextmanager
def refresh_range():
    """While active, calclip's pre-graph refresh runs inside the ``REFRESH_RANGE`` profiler range
    (``weight_codes._refresh_outside_graph`` looks ``refresh_fp8_weights`` up at each call)."""
    from calclip.fp8 import weight_codes

    real = weight_codes.refresh_fp8_weights

    def ranged(*args, **kwargs):
        with torch.profiler.record_function(REFRESH_RANGE):
            return real(*args, **kwargs)

    weight_codes.refresh_fp8_weights = ranged
    try:
        yield
    finally:
        weight_codes.refresh_fp8_weights = real


def profile_arm(step, steps: int, device: torch.device) -> tuple[float, dict[str, tuple[float, int]], dict, dict]:
    """(wall ms per step, kernel times, host times, GPU idle) of ``steps`` calls of ``step`` under torch.profiler;
    host times: the CUDA launch calls, calclip's weight refresh before a compiled call and the calls that wait for the
    GPU (``host_times``); GPU idle: where the GPU waited for the host (``gpu_idle``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with refresh_range(), profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / steps * 1e3
    host = host_times(prof, (*LAUNCH_CALLS, REFRESH_RANGE, *WAIT_CALLS))
    return wall, kernel_times(prof), host, gpu_idle(prof.events())


def host_rows(results: dict[str, tuple], steps: int) -> list[list[str]]:
    """Per arm, per step: kernels launched (GPU side), launch calls and their CPU ms, and the weight refresh's
    CPU ms (calls): where a compiled FP8 step's wall exceeds its kernels' time, how much of it is the host's."""
    rows = []
    for name, (_, kernels, host, _) in results.items():
        launched = sum(n for _, n in kernels.values()) / steps
        calls = sum(host[c][1] for c in LAUNCH_CALLS) / steps
        launch_ms = sum(host[c][0] for c in LAUNCH_CALLS) / steps / 1e3
        refresh_us, refresh_n = host[REFRESH_RANGE]
        rows.append([name, f"{launched:.0f}", f"{calls:.0f}", f"{launch_ms:.2f}",
                     f"{refresh_us / steps / 1e3:.2f} ({refresh_n / steps:.0f})"])
    return rows


def idle_rows(results: dict[str, tuple], steps: int) -> list[list[str]]:
    """Per arm, per step: GPU idle ms between its first and last kernel (and in gaps >= 20 us), and the host calls
    that wait for the GPU (``WAIT_CALLS``: syncs, copies, the allocator) as calls and CPU ms."""
    rows = []
    for name, (_, _, host, idle) in results.items():
        big = sum(us for us, _ in idle["gaps"].values())
        waits = sorted(((call, host[call]) for call in WAIT_CALLS if host[call][1]), key=lambda kv: -kv[1][0])
        waits = ", ".join(f"{call} {n / steps:.0f} ({us / steps / 1e3:.2f})" for call, (us, n) in waits) or "none"
        rows.append([name, f"{idle['idle_us'] / steps / 1e3:.2f}", f"{big / steps / 1e3:.2f}", waits])
    return rows


def idle_report(results: dict[str, tuple], steps: int, top: int) -> None:
    """The GPU-idle table, then per arm the host code its largest idle gaps waited on."""
    print("\n### where the GPU waited for the host, per step")
    table(["arm", "GPU idle ms", "in gaps >= 20 us ms", "host calls that wait: calls (CPU ms)"],
          idle_rows(results, steps))
    print("A gap is charged to the code that launched the kernel after it (its CPU ops, outermost > innermost).")
    for name, (*_, idle) in results.items():
        ranked = sorted(idle["gaps"].items(), key=lambda kv: -kv[1][0])[:top]
        if ranked:
            print(f"\n#### {name}: the {len(ranked)} largest sources of GPU idle")
            table(["launched from", "gaps/step", "idle ms/step"],
                  [[source[:110], f"{n / steps:.1f}", f"{us / steps / 1e3:.3f}"] for source, (us, n) in ranked])


def print_report(results: dict[str, tuple[float, dict]], steps: int, top: int) -> None:
    names = list(results)
    splits = {name: split_by_category(times, steps) for name, (_, times, *_) in results.items()}
    totals = {name: sum(split.values()) for name, split in splits.items()}
    header = ["per step"] + [f"{n} ms (share)" for n in names] + [f"{n} - {names[0]} ms" for n in names[1:]]
    rows = [["wall"] + [f"{results[n][0]:.2f}" for n in names] + [f"{results[n][0] - results[names[0]][0]:+.2f}"
                                                                   for n in names[1:]],
            ["GPU kernels"] + [f"{totals[n]:.2f}" for n in names] + [f"{totals[n] - totals[names[0]]:+.2f}"
                                                                     for n in names[1:]]]
    for cat, _ in CATEGORIES:
        if not any(splits[n][cat] for n in names):
            continue
        rows.append([cat] + [f"{splits[n][cat]:.2f} ({splits[n][cat] / max(totals[n], 1e-9):.0%})" for n in names]
                    + [f"{splits[n][cat] - splits[names[0]][cat]:+.2f}" for n in names[1:]])
    print("\n### where a step's GPU time goes (ms per step; share of the arm's kernel time)")
    table(header, rows)
    print("wall - GPU kernels: time the GPU waited for the host (launches, syncs, Python), when positive.")
    print("\n### the host side, per step")
    table(["arm", "kernels run", "launch calls", "launch calls' CPU ms", "weight refresh CPU ms (calls)"],
          host_rows(results, steps))
    idle_report(results, steps, top)
    for name, (_, times, *_) in results.items():
        ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
        print(f"\n#### {name}: top {len(ranked)} kernels")
        table(["kernel", "category", "launches/step", "ms/step"],
              [[k[:80], category(k), f"{n / steps:.0f}", f"{us / steps / 1e3:.3f}"] for k, (us, n) in ranked])


def main(argv=None) -> int:
    import bench_speed as bs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="one row in bench_speed.py's --models syntax")
    parser.add_argument("--arms", default="bf16c,fp8c", help=f"arms of {list(bs.MODEL_ARMS)} (first: the baseline)")
    parser.add_argument("--fp8-options", default=None, help="Fp8Config fields of the fp8x/fp8xc arms, KEY=VALUE,...")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per arm")
    parser.add_argument("--warmup", type=int, default=bs.COMPILED_WARMUP, help="untimed steps per arm first")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per arm")
    parser.add_argument("--tiny", action="store_true", help="CPU, a tiny row, compile backend aot_eager")
    opts = parser.parse_args(argv)
    row = bs.TINY_MODELS[0] if opts.tiny else bs.parse_model_rows(opts.model)[0]
    sizes = bs.TINY_SIZES if opts.tiny else bs.GPU_SIZES
    arms = [a.strip() for a in opts.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in bs.MODEL_ARMS or a.startswith(("torchao", "fp8y"))]
    if unknown or not arms:
        parser.error(f"--arms: unknown or unsupported {unknown}; choose from "
                     f"{[a for a in bs.MODEL_ARMS if not a.startswith(('torchao', 'fp8y'))]}")
    fp8_options = bs.parse_fp8_options(opts.fp8_options)
    if any(a.startswith("fp8x") for a in arms) and not fp8_options:
        parser.error("--arms fp8x/fp8xc need --fp8-options")
    device = torch.device(sizes.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --tiny")
        return 2
    batch = row.batch or sizes.batch
    print(bs.header_line(sizes))
    print(f"profile_model_step: {row.label}, {batch}x{sizes.seq} tokens, vocab {sizes.vocab}, arms {arms}, "
          f"{opts.steps} profiled steps after {opts.warmup} warm-up", flush=True)
    base = bs.build_row_model(row, sizes.vocab, device).train()
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-5, fused=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, sizes.vocab, (batch, sizes.seq), generator=gen).to(device)
    # the arms' makers, as bench_speed builds them (no torchao peer, no second FP8 option set)
    arm_opts = argparse.Namespace(compile_backend="aot_eager" if opts.tiny else "inductor", compile_mode=None,
                                  fp8_options=fp8_options, fp8_options_b=None)
    makers = bs.model_arm_makers(base, arm_opts, peer=None)
    results = {}
    for key in arms:
        name = bs.MODEL_ARMS[key]
        torch._dynamo.reset()
        model = makers[key]()

        def step():
            bs.training_loss(model, ids).backward()  # noqa: F821
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        for _ in range(opts.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"   {name}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        results[name] = profile_arm(step, opts.steps, device)
        # ruff checks step above as if it ran after this del: its noqa F821 (astral-sh/ruff#9858)
        del model
        bs.free_memory()
    print_report(results, opts.steps, opts.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
