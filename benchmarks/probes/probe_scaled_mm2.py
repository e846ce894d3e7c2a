"""Second probe: the dgrad layout of torch._scaled_mm blockwise scaling.

The first probe (probe_scaled_mm.py) found that dgrad = Q(dy)[M,N] @ Q(W)[N,K] with W's 128x128 scales was
accepted but wrong (relative error 0.14). This checks the transposed form dx^T = Q(W)^T Q(dy)^T
(128x128 x 1x128), the same call at square and non-square shapes, and F.scaled_mm's explicit API.
"""

import itertools

import torch

from probe_scaled_mm import deq, q_groups, try_mm


def main():
    torch.manual_seed(0)
    for M, K, N in [(256, 512, 384), (256, 384, 512), (256, 512, 512), (384, 256, 256)]:
        print(f"--- M={M} K={K} N={N}")
        dy = torch.randn(M, N, device="cuda")
        w = torch.randn(N, K, device="cuda")
        qdy, sdy = q_groups(dy, 1, 128)  # [M,N], [M,N/128]
        qw, sw = q_groups(w, 128, 128)  # [N,K], [N/128,K/128]
        ref_d = deq(qdy, sdy, 1, 128) @ deq(qw, sw, 128, 128)  # [M,K]
        qwT = qw.t().contiguous()  # [K,N]
        for sb_t, sb_cm in itertools.product([True, False], [True, False]):
            sb = sw if sb_t else sw.t()
            sb = sb.t().contiguous().t() if sb_cm else sb.contiguous()
            try_mm(f"dgrad direct sb{tuple(sb.shape)} cm={sb_cm}", qdy, qwT.t(), sdy.t().contiguous().t(), sb, ref_d)
        # transposed: dx^T[K,M] = W^T[K,N] @ dy^T[N,M]; a = qwT (128x128 blocks, scales (K/128,N/128)),
        # b = qdy.t() ([N,M] col-major), b scales 1x128 along N
        refT = ref_d.t()
        swT = sw.t()
        for sa_cm, sb_t, sb_cm in itertools.product([True, False], [True, False], [True, False]):
            sa = swT.t().contiguous().t() if sa_cm else swT.contiguous()
            sb = sdy.t() if sb_t else sdy  # (N/128, M) or (M, N/128)
            sb = sb.t().contiguous().t() if sb_cm else sb.contiguous()
            try_mm(f"dgradT 128x128 x 1x128 sa_cm={sa_cm} sb{tuple(sb.shape)} cm={sb_cm}", qwT, qdy.t(), sa, sb, refT)
        # forward again at this shape (control)
        x = torch.randn(M, K, device="cuda")
        qx, sx = q_groups(x, 1, 128)
        ref = deq(qx, sx, 1, 128) @ deq(qw, sw, 128, 128).t()
        try_mm("fwd control", qx, qw.t(), sx.t().contiguous().t(), sw.t(), ref)
        # dgrad via requantizing W^T as its own 128x128 "weight": identical codes, transposed scale tensor
        wt_q = qw.t().contiguous()  # [K,N] row-major: the "weight" of dgrad, out dim K, contraction N
        wt_s = sw.t().contiguous()  # (K/128, N/128) for W^T
        try_mm("dgrad as fwd(W^T) contiguous copies", qdy, wt_q.t(), sdy.t().contiguous().t(), wt_s.t(), ref_d)


if __name__ == "__main__":
    main()
