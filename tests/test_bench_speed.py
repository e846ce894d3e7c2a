"""benchmarks/bench_speed.py: its statistics helpers, argument checks, and a CPU smoke run of two sections.

The benchmark is a GPU script, not a timed test; these only check that it computes what its tables claim
and that it still runs against the current calclip API (so a refactor of calclip.fp8 cannot silently break it).
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_speed  # noqa: E402


def test_fmt_stat_is_median_with_min_max_and_skips_nan():
    assert bench_speed.fmt_stat([3.0, 1.0, 2.0]) == "2.000 [1.000-3.000]"
    assert bench_speed.fmt_stat([4.0, math.nan, 1.0], digits=1) == "2.5 [1.0-4.0]"
    assert bench_speed.fmt_stat([7.25]) == "7.250"
    assert bench_speed.fmt_stat([math.nan]) == "-"


def test_paired_ratio_pairs_rounds_and_takes_the_median():
    base = bench_speed.Arm("BF16", samples={"ms": [10.0, 20.0, 40.0]})
    arm = bench_speed.Arm("FP8", samples={"ms": [5.0, 40.0, 20.0]})
    # per-round ratios 2.0, 0.5, 2.0 -> median 2.0 (the ratio of medians would be 20/20 = 1.0)
    assert bench_speed.paired_ratio(base, arm, "ms") == "2.00 [0.50-2.00]x"
    failed = bench_speed.Arm("FP8", error="setup: boom")
    assert bench_speed.paired_ratio(base, failed, "ms") == "err"
    assert bench_speed.cell(failed, "ms") == "err"
    assert bench_speed.paired_ratio(base, None, "ms") == "-"


def test_interleave_samples_arms_in_turn_and_drops_a_failing_arm():
    order = []

    def sampler(name, fail_on=None):
        def sample():
            order.append(name)
            if len([o for o in order if o == name]) == fail_on:
                raise RuntimeError("kernel exploded")
            return {"ms": float(len(order))}
        return sample

    a, b = bench_speed.Arm("A", sampler("A")), bench_speed.Arm("B", sampler("B", fail_on=2))
    bench_speed.interleave([a, b], repeats=3)
    assert order == ["A", "B", "A", "B", "A"]
    assert a.values("ms") == [1.0, 3.0, 5.0] and b.values("ms") == [2.0]
    assert b.sample is None and "kernel exploded" in b.error


def test_time_calls_on_cpu_reports_wall_and_host_per_call():
    calls = []
    result = bench_speed.time_calls(lambda: calls.append(1), 4, torch.device("cpu"))
    assert len(calls) == 4
    assert result["wall"] >= result["host"] > 0
    assert math.isnan(result["gpu"])


def test_parse_args_rejects_unknown_sections_and_zero_counts(capsys):
    with pytest.raises(SystemExit):
        bench_speed.parse_args(["--only", "layer,typo"])
    assert "typo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_speed.parse_args(["--warmup", "0"])
    assert "--warmup" in capsys.readouterr().err
    opts = bench_speed.parse_args(["--tiny", "--repeats", "4"])
    assert opts.repeats == 4 and opts.layer_calls == bench_speed.COUNT_DEFAULTS["layer_calls"][1]
    assert opts.compile_backend == "aot_eager"
    assert bench_speed.parse_args([]).compile_backend == "inductor"


def test_by_layer_arms_compile_dynamic_unless_static_is_asked(monkeypatch):
    """The 'r' arms compile each layer as the trainer does (dynamic=True, its Inductor options); --by-layer-static
    gives Dynamo's default (None), as the whole-model arms get."""
    import calclip.fp8

    calls = []
    monkeypatch.setattr(calclip.fp8, "compile_repeated_blocks", lambda module, **kw: calls.append(kw))
    model = torch.nn.Linear(2, 2)
    for argv, dynamic in ([], True), (["--by-layer-static"], None), (["--by-layer-auto-dynamic"], None):
        assert bench_speed.compile_by_layer(model, bench_speed.parse_args(argv)) is model
        assert calls[-1]["dynamic"] is dynamic and calls[-1]["backend"] == "inductor"
        assert calls[-1]["options"] == {"emulate_precision_casts": True}


