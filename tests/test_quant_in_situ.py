"""benchmarks/quant_in_situ.py: its list of a step's quantizer calls is the list FP8BlockLinear really makes."""

import collections
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_speed  # noqa: E402
import quant_in_situ  # noqa: E402

from calclip.fp8 import Fp8Config, quant, quantize_model  # noqa: E402


def test_the_probes_call_list_is_what_one_training_step_of_a_decoder_layer_calls(monkeypatch):
    hidden, intermediate, heads, kv_heads, head_dim = 256, 384, 2, 1, 128
    model = bench_speed.build_llama(1, hidden, intermediate, 512, "cpu", heads=heads, kv_heads=kv_heads,
                                    head_dim=head_dim, dtype=torch.float32)
    quantize_model(model, Fp8Config())
    seen = collections.Counter()
    for kind, name in (("1x128", "quantize_1x128"), ("128x1", "quantize_128x1")):
        original = getattr(quant, name)

        def spy(x, *args, _kind=kind, _original=original, **kwargs):
            if x.dim() == 2 and x.shape[0] == 256:  # the activations (256 tokens), not the weights
                seen[(_kind, x.shape[1], kwargs.get("nonfinite_count") is not None)] += 1
            return _original(x, *args, **kwargs)

        monkeypatch.setattr(quant, name, spy)
    ids = torch.randint(0, 512, (2, 128))
    bench_speed.training_loss(model, ids).backward()
    expected = collections.Counter()
    for call in quant_in_situ.step_calls(hidden, intermediate, heads, kv_heads, head_dim):
        expected[(call.kind, call.width, call.counted)] += call.count
    assert seen == expected
    # 7 linears: 1x128 and 128x1 of dy each; 1x128 and 128x1 of x once per input (q/k/v share one, gate/up one)
    assert sum(expected.values()) == 22
    assert sum(c.count for c in quant_in_situ.step_calls(hidden, intermediate, heads, kv_heads, head_dim,
                                                         shared=False)) == 28


def test_tiny_run_prints_the_launch_count_of_the_profiled_row(capsys):
    assert quant_in_situ.main(["--tiny"]) == 0
    assert "176 quantizer launches per step (1x128: 88, 128x1: 88)" in capsys.readouterr().out
