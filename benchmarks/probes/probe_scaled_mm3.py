"""Third probe: are wrong results of blockwise torch._scaled_mm caused by unaligned scale strides?

Hypothesis from probe 2: the 128x128 scale tensor's leading dimension must be a multiple of 4 floats (16 bytes);
torch does not check it and the GEMM silently reads garbage otherwise. Here the scales live in buffers whose
leading dimension is padded to a multiple of 4 and are passed as slices.
"""

import torch

from probe_scaled_mm import deq, q_groups, try_mm


def padded_colmajor(s: torch.Tensor, multiple: int = 4) -> torch.Tensor:
    """Return a column-major view of 2-D s whose column stride is padded up to `multiple` elements."""
    rows, cols = s.shape
    ld = -(-rows // multiple) * multiple
    buf = torch.zeros(cols, ld, device=s.device, dtype=s.dtype)
    buf[:, :rows] = s.t()
    return buf[:, :rows].t()


def main():
    torch.manual_seed(0)
    for M, K, N in [(256, 384, 512), (384, 256, 256), (256, 640, 384), (272, 384, 640), (2048, 576, 1536)]:
        print(f"--- M={M} K={K} N={N}")
        x = torch.randn(M, K, device="cuda")
        w = torch.randn(N, K, device="cuda")
        dy = torch.randn(M, N, device="cuda")
        qx, sx = q_groups(x, 1, 128) if K % 128 == 0 else (None, None)
        qw, sw = q_groups(w, 128, 128) if K % 128 == 0 and N % 128 == 0 else (None, None)
        if qw is None:
            print("skip ragged")
            continue
        qdy, sdy = q_groups(dy, 1, 128)
        ref = deq(qx, sx, 1, 128) @ deq(qw, sw, 128, 128).t()
        try_mm("fwd padded", qx, qw.t(), padded_colmajor(sx), padded_colmajor(sw.t()), ref)
        try_mm("fwd unpadded", qx, qw.t(), sx.t().contiguous().t(), sw.t(), ref)
        ref_d = deq(qdy, sdy, 1, 128) @ deq(qw, sw, 128, 128)
        qwT = qw.t().contiguous()
        try_mm("dgrad padded", qdy, qwT.t(), padded_colmajor(sdy), padded_colmajor(sw), ref_d)
        try_mm("dgrad padded again", qdy, qwT.t(), padded_colmajor(sdy), padded_colmajor(sw), ref_d)


if __name__ == "__main__":
    main()