@pytest.mark.slow
def test_by_layer_auto_dynamic_recompiles_the_layers_once_at_the_main_length(capsys):
    """--by-layer-auto-dynamic on CPU (--tiny): the by-layer arm's first step runs a shorter length, so the main length
    compiles a second graph (automatic dynamic shapes) during the warm-up, and none during the timed rounds; with the
    trainer's dynamic=True one graph serves both. Both flags together are refused."""
    def graphs_of(argv):
        assert bench_speed.main(["--tiny", "--only", "model", "--model-arms", "bf16,bf16r", "--repeats", "1",
                                 "--no-torchao", *argv]) == 0
        out = capsys.readouterr().out
        line = next(line for line in out.splitlines() if "BF16 by layer: first step" in line)
        row = next(_cells(r) for r in out.splitlines() if r.startswith("| BF16 by layer "))
        return line.split(" graph(s)")[0].rsplit(", ", 1)[1], row[-1]

    assert graphs_of([]) == ("1", "1 / 0 / 0")
    assert graphs_of(["--by-layer-auto-dynamic"]) == ("2", "2 / 0 / 0")
    with pytest.raises(SystemExit):
        bench_speed.parse_args(["--by-layer-static", "--by-layer-auto-dynamic"])


def _cells(table_row: str) -> list[str]:
    return [c.strip() for c in table_row.strip().strip("|").split("|")]


@pytest.mark.slow
def test_tiny_run_prints_layer_model_and_decode_tables_with_numbers():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_speed.py"), "--tiny", "--only", "layer,model,decode",
         "--repeats", "1", "--decode-repeats", "1", "--layer-calls", "1", "--warmup", "1",
         "--models", "256:512:4:2:1", "--model-arms", "bf16,bf16c,fp8,fp8c,fp8r", "--no-torchao"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.startswith("bench_speed ") and "commit " in out and "torch " in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| M ") and "BF16 ms" in line)
    columns = _cells(lines[header])
    rows = [_cells(line) for line in lines[header + 2: header + 2 + len(bench_speed.TINY_LAYER_SHAPES)]]
    assert [tuple(map(int, r[:3])) for r in rows] == list(bench_speed.TINY_LAYER_SHAPES)
    assert "torchao ms" not in columns and "torchao" not in out.split("## layer")[1].split("###")[0]  # --no-torchao
    # each shape's row is printed as soon as it is done (a run cut by a time limit keeps it)
    assert sum(line.startswith("   row: BF16 ") for line in lines) == len(bench_speed.TINY_LAYER_SHAPES)
    for row in rows:
        for name in ("BF16 ms", "FP8 eager ms", "BF16/FP8 eager"):
            assert re.fullmatch(r"\d+\.\d+x?", row[columns.index(name)]), (name, row)
    arms = next(i for i, line in enumerate(lines) if line.startswith("| arm ") and "ms per step" in line)
    arm_columns = _cells(lines[arms])
    first, graphs = arm_columns.index("first step s"), arm_columns.index("graphs / breaks / recompiled in timed rounds")
    fastest = next(i for i, c in enumerate(arm_columns) if c.startswith("fastest BF16 ("))
    arm_rows = {r[0]: r for r in (_cells(line) for line in lines[arms + 2: arms + 7])}
    assert list(arm_rows) == ["BF16", "BF16 compile", "FP8 eager", "FP8 compile", "FP8 by layer"]
    for name, row in arm_rows.items():
        assert re.fullmatch(r"\d+\.\d", row[1]) and re.fullmatch(r"\d+\.\d", row[first]), row  # ms, first step s
        assert re.fullmatch(r"\d+\.\d+x", row[fastest]), row  # against the fastest BF16 arm of the same run
    assert arm_rows["BF16 compile"][graphs].endswith("/ 0 / 0")  # one graph, no break, nothing compiled while timed
    assert arm_rows["FP8 compile"][graphs].endswith(" / 0")  # (its one break: the root pre-hook's weight refresh)
    assert arm_rows["FP8 by layer"][graphs] == "1 / 0 / 0"  # the layer's graph, refreshed by the eager root's hook
    summary = next(i for i, line in enumerate(lines) if line.startswith("| model ") and "FP8c vs BF16c" in line)
    summary_columns = _cells(lines[summary])
    assert summary_columns[:7] == ["model", "FP8c vs BF16c", "FP8e vs BF16e", "BF16c vs BF16e", "FP8r vs BF16c",
                                   "FP8r vs FP8c", "peak FP8c / BF16c"]
    assert summary_columns[-1] == "first step s BF16c / FP8c / FP8r"
    assert re.fullmatch(r"\d+\.\d\dx", _cells(lines[summary + 2])[1])
    decode = next(i for i, line in enumerate(lines) if line.startswith("| batch "))
    decode_rows = [_cells(line) for line in lines[decode + 2: decode + 6]]
    assert [(r[0], r[1]) for r in decode_rows] == [("2", "eager"), ("2", "graphed"), ("4", "eager"), ("4", "graphed")]
    for row in decode_rows:
        assert all(re.fullmatch(r"\d+(\.\d+)?", v) for v in row[2:6]), row


