"""benchmarks/bench_vllm.py --recipes on CPU: the mismatch and grpo parts per FP8 recipe (torchao's rowwise /
tensorwise served per channel), with tests/test_bench_vllm.py's stand-in engine; blockwise keeps its rows and
arguments."""

import functools
import json
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.test_bench_vllm import (  # noqa: E402  (puts benchmarks/ on the path)
    StandInEngine,
    bench_vllm,
    grpo_worker_commands,
    tiny_llama,
    use_stand_in_vllm,
    vllm_common,
)


def record_engine_kwargs(monkeypatch) -> list[dict]:
    """A stand-in ``vllm`` module whose ``LLM(**kwargs)`` records its arguments in the returned list."""
    seen = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda **kwargs: seen.append(kwargs) or object()
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    return seen


def test_recipes_default_to_blockwise_and_bad_ones_are_named(capsys):
    assert bench_vllm.parse_args([]).recipes == ["blockwise"]
    assert bench_vllm.parse_args(["--recipes", "blockwise,rowwise,tensorwise"]).recipes == [
        "blockwise", "rowwise", "tensorwise"]
    for bad in ("rowwise,channelwise", "rowwise,rowwise", ","):
        with pytest.raises(SystemExit):
            bench_vllm.parse_args(["--recipes", bad])
        assert "--recipes" in capsys.readouterr().err


def test_mismatch_children_run_one_recipe_each_and_blockwise_keeps_its_arguments():
    opts = bench_vllm.parse_args(["--parts", "mismatch", "--models", "issue_probe", "--recipes", "blockwise,rowwise",
                                  "--mismatch-arms", "calclip,bf16"])
    runs = bench_vllm.child_runs(opts)
    assert runs == [("mismatch", "issue_probe", "bf16"), ("mismatch", "issue_probe", "calclip"),
                    ("mismatch", "issue_probe", "calclip@rowwise")]
    argv = ["--parts", "mismatch", "--recipes", "blockwise,rowwise", "--steps", "2"]
    assert bench_vllm.child_argv(argv, "mismatch", "m", "/r.json", "calclip@rowwise") == [
        "--steps", "2", "--parts", "mismatch", "--child-json", "/r.json", "--models", "m", "--mismatch-arms",
        "calclip", "--recipes", "rowwise"]
    assert bench_vllm.child_argv(argv, "mismatch", "m", "/r.json", "calclip") == [
        "--steps", "2", "--parts", "mismatch", "--child-json", "/r.json", "--models", "m", "--mismatch-arms",
        "calclip"]
    # decode and grpo children keep every recipe (they run one engine / one process per recipe themselves)
    assert bench_vllm.child_argv(argv + ["--parts=decode"], "decode", None, "/r.json") == [
        "--recipes", "blockwise,rowwise", "--steps", "2", "--parts", "decode", "--child-json", "/r.json"]


def test_fp8_policy_of_a_torchao_recipe_shares_parameters_and_serves_per_channel():
    pytest.importorskip("torchao.float8")
    from calclip.fp8.torchao_recipes import TorchaoFloat8Linear

    base = tiny_llama().float()
    policy, kept = bench_vllm.fp8_policy(base, "rowwise")
    assert kept == []  # per channel: no 128 grid to fit
    q = policy.model.layers[0].self_attn.q_proj
    assert isinstance(q, TorchaoFloat8Linear) and q.weight is base.model.layers[0].self_attn.q_proj.weight
    assert bench_vllm.recipe_label("FP8 calclip", "blockwise") == "FP8 calclip"
    assert bench_vllm.recipe_label("fp8", "tensorwise", "_") == "fp8_tensorwise"


def test_grpo_part_runs_every_fp8_arm_per_recipe(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    commands = []
    step = {"fp8": 1.0, "fp8_rowwise": 0.8, "bf16": 1.2}

    def run(cmd, capture_output, text, timeout):
        commands.append(cmd)
        recipe = cmd[cmd.index("--grpo-recipe") + 1] if "--grpo-recipe" in cmd else None
        label = cmd[cmd.index("--grpo-worker") + 1] + (f"_{recipe}" if recipe else "")
        Path(cmd[cmd.index("--grpo-json") + 1]).write_text(json.dumps(
            {"step_s": [9.0, step[label]], "generate_s": [1.0, 0.5], "sync_s": [0.1, 0.01], "direct_sync": None}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-warmup", "1",
                                                "--recipes", "blockwise,rowwise"]))
    assert [c[c.index("--grpo-worker") + 1] for c in commands] == ["fp8", "fp8", "bf16"]
    assert "--grpo-recipe" not in commands[0] and commands[1][commands[1].index("--grpo-recipe") + 1] == "rowwise"
    grpo = vllm_common.RESULTS["grpo"]
    assert grpo["fp8_rowwise"]["step_median_s"] == pytest.approx(0.8)
    assert grpo["bf16_over_fp8_step"] == pytest.approx(1.2) and grpo["bf16_over_fp8_rowwise_step"] == pytest.approx(1.5)


