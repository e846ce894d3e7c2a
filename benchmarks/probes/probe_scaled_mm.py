"""Probe which blockwise-scaled layouts torch._scaled_mm accepts on this GPU, and check them numerically.

Run on the H200: `python benchmarks/probes/probe_scaled_mm.py`. Prints one line per variant: accepted or the error,
and the relative error against a float32 emulation of the same FP8 codes and scales. This settles the scale
layouts calclip.fp8.gemm uses (forward 1x128 x 128x128; wgrad 1x128 x 1x128 along the token axis).
"""

import itertools
import platform

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def q_groups(x: torch.Tensor, rows: int, cols: int):
    """Quantize 2-D x in (rows x cols) blocks; return fp8 codes and fp32 dequant scales [R/rows, C/cols]."""
    r, c = x.shape
    blocks = x.float().reshape(r // rows, rows, c // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    s = amax / FP8_MAX
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(r, c).to(FP8)
    return q, s


def deq(q, s, rows, cols):
    r, c = q.shape
    return (q.float().reshape(r // rows, rows, c // cols, cols) * s[:, None, :, None]).reshape(r, c)


def try_mm(name, a, b, sa, sb, ref):
    try:
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        print(f"OK   {name}: rel_err={err:.2e}")
    except Exception as e:  # noqa: BLE001 — the point is to report what is rejected
        print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def main():
    print("torch", torch.__version__, "cuda", torch.version.cuda, platform.python_version())
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    torch.manual_seed(0)
    M, K, N = 256, 512, 384
    x = torch.randn(M, K, device="cuda")
    w = torch.randn(N, K, device="cuda")
    qx, sx = q_groups(x, 1, 128)  # [M,K], [M, K/128]
    qw, sw = q_groups(w, 128, 128)  # [N,K], [N/128, K/128]
    ref = deq(qx, sx, 1, 128) @ deq(qw, sw, 128, 128).t()
    for sa_cm, sb_t, sb_cm in itertools.product([True, False], [True, False], [True, False]):
        sa = sx.t().contiguous().t() if sa_cm else sx.contiguous()
        sb = sw.t() if sb_t else sw  # (K/128, N/128) or (N/128, K/128)
        sb = sb.t().contiguous().t() if sb_cm else sb.contiguous()
        name = f"fwd 1x128 x 128x128 sa_colmajor={sa_cm} sb_shape={tuple(sb.shape)} sb_colmajor={sb_cm}"
        try_mm(name, qx, qw.t(), sa, sb, ref)
    # wgrad: dW[N,K] = dy^T[N,M] @ x[M,K], both quantized 1x128 along M (the contraction dim)
    dy = torch.randn(M, N, device="cuda")
    qdyT, sdyT = q_groups(dy.t().contiguous(), 1, 128)  # [N,M], [N, M/128]
    qxT, sxT = q_groups(x.t().contiguous(), 1, 128)  # [K,M], [K, M/128]
    ref_w = deq(qdyT, sdyT, 1, 128) @ deq(qxT, sxT, 1, 128).t()
    for sa_cm, sb_cm, sb_t in itertools.product([True, False], [True, False], [True, False]):
        sa = sdyT.t().contiguous().t() if sa_cm else sdyT.contiguous()
        sb = sxT.t() if sb_t else sxT  # (M/128, K) or (K, M/128)
        sb = sb.t().contiguous().t() if sb_cm else sb.contiguous()
        name = f"wgrad 1x128 x 1x128 sa_colmajor={sa_cm} sb_shape={tuple(sb.shape)} sb_colmajor={sb_cm}"
        try_mm(name, qdyT, qxT.t(), sa, sb, ref_w)
    # dgrad: dx[M,K] = dy[M,N] @ W[N,K]; dy 1x128 along N, W 128x128 -> b = W (N,K) as col-major (K... )
    qdy, sdy = q_groups(dy, 1, 128)  # [M,N], [M, N/128]
    ref_d = deq(qdy, sdy, 1, 128) @ deq(qw, sw, 128, 128)
    qwT = qw.t().contiguous()  # [K,N] row-major; b must be [N,K] col-major -> qwT.t()
    for sa_cm, sb_t, sb_cm in itertools.product([True, False], [True, False], [True, False]):
        sa = sdy.t().contiguous().t() if sa_cm else sdy.contiguous()
        sb = sw if sb_t else sw.t()  # (N/128, K/128) is b's (contraction/128, out/128)
        sb = sb.t().contiguous().t() if sb_cm else sb.contiguous()
        name = f"dgrad 1x128 x 128x128 sa_colmajor={sa_cm} sb_shape={tuple(sb.shape)} sb_colmajor={sb_cm}"
        try_mm(name, qdy, qwT.t(), sa, sb, ref_d)
    try:
        import triton

        print("triton", triton.__version__)
    except ImportError:
        print("triton missing")
    try:
        from torch.nn.functional import ScalingType, SwizzleType, scaled_mm  # noqa: F401

        print("torch.nn.functional.scaled_mm available")
    except ImportError as e:
        print("F.scaled_mm not available:", e)


if __name__ == "__main__":
    main()