def test_summarize_runs_ratios_of_medians_and_means_in_either_direction():
    times = {"bf16_static": [1.0, 2.0, 3.0], "fp8_static": [2.0, 4.0, 9.0], "broken": []}
    rows = bench_speed.summarize_runs(times, "bf16_static")
    assert rows[1] == ["fp8_static", "4.000 [2.000-9.000]", "5.000", "0.50x", "0.40x"]  # 2/4, 2/5
    assert rows[2] == ["broken", "err", "err", "-", "-"]
    inverted = bench_speed.summarize_runs(times, "bf16_static", run_over_base=True)
    assert inverted[1][3:] == ["2.00x", "2.50x"]


# --------------------------------------------------------------------------------------------------------------
# model rows: named architectures, free form, arms, FP8 options, the summary's ratio directions
# --------------------------------------------------------------------------------------------------------------


def test_named_models_have_the_dims_of_the_family_table():
    """bench_speed's named rows and tests/fp8/test_model_dims.py's family table (each from the model's config.json)
    agree on every dim they share."""
    sys.path.insert(0, str(ROOT / "tests" / "fp8"))
    from test_model_dims import FAMILY

    for name in ("qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b", "qwen2.5-0.5b", "qwen3-8b", "smollm2-135m"):
        row, family = bench_speed.NAMED_MODELS[name], FAMILY[name]
        assert (row.hidden, row.intermediate, row.heads, row.kv_heads, row.head_dim) == (
            family.hidden, family.intermediate, family.heads, family.kv_heads, family.head_dim), name
    assert [r.name for r in bench_speed.GPU_SIZES.model_rows] == ["qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b"]


def test_parse_model_rows_named_free_form_and_legacy():
    rows = bench_speed.parse_model_rows("qwen2.5-7b, Llama3-8B:2, qwen2.5-1.5b:4:2, 3584:18944:28:4:3:4, 8x2048x8192")
    seven, eight, small, free, legacy = rows
    assert (seven.hidden, seven.intermediate, seven.heads, seven.kv_heads, seven.layers, seven.batch) == (
        3584, 18944, 28, 4, 3, 4)
    assert eight.name == "llama3-8b" and eight.layers == 2 and eight.batch == 4  # layers overridden, batch kept
    assert (small.layers, small.batch) == (4, 2)
    assert (free.hidden, free.intermediate, free.heads, free.kv_heads, free.layers, free.batch, free.head_dim) == (
        3584, 18944, 28, 4, 3, 4, None)
    assert (legacy.layers, legacy.hidden, legacy.intermediate, legacy.heads, legacy.kv_heads, legacy.batch) == (
        8, 2048, 8192, 16, 16, None)
    assert small.label == "qwen2.5-1.5b 4L h1536 i8960 12/2h" and free.label == "dims 3L h3584 i18944 28/4h"


