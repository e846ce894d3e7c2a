"""benchmarks/model_step_budget.py: which GEMMs of a model row leave cuBLAS, by calclip's own dispatch rule,
and the quantizer bytes it counts."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import model_step_budget as budget_probe  # noqa: E402
from bench_speed import parse_model_rows  # noqa: E402


def _budget(name, row_scales=False):
    row = parse_model_rows(name)[0]
    return budget_probe.budget(row, (row.batch or 8) * 2048, row_scales)


def test_qwen_1_5b_sends_its_k8960_and_kv_dgrad_gemms_to_triton_and_row_scales_bring_them_back():
    b = _budget("qwen2.5-1.5b")
    share = b.gemm_flops["triton"] / sum(b.gemm_flops.values())
    assert sorted(set(b.triton_gemms)) == ["down.fwd", "gate.dgrad", "k.dgrad", "up.dgrad", "v.dgrad"]
    assert share == pytest.approx(0.30, abs=0.01)
    assert _budget("qwen2.5-1.5b", row_scales=True).gemm_flops["triton"] == 0


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama3-8b"])
def test_7b_and_8b_rows_run_every_gemm_on_cublas(name):
    assert _budget(name).gemm_flops["triton"] == 0


def test_quantizer_bytes_by_hand_for_one_small_layer():
    row = parse_model_rows("256:512:2:1:1:1")[0]  # hidden 256, intermediate 512, 2 heads / 1 KV, head dim 128
    b = budget_probe.budget(row, 128)
    ins = 256 * 3 + 256 + 256 * 2 + 512  # q, k, v, o (in 256), gate, up (256), down (512)
    outs = 256 + 128 * 2 + 256 + 512 * 2 + 256
    assert b.quant_bytes["x"] == 2 * 3 * 128 * ins
    assert b.quant_bytes["dy"] == 2 * 3 * 128 * outs
    assert b.quant_bytes["weights"] == 2 * 3 * sum(
        k * n for k, n in budget_probe.layer_linears(256, 512, 2, 1, 128).values())
    assert sum(b.gemm_flops.values()) == 3 * 2 * 128 * sum(
        k * n for k, n in budget_probe.layer_linears(256, 512, 2, 1, 128).values())