def test_mismatch_part_runs_a_torchao_recipe_engine_on_the_policys_own_codes(monkeypatch, tmp_path):
    pytest.importorskip("torchao.float8")
    use_stand_in_vllm(monkeypatch, tmp_path)
    opts = bench_vllm.parse_args(["--parts", "mismatch", "--models", "issue_probe", "--mismatch-prompts", "2",
                                  "--mismatch-tokens", "3", "--prompt-len", "4", "--steps", "1", "--lr", "1e-2",
                                  "--recipes", "rowwise", "--mismatch-arms", "calclip,bf16"])
    opts.models, opts.device = ["tiny"], "cpu"
    bench_vllm.part_mismatch(opts)
    rows = vllm_common.RESULTS["mismatch"]
    assert [(r["stage"], r["arm"]) for r in rows] == [
        (stage, arm) for stage in ("initial", "after 1 steps + sync") for arm in ("FP8 calclip rowwise", "BF16")]
    fp8, bf16 = StandInEngine.instances
    assert fp8.kwargs["quantization"] == "compressed-tensors" and "quantization" not in bf16.kwargs
    assert {n.rpartition(".")[2] for n, t in fp8.received.items() if t.dtype == torch.float32 and t.dim() == 2} == {
        "weight_scale"}
    for r in rows:
        assert math.isfinite(r["tmpe"]) and r["tmpe"] >= 1.0
        if r["arm"] != "BF16":
            assert r["engine_holds_trainer_codes"] == "yes", r  # the torchao codes, after both syncs
    assert rows[2]["sync_ms"] > 0 and rows[0]["minus_bf16_control"] == pytest.approx(rows[0]["tmpe"] - rows[1]["tmpe"])


def test_engine_options_reach_every_part(monkeypatch, tmp_path):
    from calclip.trainers.config import VLLM_KV_CACHE_DTYPES

    assert bench_vllm.KV_CACHE_DTYPES == VLLM_KV_CACHE_DTYPES  # the trainer's choices
    default = bench_vllm.parse_args([])
    assert default.kv_cache_dtype == "auto" and default.async_scheduling is None
    opts = bench_vllm.parse_args(["--kv-cache-dtype", "fp8", "--async-scheduling", "off"])
    assert opts.kv_cache_dtype == "fp8" and opts.async_scheduling is False
    seen = record_engine_kwargs(monkeypatch)
    opts.dummy_bf16 = True
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    for kwargs in ({}, {"quantization_config": qc}):
        bench_vllm.make_llm("unused", opts, max_model_len=64, max_num_seqs=2, batches=[2], gpu_util=0.1, **kwargs)
    bf16, fp8 = seen
    assert "kv_cache_dtype" not in bf16 and bf16["async_scheduling"] is False  # the BF16 control keeps its cache
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["async_scheduling"] is False
    bench_vllm.make_llm("unused", default, max_model_len=64, max_num_seqs=2, batches=[2], gpu_util=0.1,
                        quantization_config=qc)
    assert not {"kv_cache_dtype", "async_scheduling"} & set(seen[-1])  # defaults: vLLM's own
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--kv-cache-dtype", "int8"])

    commands = grpo_worker_commands(monkeypatch, tmp_path, ["--kv-cache-dtype", "fp8", "--async-scheduling", "on"])
    for cmd in commands:  # every arm's worker, BF16 included
        assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8" and cmd[cmd.index("--async-scheduling") + 1] == "on"
    worker = bench_vllm.parse_args(commands[0][2:])
    assert worker.kv_cache_dtype == "fp8" and worker.async_scheduling is True