@pytest.mark.parametrize("text,match", [
    ("qwen9-1b", "unknown architecture; named ones: qwen2.5-1.5b"),
    ("3584:18944:28:5:3", "HEADS a multiple of KV_HEADS"),
    ("3584:18944:28:4", "HIDDEN:INTERMEDIATE:HEADS:KV_HEADS:LAYERS"),
    ("qwen2.5-7b:x", "'qwen2.5-7b:x'"),
    ("qwen2.5-7b:0", "sizes must be positive"),
    (" , ", "no rows"),
])
def test_parse_model_rows_rejects_bad_rows_naming_them(text, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        bench_speed.parse_model_rows(text)


def test_parse_args_builds_model_rows_arms_and_fp8_options(capsys):
    opts = bench_speed.parse_args(["--models", "qwen2.5-7b", "--fp8-options", "scaled_mm_row_scales=true"])
    assert opts.models[0].name == "qwen2.5-7b"
    assert opts.fp8_options == {"scaled_mm_row_scales": True}
    assert opts.model_arm_keys == ["bf16", "bf16c", "fp8", "fp8c", "fp8x", "fp8xc", "torchao"]
    assert bench_speed.parse_args(["--compile-peers"]).model_arm_keys == ["bf16", "bf16c", "fp8", "fp8c", "torchao",
                                                                          "torchaoc"]
    assert bench_speed.parse_args(["--no-torchao", "--compile-peers"]).model_arm_keys == ["bf16", "bf16c", "fp8",
                                                                                          "fp8c"]
    # BF16 eager is every ratio's baseline: always there, always first
    assert bench_speed.parse_args(["--model-arms", "fp8c,bf16c"]).model_arm_keys == ["bf16", "fp8c", "bf16c"]
    for argv, message in ((["--model-arms", "fp8c,int4"], "unknown arm(s) ['int4']"),
                          (["--model-arms", "fp8xc"], "need --fp8-options"),
                          (["--model-arms", "fp8xr"], "need --fp8-options"),
                          (["--fp8-options", "scaled_mm_row_scales"], "expected KEY=VALUE"),
                          (["--fp8-options", "warp_speed=true"], "warp_speed"),
                          (["--fp8-options", "gemm=triton,scaled_mm_row_scales=true"], "scaled_mm_row_scales"),
                          (["--models", "qwen9-1b"], "qwen9-1b")):
        with pytest.raises(SystemExit):
            bench_speed.parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_trainer_model_option_sets_the_trainer_dims(capsys):
    assert bench_speed.parse_args(["--trainer-model", "8,1536,8960"]).trainer_model == (8, 1536, 8960)
    assert bench_speed.parse_args([]).trainer_model is None  # the section's default
    for text in ("8,1500,8960", "8,1536", "a,b,c", "0,1536,8960"):
        with pytest.raises(SystemExit):
            bench_speed.parse_args(["--trainer-model", text])
        assert "--trainer-model" in capsys.readouterr().err


def test_seq_len_option_sets_the_model_rows_tokens_per_sequence(capsys):
    """--seq-len: a ragged micro-batch (e.g. 4 x 2047 tokens, not a multiple of 16) for the model rows, where every
    forward/dgrad GEMM runs over padded rows; a tiny run prints and trains at that length."""
    assert bench_speed.parse_args(["--seq-len", "2047"]).seq_len == 2047
    assert bench_speed.parse_args([]).seq_len is None  # the sizes' default
    with pytest.raises(SystemExit):
        bench_speed.parse_args(["--seq-len", "0"])
    assert "--seq-len must be >= 1" in capsys.readouterr().err
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_speed.py"), "--tiny", "--only", "model", "--models",
         "256:512:4:2:1", "--model-arms", "bf16,fp8", "--seq-len", "31", "--repeats", "1", "--warmup", "1",
         "--no-torchao"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2x31 tokens" in proc.stdout and "FP8 eager" in proc.stdout


def test_parse_fp8_options_types():
    assert bench_speed.parse_fp8_options("decode_fused_max_m=0, fuse_producers=True,decode_fused_max_m=none") == {
        "decode_fused_max_m": None, "fuse_producers": True}
    assert bench_speed.parse_fp8_options("gemm=scaled_mm") == {"gemm": "scaled_mm"}
    assert bench_speed.parse_fp8_options(None) == {}
    assert (bench_speed.parse_fp8_options("keep_patterns=lm_head;self_attn")
            == {"keep_patterns": ("lm_head", "self_attn")})
    assert bench_speed.parse_fp8_options("keep_patterns=lm_head;") == {"keep_patterns": ("lm_head",)}
    with pytest.raises(ValueError, match="keep_patterns"):  # one string is not a sequence of regexes
        bench_speed.parse_fp8_options("keep_patterns=lm_head")


def test_row_model_has_the_architecture_dims_and_no_kv_cache():
    row = bench_speed.parse_model_rows("qwen2.5-7b:1")[0]
    model = bench_speed.build_row_model(row, vocab=512, device="meta")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert len(model.model.layers) == 1
    assert (attn.q_proj.in_features, attn.q_proj.out_features) == (3584, 28 * 128)
    assert (attn.k_proj.out_features, attn.v_proj.out_features, attn.o_proj.in_features) == (512, 512, 3584)
    assert (mlp.gate_proj.out_features, mlp.down_proj.in_features) == (18944, 18944)
    assert next(model.parameters()).dtype == torch.bfloat16
    qwen3 = bench_speed.build_row_model(bench_speed.parse_model_rows("qwen3-8b:1")[0], vocab=512, device="meta")
    assert qwen3.model.layers[0].self_attn.k_proj.out_features == 8 * 128  # head_dim 128 from the named row


def test_training_loss_runs_without_a_kv_cache():
    """The model rows' step builds no KV cache (a compiled BF16 arm guarded on past_key_values and recompiled), while
    the model itself keeps the cache on for the decode benchmarks that build it too."""
    model = bench_speed.build_llama(1, 64, 128, 97, "cpu", heads=2, kv_heads=1)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(out), with_kwargs=False)
    loss = bench_speed.training_loss(model, ids)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert calls[0].past_key_values is None
    assert model(input_ids=ids).past_key_values is not None  # the config's default: cache on, for generate


