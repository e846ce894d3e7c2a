"""benchmarks/bench_quant.py --configs: which configs it times, and that pinning one (``launch._Tuned.pinned``)
launches exactly that config and gives the launcher back its own choice afterwards (the timing itself needs a GPU)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_quant  # noqa: E402

from calclip.fp8 import reference as ref  # noqa: E402
from calclip.fp8.kernels import launch, quantize  # noqa: E402


def test_every_table_config_and_each_division_free_twin_is_timed_once_default_first():
    listed = bench_quant.pinned_configs(quantize)
    for kind, table, twins in (("1x128", quantize._QUANT_1X128_CONFIGS, quantize._QUANT_1X128_DIV_FREE_TWINS),
                               ("128x1", quantize._QUANT_128X1_CONFIGS + quantize._QUANT_128X1_CANDIDATES,
                                quantize._QUANT_128X1_DIV_FREE_TWINS)):
        labels = [label for label, _, _ in listed[kind]]
        assert len(labels) == len(set(labels))
        assert labels[0] == bench_quant.config_label(table[0])
        assert set(labels) == {bench_quant.config_label(c) for c in [*table, *twins]}
    labels_128x1 = [label for label, _, _ in listed["128x1"]]
    assert "BLOCK_K=64 K_FIRST warps=8" in labels_128x1 and "BLOCK_K=64 DIV_FREE K_FIRST warps=8" in labels_128x1
    assert bench_quant.config_label(quantize._QUANT_128X1_DEFAULT) == "BLOCK_K=64 warps=8"


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or the Triton interpreter")
def test_pinning_launches_that_config_then_restores_the_launchers_choice(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tuned = quantize._quantize_128x1_tuned
    before = (launch._AUTOTUNE, tuned._default_launch)
    k_first = next(c for c in quantize._QUANT_128X1_CANDIDATES if c.kwargs["K_FIRST"])
    assert not any(c.kwargs["K_FIRST"] for c in quantize._QUANT_128X1_CONFIGS)  # a candidate: timed, no gain
    seen = []
    original = launch._Tuned.launch

    def spy(self, grid, key, soft_fp8, *args, **kwargs):
        if self is tuned:
            seen.append((launch._AUTOTUNE, self._default_launch[0], grid(self._default_launch[0])))
        return original(self, grid, key, soft_fp8, *args, **kwargs)

    monkeypatch.setattr(launch._Tuned, "launch", spy)
    x = torch.randn(300, 200).to(torch.bfloat16).to(device)
    with tuned.pinned(k_first):
        q, s = quantize.quantize_128x1(x, gemm_layout=True)
    assert (launch._AUTOTUNE, tuned._default_launch) == before
    assert seen == [(False, k_first.kwargs, (4, 3))]  # 200 columns / 64 on grid axis 0, then 3 row groups
    q_ref, s_ref = ref.quantize_128x1(x.cpu())
    assert torch.equal(q[:300].cpu().contiguous().view(torch.uint8), q_ref.contiguous().view(torch.uint8))
    assert torch.equal(s.cpu().contiguous(), s_ref.contiguous())