def test_linear_backend_reaches_the_grpo_workers_and_fits_each_recipe(monkeypatch, tmp_path, capsys):
    """--linear-backend reaches every grpo worker (it fell back to cutlass before); an FP8 engine of a per-channel
    recipe given a block-only backend runs cutlass, with a note, instead of failing after the model loads."""
    commands = grpo_worker_commands(monkeypatch, tmp_path, ["--linear-backend", "deep_gemm",
                                                            "--recipes", "blockwise,rowwise"])
    assert len(commands) == 3 and all(c[c.index("--linear-backend") + 1] == "deep_gemm" for c in commands)
    assert bench_vllm.parse_args(commands[1][2:]).linear_backend == "deep_gemm"

    assert bench_vllm.engine_linear_backend("deep_gemm", "blockwise") == "deep_gemm"
    assert bench_vllm.engine_linear_backend(None, "rowwise") is None
    assert bench_vllm.engine_linear_backend("deep_gemm", "rowwise") == "cutlass"
    assert "runs linear_backend 'cutlass', not 'deep_gemm'" in capsys.readouterr().out

    seen = record_engine_kwargs(monkeypatch)
    opts = bench_vllm.parse_args(["--linear-backend", "triton"])
    channel = bench_vllm._compressed_fp8("channel", "token")
    block = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    for qc in (channel, block):
        bench_vllm.make_llm("unused", opts, max_model_len=64, max_num_seqs=2, batches=[2], gpu_util=0.1,
                            quantization_config=qc)
    assert [kw["linear_backend"] for kw in seen] == ["cutlass", "triton"]


def test_block_engines_switch_deep_gemm_ue8m0_as_the_trainer_does(monkeypatch):
    """Calclip-numerics block engines start with VLLM_USE_DEEP_GEMM_E8M0=0 where DeepGEMM may run (DeepGEMM then
    keeps the trainer's FP32 scales), vLLM-default engines with the environment the benchmark started in; in-process
    decode arms start several engines, so each one sets it and vLLM's cached read is cleared."""
    from calclip.rollout.vllm_sync import DEEP_GEMM_E8M0_ENV

    seen, reads = [], []
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda **kwargs: seen.append(os.environ.get(DEEP_GEMM_E8M0_ENV)) or object()
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    deep_gemm = types.ModuleType("vllm.utils.deep_gemm")

    @functools.cache
    def is_deep_gemm_e8m0_used():
        reads.append(os.environ.get(DEEP_GEMM_E8M0_ENV))
        return True

    deep_gemm.is_deep_gemm_e8m0_used = is_deep_gemm_e8m0_used
    monkeypatch.setitem(sys.modules, "vllm.utils.deep_gemm", deep_gemm)
    monkeypatch.delenv(DEEP_GEMM_E8M0_ENV, raising=False)
    monkeypatch.setattr(vllm_common, "_E8M0_AT_START", None)
    opts = bench_vllm.parse_args(["--linear-backend", "cutlass"])
    for name in ("fp8_dg", "fp8_vdef", "fp8", "fp8_dg", "bf16"):
        is_deep_gemm_e8m0_used()  # the engine reads (and caches) the variable
        (_, kwargs), = bench_vllm.decode_engine_specs([name])
        bench_vllm.make_llm("unused", opts, max_model_len=64, max_num_seqs=2, batches=[2], gpu_util=0.1, **kwargs)
    # fp8_dg: off; fp8_vdef: vLLM's default (unset); fp8 on cutlass: left as it was; fp8_dg again: off; BF16: left
    assert seen == ["0", None, None, "0", "0"]
    # each switch made vLLM read the variable again (before the 2nd, 3rd and 5th engines); the cutlass engine changed
    # nothing, so the 4th engine's read was the cached one
    assert reads == [None, "0", None, "0"]


def test_vllms_online_fp8_engine_gets_the_fp8_kv_cache_too(monkeypatch):
    seen = record_engine_kwargs(monkeypatch)
    opts = bench_vllm.parse_args(["--kv-cache-dtype", "fp8"])
    opts.dummy_bf16 = True
    for name in ("online", "bf16"):
        (_, kwargs), = bench_vllm.decode_engine_specs([name])
        bench_vllm.make_llm("unused", opts, max_model_len=64, max_num_seqs=2, batches=[2], gpu_util=0.1, **kwargs)
    online, bf16 = seen
    assert online["quantization"] == "fp8" and online["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in bf16  # the BF16 control keeps its cache