def test_summary_ratios_point_the_documented_way():
    """'A vs B' is B's step time over A's (> 1: A faster), paired per round; 'peak A / B' is A's peak over B's."""
    arms = {
        "BF16": bench_speed.Arm("BF16", samples={"ms": [100.0, 100.0], "peak": [10.0, 10.0]}),
        "BF16 compile": bench_speed.Arm("BF16 compile", samples={"ms": [80.0, 90.0], "peak": [8.0, 8.0]}),
        "FP8 eager": bench_speed.Arm("FP8 eager", samples={"ms": [125.0, 125.0], "peak": [11.0, 11.0]}),
        "FP8 compile": bench_speed.Arm("FP8 compile", samples={"ms": [64.0, 60.0], "peak": [6.0, 6.0]}),
    }
    row = bench_speed.ModelRow("toy", 256, 512, 4, 2, 1)
    info = {"BF16 compile": {"first_s": 12.0}, "FP8 compile": {"first_s": 30.5}}
    header, rows = bench_speed.summary_rows([(row, arms, info)], list(arms))
    assert header == ["model", "FP8c vs BF16c", "FP8e vs BF16e", "BF16c vs BF16e", "peak FP8c / BF16c",
                      "peak FP8e / BF16e", "first step s BF16c / FP8c"]
    cells = dict(zip(header, rows[0]))
    assert cells["FP8c vs BF16c"] == "1.38 [1.25-1.50]x"  # 80/64 and 90/60
    assert cells["FP8e vs BF16e"] == "0.80 [0.80-0.80]x"
    assert cells["peak FP8c / BF16c"] == "0.75 [0.75-0.75]x"
    assert cells["first step s BF16c / FP8c"] == "12.0 / 30.5"


def test_summary_has_the_by_layer_columns_when_those_arms_ran():
    arms = {
        "BF16": bench_speed.Arm("BF16", samples={"ms": [100.0], "peak": [10.0]}),
        "BF16 compile": bench_speed.Arm("BF16 compile", samples={"ms": [80.0], "peak": [8.0]}),
        "FP8 by layer": bench_speed.Arm("FP8 by layer", samples={"ms": [64.0], "peak": [6.0]}),
        "FP8+ by layer": bench_speed.Arm("FP8+ by layer", samples={"ms": [72.0], "peak": [7.5]}),
    }
    row = bench_speed.ModelRow("toy", 256, 512, 4, 2, 1)
    info = {"BF16 compile": {"first_s": 12.0}, "FP8 by layer": {"first_s": 7.5}}
    header, rows = bench_speed.summary_rows([(row, arms, info)], list(arms))
    assert header == ["model", "BF16c vs BF16e", "FP8r vs BF16c", "FP8+r vs FP8r", "peak FP8r / BF16c",
                      "peak FP8r / FP8+r", "first step s BF16c / FP8r"]
    cells = dict(zip(header, rows[0]))
    assert cells["FP8r vs BF16c"] == "1.25x"  # 80/64, one round
    assert cells["FP8+r vs FP8r"] == "0.89x"  # 64/72: the option's arm is slower
    assert cells["peak FP8r / BF16c"] == "0.75x" and cells["peak FP8r / FP8+r"] == "0.80x"
    assert cells["first step s BF16c / FP8r"] == "12.0 / 7.5"


def test_profile_probe_sorts_kernels_into_categories():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_model_step as probe

    assert probe.category("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN") == "GEMM FP8"
    assert probe.category("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT") == "GEMM BF16"
    assert probe.category("nvjet_sm90_qrtst_128x128_128x6_1x2_h_bz_coopA_algo2_TNT") == "GEMM FP8"  # e5m2 operand
    assert probe.category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128") == \
        "attention"
    assert probe.category("_fp8_block_gemm_kernel") == "GEMM FP8"
    assert probe.category("_quantize_1x128_kernel") == "FP8 quantize"
    assert probe.category("_requantize_128x128_kernel") == "FP8 quantize"
    assert probe.category("triton_fp8_blockwise_act_quant_lhs_kernel") == "FP8 quantize"  # torchao's
    assert probe.category("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel") == "attention"
    assert probe.category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>") == \
        "optimizer"
    assert probe.category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "fused elementwise (Inductor)"
    assert probe.category("Memset (Device)") == "copy / fill"
    assert probe.category("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>") == "other"
    split = probe.split_by_category({"_quantize_1x128_kernel": (3000.0, 6), "nvjet_sm90_tst_x": (9000.0, 3)}, 3)
    assert split["FP8 quantize"] == 1.0 and split["GEMM BF16"] == 3.0 and split["other"] == 0.0


def test_gpu_idle_charges_each_gap_to_the_code_that_launched_the_kernel_after_it():
    """Kernels at [0, 10], [10, 30], [80, 100], [115, 120] and [300, 310] us: idle 50 + 15 + 180 = 245 us of a 310 us
    span; the 50 us gap charged to the optimizer's launch, the 180 us gap to a compiled graph's, the 15 us gap (under
    the threshold) counted in the idle time only; a sync counted (by host_times) as a call that waits."""
    from types import SimpleNamespace as NS

    from _common import WAIT_CALLS, gpu_idle, host_times, kernel_times

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def op(name, parent=None, start=0.0, end=1.0, id=0):
        return NS(name=name, cpu_parent=parent, device_type=cpu, time_range=NS(start=start, end=end), id=id,
                  cpu_time_total=end - start)

    graph = op("Torch-Compiled Region: 0/1")
    call = op("## Call CompiledFxGraph fabc ##", graph)
    adam = op("Optimizer.step#AdamW.step")
    launches = [op("cudaLaunchKernel", call, id=1), op("cuLaunchKernel", call, id=2),
                op("cudaLaunchKernel", adam, id=3), op("cudaLaunchKernel", None, id=4),
                op("cuLaunchKernelEx", call, id=5)]
    kernels = [NS(name=f"k{i}", device_type=cuda, id=i, time_range=NS(start=a, end=b))
               for i, (a, b) in enumerate([(0, 10), (10, 30), (80, 100), (115, 120), (300, 310)], start=1)]
    sync = op("cudaStreamSynchronize", start=5.0, end=305.0)
    # the optimizer's record_function range comes back as a CUDA event too, spanning the gaps: not GPU work
    annotation = NS(name="Optimizer.step#AdamW.step", device_type=cuda, id=9, time_range=NS(start=30, end=310),
                    is_user_annotation=True, device_time=280.0)
    events = [*kernels, *launches, sync, graph, call, adam, annotation]
    idle = gpu_idle(events, min_gap_us=20.0)
    assert idle["span_us"] == 310 and idle["busy_us"] == 65 and idle["idle_us"] == 245
    for kernel in kernels:
        kernel.device_time = kernel.time_range.end - kernel.time_range.start
    assert kernel_times(NS(events=lambda: events)) == {k.name: (k.device_time, 1) for k in kernels}
    assert idle["gaps"] == {"Optimizer.step#AdamW.step": [50, 1],
                            "Torch-Compiled Region: 0/1 > ## Call CompiledFxGraph fabc ##": [180, 1]}
    waits = host_times(NS(events=lambda: events), WAIT_CALLS)
    assert {name: entry for name, entry in waits.items() if entry[1]} == {"cudaStreamSynchronize": (300.0, 1)}
    assert gpu_idle([sync])["idle_us"] == 0.0  # no device events (a CPU run): nothing idles


@pytest.mark.slow
def test_profile_probe_reports_the_host_side_with_the_weight_refresh(capsys):
    """--tiny on CPU (aot_eager): the host table names each arm; the compiled FP8 arm refreshes its weight codes
    outside the graph once per step (the profiler range the probe times), the compiled BF16 arm never."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_model_step as probe

    assert probe.main(["--tiny", "--arms", "bf16c,fp8c", "--steps", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out

    def section(title):
        text = out[out.index(title) + len(title):]
        text = text[:text.index("###")] if "###" in text else text
        return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
                for line in text.splitlines() if line.startswith("| BF16") or line.startswith("| FP8")}

    rows = section("### the host side, per step")
    assert set(rows) == {"BF16 compile", "FP8 compile"}
    assert rows["BF16 compile"][3] == "0.00 (0)"
    refresh_ms, refresh_calls = rows["FP8 compile"][3].split()
    assert refresh_calls == "(1)" and float(refresh_ms) > 0
    idle = section("### where the GPU waited for the host, per step")  # on CPU: no kernels, nothing idles
    assert set(idle) == {"BF16 compile", "FP8 compile"}
    assert all(cells[:2] == ["0.00", "0.00"] for cells in idle.values())


@pytest.mark.slow
def test_profile_probe_runs_every_by_layer_arm_bench_speed_has(capsys):
    """The probe takes its arms from bench_speed's makers, so the by-layer arms (``bf16r``, ``fp8r``, ``fp8xr``) run
    here too (they raised KeyError when the probe kept its own shorter list); arms it cannot build are refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_model_step as probe

    assert probe.main(["--tiny", "--arms", "bf16r,fp8xr", "--fp8-options", "resident_weight_codes=false",
                       "--steps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "| BF16 by layer ms (share) | FP8+ by layer ms (share) |" in out
    for refused in ("fp8y", "torchaoc"):
        with pytest.raises(SystemExit):
            probe.main(["--tiny", "--arms", f"bf16r,{refused}", "--steps", "1"])


def test_header_names_the_calclip_switches_a_run_had_set():
    """A row measured with autotune off (or any calclip dispatch switch set) says so in its header."""
    assert bench_speed.dispatch_switches({}) == "default"
    assert bench_speed.dispatch_switches({"CALCLIP_TRITON_AUTOTUNE": "0", "CALCLIP_ONE_BUFFER": "0",
                                          "UNRELATED": "1"}) == "CALCLIP_TRITON_AUTOTUNE=0 CALCLIP_ONE_BUFFER=0"
    assert "calclip switches " in bench_speed.header_line(bench_speed.TINY_SIZES)
