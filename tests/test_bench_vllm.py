"""benchmarks/bench_vllm.py: the helpers its tables rest on, on CPU (the script itself needs vLLM and a GPU).

Checked: the mismatch statistics against a hand computation, the teacher-forced trainer log-probs against a
per-sequence forward, the training steps move the FP8 policy's codes, the FP8 policy keeps exactly what vLLM cannot
serve, and the argument checks name what is wrong.
"""

import json
import math
import re
import statistics
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

transformers = pytest.importorskip("transformers")
import bench_vllm  # noqa: E402
# the modules bench_vllm.py's parts live in: a test replaces a name where the code under test looks it up
import vllm_common  # noqa: E402
import vllm_decode  # noqa: E402
import vllm_grpo  # noqa: E402

from calclip.fp8 import FP8BlockLinear  # noqa: E402


def test_mismatch_stats_by_hand():
    engine = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    trainer = torch.tensor([[-1.0, -2.5], [-0.4, -3.0]])
    stats = bench_vllm.mismatch_stats(engine, trainer)
    assert stats["tmpe"] == pytest.approx((1 + math.exp(0.5) + math.exp(0.1) + 1) / 4, rel=1e-6)
    assert stats["max_abs"] == pytest.approx(0.5)
    assert stats["over_1p1"] == pytest.approx(0.5)  # exp(0.5) and exp(0.1) = 1.105 exceed 1.1
    assert stats["tokens"] == 4


def test_over_threshold_counts_exp_diff_strictly_above_1p1():
    engine = torch.zeros(1, 3)
    trainer = torch.tensor([[math.log(1.1) - 1e-4, math.log(1.1) + 1e-4, 0.0]])
    assert bench_vllm.mismatch_stats(engine, trainer)["over_1p1"] == pytest.approx(1 / 3)


def test_helpers():
    runs = [{"s": [10.0, 8.0, 1.0, 3.0]}, {"s": [9.0, 7.0, 2.0]}, {"s": [5.0]}]
    assert bench_vllm.pooled_after(runs, "s", 2) == [1.0, 3.0, 2.0, 5.0]  # a run without more keeps its own
    assert bench_vllm.capture_sizes([256, 64, 128]) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bench_vllm.fmt(None) == "-" and bench_vllm.fmt(math.nan) == "-" and bench_vllm.fmt(1.23456, 2) == "1.23"


@pytest.mark.parametrize("argv, match", [(["--parts", "ops,bogus"], "unknown parts"),
                                         (["--models", "gpt2"], "unknown models")])
def test_bad_arguments_are_named(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(argv)
    assert match in capsys.readouterr().err


def tiny_llama(hidden=128, kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def test_trainer_logprobs_are_the_teacher_forced_logprobs_of_each_completion_token():
    model = tiny_llama()
    prompts = torch.randint(3, 96, (3, 5), generator=torch.Generator().manual_seed(0))
    completions = torch.randint(3, 96, (3, 4), generator=torch.Generator().manual_seed(1))
    got = bench_vllm.trainer_logprobs(model, prompts, completions, chunk=2)
    assert got.shape == (3, 4) and got.dtype == torch.float32
    for b in range(3):
        ids = torch.cat([prompts[b], completions[b]])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].float()
        for t in range(4):
            want = torch.log_softmax(logits[4 + t], -1)[completions[b, t]]
            assert got[b, t] == pytest.approx(float(want), abs=1e-5)


def test_fp8_policy_shares_parameters_and_keeps_what_vllm_cannot_serve():
    base = tiny_llama(kv_heads=4)  # q/k/v 128 rows each: every FP8 block inside one shard
    policy, kept = bench_vllm.fp8_policy(base)
    assert kept == []
    fp8 = {n for n, m in policy.named_modules() if isinstance(m, FP8BlockLinear)}
    assert len(fp8) == 2 * 7  # every decoder linear; lm_head stays BF16
    assert policy.model.layers[0].mlp.down_proj.weight is base.model.layers[0].mlp.down_proj.weight


def test_fp8_policy_keeps_ragged_fused_shards_and_their_siblings_in_bf16():
    base = tiny_llama(hidden=128, kv_heads=2)  # q 128 rows, k/v 2 x 32 = 64 rows: ragged shards of qkv_proj
    policy, kept = bench_vllm.fp8_policy(base)
    fp8 = {n for n, m in policy.named_modules() if isinstance(m, FP8BlockLinear)}
    for i in range(2):
        assert f"model.layers.{i}.self_attn.k_proj" in kept
        assert not {f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"} & fp8  # the whole fused layer
        assert {f"model.layers.{i}.self_attn.o_proj", f"model.layers.{i}.mlp.down_proj"} <= fp8


@pytest.mark.slow
def test_train_steps_move_the_policy_and_its_fp8_codes():
    base = tiny_llama(kv_heads=4).float()
    policy, _ = bench_vllm.fp8_policy(base)
    layer = policy.model.layers[0].self_attn.o_proj
    before = layer.quantized_weight()[0].view(torch.uint8).clone()
    prompts = torch.randint(3, 96, (4, 5), generator=torch.Generator().manual_seed(0))
    completions = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(1))
    losses = bench_vllm.train_steps(policy, prompts, completions, steps=3, lr=1e-2, chunk=2)
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert not torch.equal(layer.quantized_weight()[0].view(torch.uint8), before)
    assert not policy.training


def test_attention_context_restores_the_implementation():
    model = tiny_llama()
    previous = model.config._attn_implementation
    with bench_vllm.attention(model, "eager"):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == previous


def test_child_processes_get_one_part_and_model_and_results_merge():
    argv = ["--parts", "ops,mismatch", "--models=llama3_8b,smollm2", "--steps", "2"]
    assert bench_vllm.child_argv(argv, "mismatch", "smollm2", "/r.json") == [
        "--steps", "2", "--parts", "mismatch", "--child-json", "/r.json", "--models", "smollm2"]
    assert bench_vllm.child_argv(argv, "ops", None, "/r.json") == ["--steps", "2", "--parts", "ops",
                                                                   "--child-json", "/r.json"]
    assert bench_vllm.child_argv(["--mismatch-arms", "bf16,calclip", "--lr=1"], "mismatch", "m", "/r.json",
                                 "bf16") == ["--lr=1", "--parts", "mismatch", "--child-json", "/r.json", "--models",
                                             "m", "--mismatch-arms", "bf16"]
    merged = {}
    bench_vllm.merge(merged, {"env": {"device": "a"}, "mismatch": [{"model": "x"}]})
    bench_vllm.merge(merged, {"env": {"device": "b"}, "mismatch": [{"model": "y"}], "grpo": {"fp8": {}}})
    assert merged == {"env": {"device": "a"}, "mismatch": [{"model": "x"}, {"model": "y"}], "grpo": {"fp8": {}}}


@pytest.mark.slow
def test_grpo_worker_times_steps_rollouts_and_syncs_with_a_recorded_engine(monkeypatch, tmp_path):
    """The grpo part's worker on CPU, tiny dims, vLLM replaced by a recorder (TRL 1.16's own generation code runs):
    each arm trains its steps, the FP8 arm syncs inside a layerwise reload, and every timing list is filled."""
    import argparse
    import types

    trl_vllm_generation = pytest.importorskip("trl.generation.vllm_generation")
    pytest.importorskip("datasets")
    events = []
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = lambda model: events.append("init")
    reload.finalize_layerwise_reload = lambda model, cfg: events.append("finalize")
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", reload)
    engine_kwargs = []

    class LLM:
        def __init__(self, **kwargs):
            engine_kwargs.append(kwargs)
            model = types.SimpleNamespace(load_weights=lambda weights: events.extend("load" for _ in weights),
                                          named_parameters=lambda: iter(()),  # direct sync: refused, reloads
                                          named_modules=lambda: iter(()))
            # vLLM resolves async_scheduling None to on for an executor that supports it (TRL's external_launcher)
            scheduler = types.SimpleNamespace(async_scheduling=kwargs.get("async_scheduling", True) is not False)
            self.llm_engine = types.SimpleNamespace(model_config="CFG", model_executor=types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))),
                vllm_config=types.SimpleNamespace(scheduler_config=scheduler))

        def reset_prefix_cache(self):
            events.append("reset")

        def generate(self, prompts, sampling_params, use_tqdm):
            assert sampling_params["min_tokens"] == 6
            assert sampling_params.get("detokenize", True) == (opts.grpo_detokenize == "on")  # auto: the trainer's off
            ids = [7] * 6  # a character token of the tiny tokenizer, never EOS
            logprobs = [{7: types.SimpleNamespace(rank=1, logprob=-0.5)}] * 6
            return [types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                          outputs=[types.SimpleNamespace(token_ids=ids, logprobs=logprobs)])
                    for p in prompts]

    monkeypatch.setattr(trl_vllm_generation, "LLM", LLM, raising=False)
    monkeypatch.setattr(trl_vllm_generation, "SamplingParams", lambda **kw: kw, raising=False)
    monkeypatch.setattr(trl_vllm_generation, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(trl_vllm_generation, "ensure_master_addr_port", lambda: None)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # TRL sets them; restored afterwards
        monkeypatch.setenv(var, "0")
        monkeypatch.delenv(var)
    opts = argparse.Namespace(grpo_layers=1, logit_std=4.0, grpo_completions=8, gpu_util=0.2, grpo_tokens=6,
                              grpo_steps=2, attention_backend="TRITON_ATTN", grpo_profile_rollout=2,
                              grpo_detokenize="on", grpo_capture_size=None)  # "on": as TRL alone
    profiled = []  # every torch.profiler the worker opens: the asked rollout's only, never a sync's
    kernel_profiler = bench_vllm.kernel_profiler
    monkeypatch.setattr(vllm_grpo, "kernel_profiler", lambda: profiled.append(1) or kernel_profiler())
    for arm in ("fp8", "fp8_reload", "bf16", "bf16_gcon"):  # (the bench runs each arm in its own process)
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # the previous arm's _init_vllm set them
            monkeypatch.delenv(var, raising=False)
        events.clear()
        profiled.clear()
        seen = []  # what a run stopped by --grpo-timeout would have left: the timings after every finished step
        timings = bench_vllm.grpo_worker(arm, opts, device="cpu", dims=(128, 256, 4, 4),
                                         progress=lambda so_far: seen.append(list(so_far["step_s"])))
        assert len(timings["step_s"]) == 2 and len(timings["generate_s"]) == 2 and len(timings["sync_s"]) == 2
        assert seen == [timings["step_s"][:1], timings["step_s"]]
        assert timings["startup_s"] > 0
        assert timings["async_scheduling"] is True  # read from the engine's resolved config
        assert "engine async_scheduling on" in bench_vllm.worker_summary(timings, 1)
        assert timings["layers_compiled"] is False  # compile_layers' auto rule: eager on a CPU
        assert "; trainer layers eager;" in bench_vllm.worker_summary(timings, 1)
        assert len(profiled) == 1  # two syncs and two rollouts: only rollout 2 under torch.profiler
        profile = timings["rollout_profile"]  # --grpo-profile-rollout 2: the second step's rollout, under the profiler
        assert profile["step"] == 1 and 0 < profile["wall_ms"] == pytest.approx(timings["generate_s"][1] * 1e3)
        assert set(profile["split_ms"]) == {*(c for c, _ in bench_vllm.DECODE_CATEGORIES), "other"}
        assert all(t > 0 for key in ("step_s", "generate_s", "sync_s") for t in timings[key])
        # each rollout's collector pauses; with the collector off during rollouts (vllm_pause_gc, the default; not
        # in the _gcon arm) at most the one collection that the first allocation after it is switched back on runs
        assert len(timings["gc_ms"]) == len(timings["gc_collections"]) == 2
        # each rollout's CPU time (the stand-in engine runs in this process) and the host's load average beside it
        assert len(timings["rollout_cpu_s"]) == len(timings["load1"]) == len(timings["steal"]) == 2
        assert all(c > 0 for c in timings["rollout_cpu_s"]) and all(load >= 0 for load in timings["load1"])
        assert all(v is None or 0.0 <= v <= 1.0 for v in timings["steal"])
        assert len(timings["deep_gemm_new"]) == 2  # DeepGEMM's cache growth per rollout (None: no cache here)
        # per step: Dynamo's graphs compiled in it (layers eager on a CPU: none) and the collector's pauses in it
        assert timings["step_graphs"] == [0, 0] and len(timings["step_gc_ms"]) == 2
        assert all(ms >= 0 for ms in timings["step_gc_ms"])
        assert "Dynamo graphs compiled per step [0, 0]" in bench_vllm.worker_summary(timings, 1)
        if not arm.endswith("_gcon"):
            assert all(sum(counts) <= 1 for counts in timings["gc_collections"])
        assert engine_kwargs[-1]["attention_backend"] == "TRITON_ATTN"  # added to TRL's own arguments
        # the trainer's capture size (the rollout batch of 8) unless --grpo-capture-size gives one
        assert engine_kwargs[-1]["compilation_config"]["max_cudagraph_capture_size"] == (opts.grpo_capture_size or 8)
        fp8 = arm.startswith("fp8")
        assert (engine_kwargs[-1].get("quantization") == "fp8") == fp8
        assert ("init" in events and "finalize" in events) == fp8
        if arm == "fp8":  # the stand-in engine lists no parameters: the layout check refuses, every sync reloads
            assert timings["direct_sync"]["verified"] is False
            assert "no such engine parameter" in timings["direct_sync"]["reason"]
            assert events.count("init") == 3  # the two steps' syncs and the untimed one before the engine check
        else:
            assert timings["direct_sync"] is None
        if fp8:  # after the run, the engine against the reference quantizer: the stand-in holds no FP8 tensor
            mismatches = timings["engine_mismatches"]
            assert mismatches and all(m.endswith("missing in the engine") for m in mismatches)
        else:
            assert "engine_mismatches" not in timings
    # --grpo-micro-batches 2: the same 16-completion rollout once per optimizer step, trained in two micro-batches
    opts.grpo_completions, opts.grpo_micro_batches, opts.grpo_detokenize = 16, 2, "auto"
    opts.grpo_capture_size, opts.grpo_profile_host = 32, 1  # and the first rollout under cProfile
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    timings = bench_vllm.grpo_worker("bf16", opts, device="cpu", dims=(128, 256, 4, 4))
    assert len(timings["step_s"]) == 2 and len(timings["generate_s"]) == 2  # one rollout per step, not per micro-batch
    assert engine_kwargs[-1]["compilation_config"]["max_cudagraph_capture_size"] == 32  # --grpo-capture-size 32
    host = timings["host_profile"]
    assert host["step"] == 0 and host["wall_ms"] == pytest.approx(timings["generate_s"][0] * 1e3)
    # TRL's own generate (site-packages path from its package) is inside the profiled call, around the engine's
    trl_generate = [r for r in host["top_cumulative"] if r[0].startswith("trl/generation/vllm_generation.py:")
                    and r[0].endswith("(generate)")]
    assert trl_generate and 0 < trl_generate[0][2] <= host["wall_ms"] and trl_generate[0][3] == 1
    assert all(0 <= own <= cumulative + 1e-6 for _, own, cumulative, _ in host["top_cumulative"])
    # rollout 1 under cProfile, rollout 2 under torch.profiler: both steps left out of the medians
    assert timings["rollout_profile"]["step"] == 1 and bench_vllm.without_profiled_step(timings)["step_s"] == []
    opts.grpo_profile_host = 2  # the same rollout as --grpo-profile-rollout: refused
    with pytest.raises(ValueError, match="profile different rollouts"):
        bench_vllm.grpo_worker("bf16", opts, device="cpu", dims=(128, 256, 4, 4))
    opts.grpo_profile_host = opts.grpo_profile_rollout = 0  # no profile asked: nothing runs under a profiler
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    profiled.clear()
    timings = bench_vllm.grpo_worker("bf16", opts, device="cpu", dims=(128, 256, 4, 4))
    assert not profiled and "rollout_profile" not in timings and "host_profile" not in timings
    opts.grpo_micro_batches = 3  # 16 completions do not split into 3 micro-batches of whole groups
    with pytest.raises(ValueError, match="--grpo-micro-batches 3"):
        bench_vllm.grpo_worker("bf16", opts, device="cpu", dims=(128, 256, 4, 4))


def test_grpo_part_warns_of_an_arm_whose_rollouts_ran_on_a_contended_host(monkeypatch, tmp_path, capsys):
    """An arm whose timed rollouts ran steadily slow while the hypervisor stole CPU time shows no drift; the part still
    warns of it when the median steal of its timed rollouts reaches STEAL_WARN (warm-up steps and missing readings
    left out), and not of an arm below it."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    warn = bench_vllm.STEAL_WARN
    # per arm: the steal readings of each step (the first two are the warm-up's)
    steal = {"fp8": [0.5, 0.5, 2 * warn, None, 3 * warn, 2 * warn], "bf16": [0.5, 0.5, 0.0, warn, 0.0, 0.0]}

    def run(cmd, capture_output, text, timeout):
        arm = cmd[cmd.index("--grpo-worker") + 1]
        Path(cmd[cmd.index("--grpo-json") + 1]).write_text(json.dumps({
            "step_s": [9.0, 5.0, 2.0, 2.0, 2.1, 2.0], "generate_s": [1.0] * 6, "sync_s": [0.05] * 6,
            "direct_sync": None, "steal": steal[arm]}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-warmup", "2"]))
    out = capsys.readouterr().out
    assert f"!! fp8: the hypervisor took {200 * warn:.1f}% of the host's CPU time" in out, out
    assert "!! bf16" not in out and "timed rollouts took" not in out  # bf16's median 0.0; no drift in either
    assert vllm_common.RESULTS["grpo"]["rollout_drift"] == ["fp8"]


def test_grpo_part_runs_the_arms_in_turn_and_pools_the_steps_after_warm_up(monkeypatch, tmp_path, capsys):
    """--grpo-rounds 2 runs fp8, bf16, fp8, bf16 (each its own process), leaves each run's first --grpo-warmup steps
    out, and takes the medians over the pooled rest; a failed run is recorded and the others still count. The FP8
    row says whether the engine held the reference quantizer's codes after each run."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    order = []
    step_times = {"fp8": [[9.0, 5.0, 1.0, 1.2], [9.0, 5.0, 1.1, 0.9]], "bf16": [[2.0, 1.4, 1.3, 1.5], None]}

    def run(cmd, capture_output, text, timeout):
        arm = cmd[cmd.index("--grpo-worker") + 1]
        out = Path(cmd[cmd.index("--grpo-json") + 1])
        steps = step_times[arm][sum(a == arm for a in order)]
        order.append(arm)
        if steps is None:
            return types.SimpleNamespace(returncode=1, stdout="", stderr="CUDA out of memory")
        fp8 = {"direct_sync": {"verified": True, "reason": None}, "engine_mismatches": []} if arm == "fp8" else {}
        out.write_text(json.dumps({"step_s": steps, "generate_s": [s / 2 for s in steps],
                                   "sync_s": [0.05] * len(steps), "direct_sync": None, **fp8}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-rounds", "2", "--grpo-warmup", "2"]))
    out = capsys.readouterr().out
    assert "| in place, codes = reference |" in out
    # fp8's timed rollouts (step / 2 here) span 0.50-0.60 s in round 1 (x1.20) and 0.45-0.55 s in round 2 (x1.22),
    # their medians 0.55 / 0.50 s (x1.10): under ROLLOUT_DRIFT within and between runs, so nothing is flagged
    # (test_grpo_part_tells_a_run_that_drifted_from_a_host_that_moved_between_rounds flags both kinds)
    assert "timed rollouts took" not in out and "~ fp8" not in out
    assert vllm_common.RESULTS["grpo"]["rollout_drift"] == []
    assert order == ["fp8", "bf16", "fp8", "bf16"]
    grpo = vllm_common.RESULTS["grpo"]
    assert grpo["fp8"]["timed_steps"] == 4 and grpo["fp8"]["step_median_s"] == pytest.approx(1.05)
    assert grpo["fp8"]["step_range_s"] == [0.9, 1.2]
    assert grpo["bf16"]["timed_steps"] == 2 and grpo["bf16"]["step_median_s"] == pytest.approx(1.4)
    assert "CUDA out of memory" in grpo["bf16"]["runs"][1]["error"]
    assert grpo["bf16_over_fp8_step"] == pytest.approx(1.4 / 1.05)
    assert grpo["fp8"]["sync_share"] == pytest.approx(0.05 / 1.05)
    # rollout = step / 2 in this stand-in, so rollout and training ratios (step - rollout - sync) follow
    assert grpo["bf16_over_fp8_rollout"] == pytest.approx(0.7 / 0.525)
    assert grpo["fp8"]["train_median_s"] == pytest.approx(1.05 / 2 - 0.05)
    assert grpo["bf16_over_fp8_train"] == pytest.approx((0.7 - 0.05) / (0.525 - 0.05))
    # round by round: round 1's pair (BF16 1.4 s / FP8 1.1 s); round 2's BF16 run failed, so that round has none
    assert grpo["bf16_over_fp8_step_by_round"] == [pytest.approx(1.4 / 1.1), None]
    assert "step ratio bf16 / fp8 round by round: 1.27x, - (median 1.27x)" in out


def test_grpo_part_tells_a_run_that_drifted_from_a_host_that_moved_between_rounds(monkeypatch, tmp_path, capsys):
    """Three rounds. fp8's round 2 rollouts spread x1.40 within the run (the machine changed speed mid-run): warned,
    naming the round, and the arm listed in rollout_drift. bf16 ran steadily in each round, at 1.0 s, 1.5 s, 1.0 s: not
    drift, but a host that moved between rounds, noted as such (pooled medians mix it; the paired ratios do not)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    rollouts = {"fp8": [[0.8, 0.8, 0.8], [0.8, 1.0, 1.12], [0.8, 0.82, 0.8]], "bf16": [[1.0] * 3, [1.5] * 3, [1.0] * 3]}
    seen = {"fp8": 0, "bf16": 0}

    def run(cmd, capture_output, text, timeout):
        arm = cmd[cmd.index("--grpo-worker") + 1]
        gen = [5.0] + rollouts[arm][seen[arm]]  # one warm-up step first
        seen[arm] += 1
        Path(cmd[cmd.index("--grpo-json") + 1]).write_text(json.dumps({
            "step_s": [g + 1.0 for g in gen], "generate_s": gen, "sync_s": [0.0] * 4, "direct_sync": None}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-rounds", "3", "--grpo-warmup", "1"]))
    out = capsys.readouterr().out
    assert "!! fp8: its timed rollouts took 0.800-1.120 s within round 2 (x1.40)" in out, out
    assert "!! bf16" not in out and "~ fp8" not in out
    assert "~ bf16: its runs' median rollouts went from 1.000 to 1.500 s from round to round (x1.50)" in out
    grpo = vllm_common.RESULTS["grpo"]
    assert grpo["rollout_drift"] == ["fp8"] and grpo["rollout_between_rounds"] == ["bf16"]
    # the training part (step - rollout - sync = 1.0 s in every step) is the same in both arms, round by round
    assert grpo["bf16_over_fp8_train_by_round"] == pytest.approx([1.0, 1.0, 1.0])


def test_grpo_ratios_are_against_the_fastest_bf16_configuration_measured(monkeypatch, tmp_path):
    """With bf16 (compiled by layer), bf16_eager and bf16_bucketed run, the FP8 arm's ratios are taken against whichever
    was fastest in this run, and the results name it; with only one BF16 arm run, against that one."""
    monkeypatch.setenv("OUT", str(tmp_path))
    step_times = {"fp8": [9.0, 1.0, 1.0], "bf16": [9.0, 1.6, 1.6], "bf16_eager": [9.0, 1.2, 1.2],
                  "bf16_bucketed": [9.0, 1.1, 1.1]}

    def run(cmd, capture_output, text, timeout):
        arm = cmd[cmd.index("--grpo-worker") + 1]
        steps = step_times[arm]
        Path(cmd[cmd.index("--grpo-json") + 1]).write_text(json.dumps(
            {"step_s": steps, "generate_s": [s / 2 for s in steps], "sync_s": [0.0] * 3, "direct_sync": None}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    for arms, baseline in (("fp8,bf16,bf16_eager", "bf16_eager"), ("fp8,bf16", "bf16"),
                           ("fp8,bf16,bf16_eager,bf16_bucketed", "bf16_bucketed")):
        monkeypatch.setattr(vllm_common, "RESULTS", {})
        bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-arms", arms, "--grpo-warmup", "1"]))
        grpo = vllm_common.RESULTS["grpo"]
        assert grpo["bf16_baseline"] == baseline
        assert grpo["bf16_over_fp8_step"] == pytest.approx(step_times[baseline][1] / 1.0)
    step_times["bf16_eager"] = [9.0, 2.0, 2.0]  # eager slower: the compiled BF16 stays the baseline
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-arms", "fp8,bf16,bf16_eager",
                                                "--grpo-warmup", "1"]))
    assert vllm_common.RESULTS["grpo"]["bf16_baseline"] == "bf16"
    assert vllm_common.RESULTS["grpo"]["bf16_over_fp8_step"] == pytest.approx(1.6)


def test_grpo_fp8_row_names_an_engine_tensor_that_differs_in_any_round(monkeypatch, tmp_path, capsys):
    """Two FP8 rounds, the engine as the reference quantizer would have it after the first only: the row names the
    second round's differing tensor, not the first round's empty list."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    mismatches = iter([[], ["model.layers.0.mlp.down_proj.weight: engine ..."]])

    def run(cmd, capture_output, text, timeout):
        Path(cmd[cmd.index("--grpo-json") + 1]).write_text(json.dumps(
            {"step_s": [9.0, 1.0, 1.0], "generate_s": [4.5, 0.5, 0.5], "sync_s": [0.0] * 3,
             "direct_sync": {"verified": True, "reason": None}, "engine_mismatches": next(mismatches)}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-arms", "fp8", "--grpo-rounds", "2",
                                                "--grpo-warmup", "1"]))
    out = capsys.readouterr().out
    # (the column keeps 60 characters)
    assert "in place, CODES DIFFER: ['model.layers.0.mlp.down_proj" in out and "codes = reference" not in out


def test_grpo_arm_settings_say_what_each_arm_changes():
    assert bench_vllm.grpo_arm_settings("bf16") == {"fp8": False, "vllm_fp8_direct_sync": True, "vllm_pause_gc": True,
                                                    "compile_layers": None, "compile_layers_shapes": None}
    # the recipe's own layer shapes (bucketed for torchao's), against symbolic ones: what the buckets bought
    assert bench_vllm.grpo_arm_settings("fp8_dynamic") == {**bench_vllm.grpo_arm_settings("fp8"),
                                                           "compile_layers_shapes": "dynamic"}
    assert bench_vllm.grpo_arm_settings("bf16_bucketed") == {**bench_vllm.grpo_arm_settings("bf16"),
                                                             "compile_layers_shapes": "bucketed"}
    assert "bf16_bucketed" in bench_vllm.GRPO_BF16_BASELINES  # a baseline: the fastest BF16 run is the base
    assert bench_vllm.grpo_arm_settings("bf16_eager")["compile_layers"] is False
    assert bench_vllm.grpo_arm_settings("fp8")["fp8"] and bench_vllm.grpo_arm_settings("fp8")["compile_layers"] is None
    assert bench_vllm.grpo_arm_settings("fp8_reload")["vllm_fp8_direct_sync"] is False
    assert bench_vllm.grpo_arm_settings("bf16_gcon")["vllm_pause_gc"] is False
    with pytest.raises(ValueError, match="grpo arm 'bf16c'"):
        bench_vllm.grpo_arm_settings("bf16c")
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--parts", "grpo", "--grpo-arms", "fp8,bf16c"])


class StandInEngine:
    """A vllm.LLM stand-in for the mismatch part on CPU: an HF model loaded from the engine's directory that takes
    every synced tensor (FP8 codes + weight_scale_inv, or + per-row weight_scale, are dequantized into its BF16
    weights) and samples with it;
    its ``named_parameters`` show what a vLLM model would hold (shards stacked into qkv_proj / gate_up_proj)."""

    instances = []

    def __init__(self, **kwargs):
        from calclip.fp8.reference import dequantize_128x128

        self.kwargs, self.dequantize = kwargs, dequantize_128x128
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(kwargs["model"], dtype=torch.bfloat16).eval()
        self.received = {}
        runner = torch.nn.Module()
        runner.load_weights = self.load_weights
        runner.named_parameters = self.named_parameters
        executor = type("E", (), {})()
        executor.driver_worker = type("W", (), {"model_runner": type("R", (), {"model": runner})()})()
        self.llm_engine = type("L", (), {"model_executor": executor, "model_config": "CFG"})()
        StandInEngine.instances.append(self)

    def load_weights(self, weights):
        for name, tensor in weights:
            self.received[name] = tensor.detach().clone()
            module, _, leaf = name.rpartition(".")
            if leaf == "weight_scale_inv":
                codes = self.received[f"{module}.weight"]
                self.hf.get_parameter(f"{module}.weight").data.copy_(self.dequantize(codes, tensor))
            elif leaf == "weight_scale":  # rowwise / tensorwise: one dequantization scale per output row
                codes = self.received[f"{module}.weight"]
                self.hf.get_parameter(f"{module}.weight").data.copy_(codes.float() * tensor)
            elif tensor.dtype != torch.float8_e4m3fn:
                self.hf.get_parameter(name).data.copy_(tensor)

    def named_parameters(self):
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        groups = {}
        for name, t in self.received.items():
            module, _, leaf = name.rpartition(".")
            parent, _, short = module.rpartition(".")
            if leaf in ("weight", "weight_scale_inv", "weight_scale") and (
                    t.dtype == torch.float8_e4m3fn or leaf != "weight"):
                target, index = fused.get(short, (short, 0))
                groups.setdefault(f"{parent}.{target}.{leaf}", {})[index] = t
        for name, parts in groups.items():
            yield name, torch.nn.Parameter(torch.cat([parts[i] for i in sorted(parts)]), requires_grad=False)

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm):
        """vLLM 0.24's output shapes: outputs[0].token_ids / .logprobs (one {token: Logprob} per sampled token),
        prompt_token_ids, and with prompt_logprobs=0 a FlatLogprobs-like prompt_logprobs (None first)."""
        gen = torch.Generator().manual_seed(params.get("seed") or 0)
        outs = []
        for p in prompts:
            ids, steps = list(p["prompt_token_ids"]), []
            prompt_lp = None
            if params.get("prompt_logprobs") is not None:
                with torch.no_grad():
                    logp = torch.log_softmax(self.hf(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
                prompt_lp = FlatLogprobsLike([None] + [{t: Logprob(float(logp[i, t]))} for i, t in enumerate(ids[1:])])
            for _ in range(params["max_tokens"]):
                with torch.no_grad():
                    logp = torch.log_softmax(self.hf(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
                if params.get("temperature", 1.0) == 0:
                    tok = int(logp.argmax())
                else:
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                steps.append({tok: Logprob(float(logp[tok]))})
                ids.append(tok)
            completion = ids[len(p["prompt_token_ids"]):]
            outs.append(type("O", (), {"outputs": [type("C", (), {"token_ids": completion, "logprobs": steps})()],
                                       "prompt_token_ids": list(p["prompt_token_ids"]),
                                       "prompt_logprobs": prompt_lp})())
        return outs


class Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class FlatLogprobsLike:
    """Indexable like vllm.logprobs.FlatLogprobs: ``[i]`` builds a fresh {token: Logprob} dict (None only at 0)."""

    def __init__(self, positions):
        self.positions = positions

    def __len__(self):
        return len(self.positions)

    def __getitem__(self, i):
        step = self.positions[i]
        return None if step is None else dict(step)


def use_stand_in_vllm(monkeypatch, tmp_path) -> None:
    """The mismatch part's vLLM for this test: ``StandInEngine`` engines, no-op layerwise-reload hooks, a 1-layer
    "tiny" model spec, fresh RESULTS written under ``tmp_path``."""
    import types

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = StandInEngine, lambda **kw: kw
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = lambda model: None
    reload.finalize_layerwise_reload = lambda model, cfg: None
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    for name in ("vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", reload)
    monkeypatch.setitem(bench_vllm.MODEL_SPECS, "tiny", (128, 256, 4, 4, 96, 1))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    monkeypatch.setenv("OUT", str(tmp_path))
    StandInEngine.instances.clear()


@pytest.mark.slow
def test_mismatch_part_runs_both_stages_syncs_every_engine_and_reports_each_row(monkeypatch, tmp_path, capsys):
    use_stand_in_vllm(monkeypatch, tmp_path)
    opts = bench_vllm.parse_args(["--parts", "mismatch", "--models", "issue_probe", "--mismatch-prompts", "2",
                                  "--mismatch-tokens", "3", "--prompt-len", "4", "--steps", "2", "--lr", "1e-2"])
    opts.models, opts.device = ["tiny"], "cpu"
    bench_vllm.part_mismatch(opts)
    rows = vllm_common.RESULTS["mismatch"]
    assert [(r["stage"], r["arm"]) for r in rows] == [
        (stage, arm) for stage in ("initial", "after 2 steps + sync")
        for arm in ("FP8 calclip", "FP8 vLLM-default", "BF16")]
    fp8, default, bf16 = StandInEngine.instances
    assert fp8.kwargs["linear_backend"] == "cutlass" and "linear_backend" not in default.kwargs
    assert fp8.kwargs["compilation_config"]["pass_config"] == {"fuse_norm_quant": False, "fuse_act_quant": False}
    assert "quantization" not in bf16.kwargs
    assert not any("enforce_eager" in e.kwargs for e in (fp8, default, bf16))  # graphs on unless asked
    for r in rows:
        assert r["tmpe"] >= 1.0 and math.isfinite(r["tmpe"])
        if r["arm"] != "BF16":
            assert r["engine_holds_trainer_codes"] == "yes", r  # after the first sync and after the second
    assert rows[3]["sync_ms"] > 0 and rows[5]["sync_ms"] > 0 and rows[0]["sync_ms"] is None
    assert rows[0]["floor_tmpe"] >= 1.0 and rows[1]["floor_tmpe"] is None
    assert rows[0]["minus_bf16_control"] == pytest.approx(rows[0]["tmpe"] - rows[2]["tmpe"])
    for r in rows:  # the stand-in samples with the very model the trainer runs
        d = r["diag"]
        assert "error" not in d, d
        assert d["align"]["tmpe"] == pytest.approx(1.0, abs=1e-3), d
        assert d["prompt_ids_echoed"] == 1.0 and d["greedy_top1_agree"] == 1.0
        if r["arm"] == "BF16":  # the stand-in computes the BF16 forward exactly as the trainer does
            assert d["tf_prompt"]["max_abs"] < 1e-3 and d["tf_completion"]["max_abs"] < 1e-3, d
    assert (tmp_path / "bench_vllm.json").exists()
    out = capsys.readouterr().out
    assert "### mismatch" in out and "### mismatch diagnostics" in out


def _fake_output(ids, logps, flat):
    positions = [None] + [{t: Logprob(v), 99999: Logprob(-50.0)} for t, v in zip(ids[1:], logps)]
    plp = FlatLogprobsLike(positions) if flat else positions
    return type("O", (), {"prompt_logprobs": plp, "prompt_token_ids": ids})()


@pytest.mark.parametrize("flat", [False, True])
def test_prompt_logprobs_of_reads_each_tokens_own_logprob(flat):
    ids = [5, 7, 9, 11]
    out = _fake_output(ids, [-1.0, -2.0, -3.0], flat)
    assert bench_vllm.prompt_logprobs_of(out, ids) == [-1.0, -2.0, -3.0]
    with pytest.raises(ValueError, match="4 tokens"):
        bench_vllm.prompt_logprobs_of(_fake_output(ids[:3], [-1.0, -2.0], flat), ids)
    with pytest.raises(ValueError, match="lacks the prompt token 8"):
        bench_vllm.prompt_logprobs_of(out, [5, 7, 8, 11])
    with pytest.raises(ValueError, match="no prompt_logprobs"):
        bench_vllm.prompt_logprobs_of(type("O", (), {"prompt_logprobs": None})(), ids)


def test_diagnostic_stats_split_prompt_and_completion_positions():
    # prompt of 3 tokens, completion of 2: teacher-forced arrays have 4 columns (tokens 1..4); completion = last 2
    engine_tf = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    trainer_tf = torch.tensor([[-1.0, -2.5, -3.0, -4.0]])
    rollout = torch.tensor([[-3.0, -4.0]])
    d = bench_vllm.diagnostic_stats(rollout, engine_tf, trainer_tf, 3, torch.tensor([4, 5]), torch.tensor([4, 6]))
    assert d["align"]["max_abs"] == 0 and d["align"]["tmpe"] == pytest.approx(1.0)
    assert d["tf_prompt"]["max_abs"] == pytest.approx(0.5) and d["tf_prompt"]["tokens"] == 2
    assert d["tf_completion"]["max_abs"] == 0 and d["tf_completion"]["tokens"] == 2
    assert d["greedy_top1_agree"] == pytest.approx(0.5)
    assert d["mean_logp"]["engine_tf_prompt"] == pytest.approx(-1.5)
    assert d["mean_logp"]["trainer_completion"] == pytest.approx(-3.5)
    # a rollout whose log-probs sit one position off shows in align, not in the engine/trainer columns
    shifted = bench_vllm.diagnostic_stats(torch.tensor([[-2.0, -3.0]]), engine_tf, engine_tf, 3)
    assert shifted["align"]["max_abs"] == pytest.approx(1.0) and shifted["tf_completion"]["max_abs"] == 0
    assert "greedy_top1_agree" not in shifted


def test_trainer_all_logprobs_match_the_completion_slice_of_trainer_logprobs():
    torch.manual_seed(0)
    from bench_speed import build_llama

    model = build_llama(1, 128, 256, 64, "cpu", heads=2, kv_heads=2).eval()
    prompts, completions = torch.randint(3, 64, (3, 4)), torch.randint(3, 64, (3, 5))
    ids = torch.cat([prompts, completions], 1)
    full, top = bench_vllm.trainer_all_logprobs(model, ids, chunk=2)
    assert full.shape == (3, 8) and top.shape == (3, 9)
    torch.testing.assert_close(full[:, 3:], bench_vllm.trainer_logprobs(model, prompts, completions), rtol=0,
                               atol=1e-5)
    with torch.no_grad():
        assert torch.equal(top[:, 3], model(input_ids=prompts).logits[:, -1].argmax(-1))


def test_diagnostic_row_names_the_runner_and_survives_an_error():
    d = bench_vllm.diagnostic_stats(torch.zeros(1, 2) - 1, torch.zeros(1, 4) - 1, torch.zeros(1, 4) - 1, 3,
                                    torch.tensor([1]), torch.tensor([1]))
    row = bench_vllm.diagnostic_row("m", "initial", "BF16", {**d, "runner": "vllm.v1.worker.gpu.model_runner.X",
                                                             "prompt_ids_echoed": 1.0})
    assert len(row) == len(bench_vllm.DIAGNOSTIC_COLUMNS) and row[3] == "V2" and row[10] == "1.000"
    err = bench_vllm.diagnostic_row("m", "initial", "BF16", {"error": "ValueError: x"})
    assert len(err) == len(bench_vllm.DIAGNOSTIC_COLUMNS) and err[3].startswith("ValueError")


def test_mismatch_arms_are_checked_and_the_default_arm_switch_still_drops_vllm(capsys):
    assert bench_vllm.parse_args([]).mismatch_arms == ["calclip", "vllm", "bf16"]
    assert bench_vllm.parse_args(["--mismatch-arms", "bf16"]).mismatch_arms == ["bf16"]
    assert bench_vllm.parse_args(["--no-vllm-default-arm"]).mismatch_arms == ["calclip", "bf16"]
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--mismatch-arms", "fp8"])
    assert "--mismatch-arms" in capsys.readouterr().err


def test_decode_part_runs_one_engine_at_a_time_and_fills_every_cell(monkeypatch, tmp_path):
    """vLLM 0.24: a later in-process engine clears an earlier engine's CUDA graphs, so each engine is built, timed
    on every cell and shut down before the next is built."""
    import types

    events = []

    class Engine:
        def __init__(self, name):
            self.name = name

        def generate(self, requests, params, use_tqdm):
            events.append(("generate", self.name))
            outs = [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * params["max_tokens"])])
                    for _ in requests]
            return outs

    def make_llm(model_dir, opts, *, quantization_config=None, numerics="calclip", **kw):
        name = "BF16" if quantization_config is None else f"FP8 {numerics}"
        events.append(("build", name))
        return Engine(name)

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(vllm_decode, "make_llm", make_llm)
    monkeypatch.setattr(vllm_decode, "shutdown", lambda llm: events.append(("shutdown", llm.name)))
    monkeypatch.setattr(vllm_decode, "config_only_dir", lambda name, layers, d: d)
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    monkeypatch.setenv("OUT", str(tmp_path))
    opts = bench_vllm.parse_args(["--parts", "decode", "--batches", "2,4", "--new-tokens", "3", "--repeats", "2",
                                  "--decode-vllm-default"])
    bench_vllm.part_decode(opts)
    order = [e for e in events if e[0] != "generate"]
    assert order == [("build", "FP8 calclip"), ("shutdown", "FP8 calclip"), ("build", "FP8 vllm"),
                     ("shutdown", "FP8 vllm"), ("build", "BF16"), ("shutdown", "BF16")]
    # each engine generates only while it is the one alive: warm-up + 2 rounds per cell, 2 cells
    assert [e for e in events if e[0] == "generate"][:6] == [("generate", "FP8 calclip")] * 6
    rows = vllm_common.RESULTS["decode"]
    assert [(r["batch"], r["new_tokens"]) for r in rows] == [(2, 3), (4, 3)]
    for r in rows:
        assert all(len(r[name]) == 2 for name in ("vLLM FP8", "vLLM FP8 vLLM-default", "vLLM BF16")), r
        assert not any(r["errors"].values())


def test_enforce_eager_reaches_every_engine(monkeypatch):
    import types

    seen = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda **kwargs: seen.append(kwargs) or object()
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    for argv, expected in ((["--enforce-eager"], True), ([], None)):
        opts = bench_vllm.parse_args(argv)
        bench_vllm.make_llm("unused", opts, max_model_len=64, max_num_seqs=2, batches=[2], gpu_util=0.1)
        assert seen[-1].get("enforce_eager") is expected
    for argv, expected in ((["--parts", "decode", "--model-impl", "transformers"], "transformers"), ([], None)):
        opts = bench_vllm.parse_args(argv)
        bench_vllm.make_llm("unused", opts, max_model_len=64, max_num_seqs=2, batches=[2], gpu_util=0.1)
        assert seen[-1].get("model_impl") == expected
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--model-impl", "hf"])


def _fused_engine_model(base):
    """A stand-in for vLLM's LlamaForCausalLM over ``base``: q/k/v and gate/up stacked into qkv_proj /
    gate_up_proj, everything else under its own name (what vLLM's loaders build)."""
    engine = torch.nn.Module()
    params = dict(base.named_parameters())
    for name, p in params.items():
        module, _, leaf = name.rpartition(".")
        parent, _, short = module.rpartition(".")
        if short in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            if short not in ("q_proj", "gate_proj"):
                continue
            shards = ("q_proj", "k_proj", "v_proj") if short == "q_proj" else ("gate_proj", "up_proj")
            fused = "qkv_proj" if short == "q_proj" else "gate_up_proj"
            value = torch.cat([params[f"{parent}.{s}.{leaf}"] for s in shards]).detach().clone()
            name = f"{parent}.{fused}.{leaf}"
        else:
            value = p.detach().clone()
        engine.register_parameter(name.replace(".", "__"), torch.nn.Parameter(value))
    # named_parameters() of the stand-in must give vLLM's dotted names
    engine.named_parameters = lambda: [(n.replace("__", "."), q) for n, q in engine._parameters.items()]
    return engine


def test_engine_weight_mismatches_finds_a_changed_lm_head_a_fused_shard_and_nothing_on_a_faithful_copy():
    from bench_speed import build_llama

    base = build_llama(1, 128, 256, 64, "cpu", heads=2, kv_heads=1)
    engine = _fused_engine_model(base)
    compared, bad = bench_vllm.engine_weight_mismatches(engine, base)
    # embed, lm_head, final norm, two layer norms, qkv, o, gate_up, down
    assert (compared, bad) == (9, [])
    with torch.no_grad():
        dict(engine.named_parameters())["lm_head.weight"].add_(1.0)
        dict(engine.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"][-1, 0] += 0.5  # a v_proj row
    compared, bad = bench_vllm.engine_weight_mismatches(engine, base)
    assert compared == 9 and sorted(b.split(":")[0] for b in bad) == [
        "lm_head.weight", "model.layers.0.self_attn.qkv_proj.weight"]


def test_engine_weight_mismatches_reads_a_padded_vocab_table_on_its_first_rows_and_skips_fp8_tensors():
    from bench_speed import build_llama

    base = build_llama(1, 128, 256, 60, "cpu", heads=2, kv_heads=1)
    engine = _fused_engine_model(base)
    params = dict(engine.named_parameters())
    key = "model__embed_tokens__weight"
    engine._parameters[key] = torch.nn.Parameter(torch.cat([params["model.embed_tokens.weight"],
                                                            torch.zeros(4, 128)]))
    engine._parameters["model__layers__0__mlp__down_proj__weight"] = torch.nn.Parameter(
        torch.zeros(128, 256).to(torch.float8_e4m3fn), requires_grad=False)
    compared, bad = bench_vllm.engine_weight_mismatches(engine, base)
    assert (compared, bad) == (8, [])
    engine._parameters[key] = torch.nn.Parameter(params["model.embed_tokens.weight"][:50].clone())
    assert any("embed_tokens" in b and "engine (50, 128)" in b for b in bench_vllm.engine_weight_mismatches(
        engine, base)[1])


def test_mismatch_runs_one_child_per_model_and_engine_and_the_control_difference_is_filled_after_merging():
    opts = bench_vllm.parse_args(["--parts", "ops,mismatch,decode", "--models", "llama3_8b,issue_probe",
                                  "--mismatch-arms", "calclip,bf16"])
    assert bench_vllm.child_runs(opts) == [("ops", None, None), ("mismatch", "llama3_8b", "bf16"),  # control first
                                           ("mismatch", "llama3_8b", "calclip"), ("mismatch", "issue_probe", "bf16"),
                                           ("mismatch", "issue_probe", "calclip"), ("decode", None, None)]
    results = {"mismatch": [{"model": "a", "stage": "initial", "arm": "FP8 calclip", "tmpe": 1.45},
                            {"model": "a", "stage": "initial", "arm": "BF16", "tmpe": 1.08},
                            {"model": "a", "stage": "after", "arm": "FP8 calclip", "tmpe": 1.2},
                            {"model": "b", "stage": "initial", "arm": "FP8 vLLM-default", "tmpe": 1.5},
                            {"model": "b", "stage": "initial", "arm": "BF16", "error": "RuntimeError: x"}]}
    bench_vllm.add_control_differences(results)
    rows = results["mismatch"]
    assert rows[0]["minus_bf16_control"] == pytest.approx(0.37, abs=1e-12)
    assert rows[2]["minus_bf16_control"] is None and rows[3]["minus_bf16_control"] is None
    assert "minus_bf16_control" not in rows[1]


@pytest.mark.parametrize("parts", ["mismatch", "grpo", "ops,mismatch,decode"])
def test_transformers_backend_is_refused_where_a_trainer_model_shares_the_process(parts, capsys):
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--parts", parts, "--model-impl", "transformers"])
    assert "patches the transformers model class" in capsys.readouterr().err
    assert bench_vllm.parse_args(["--parts", "decode", "--model-impl", "transformers"]).model_impl == "transformers"


def test_degenerate_rows_are_flagged_and_get_no_control_difference():
    diag = lambda logp: {"mean_logp": {"trainer_completion": logp}}  # noqa: E731
    assert bench_vllm.is_degenerate(diag(-0.001)) and not bench_vllm.is_degenerate(diag(-5.1))
    assert not bench_vllm.is_degenerate({"error": "RuntimeError: x"}) and not bench_vllm.is_degenerate(diag(None))
    results = {"mismatch": [
        {"model": "a", "stage": "after", "arm": "FP8 calclip", "tmpe": 1.0000, "degenerate": True},
        {"model": "a", "stage": "after", "arm": "BF16", "tmpe": 1.0000, "degenerate": True},
        {"model": "a", "stage": "initial", "arm": "FP8 calclip", "tmpe": 1.45, "degenerate": False},
        {"model": "a", "stage": "initial", "arm": "BF16", "tmpe": 1.07, "degenerate": True},
        {"model": "b", "stage": "initial", "arm": "FP8 calclip", "tmpe": 1.2, "degenerate": False},
        {"model": "b", "stage": "initial", "arm": "BF16", "tmpe": 1.1, "degenerate": False}]}
    bench_vllm.add_control_differences(results)
    rows = results["mismatch"]
    assert rows[0]["minus_bf16_control"] is None and rows[2]["minus_bf16_control"] is None
    assert rows[4]["minus_bf16_control"] == pytest.approx(0.1, abs=1e-12)


def test_mismatch_defaults_take_one_small_step():
    opts = bench_vllm.parse_args([])
    assert opts.steps == 1 and opts.lr == pytest.approx(1e-5)


def test_grpo_arms_are_checked():
    assert bench_vllm.parse_args(["--grpo-arms", "fp8,fp8_reload,bf16"]).grpo_arms == ["fp8", "fp8_reload", "bf16"]
    assert bench_vllm.parse_args([]).grpo_arms == ["fp8", "bf16"]
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--grpo-arms", "fp16"])
    assert bench_vllm.parse_args(["--grpo-profile-rollout", "4", "--grpo-profile-host", "5"]).grpo_profile_host == 5
    with pytest.raises(SystemExit):  # one rollout under both profilers: each would slow the other's measurement
        bench_vllm.parse_args(["--grpo-profile-rollout", "4", "--grpo-profile-host", "4"])


def test_decode_kernels_fall_in_their_categories_and_split_per_step():
    import _common

    cat = lambda name: _common.kernel_category(name, bench_vllm.DECODE_CATEGORIES)  # noqa: E731
    assert cat("void vllm::per_token_group_quant_8bit_kernel<__nv_bfloat16>") == "FP8 activation quantizer"
    assert cat("_per_token_group_quant_fp8") == "FP8 activation quantizer"
    assert cat("void cutlass::device_kernel<vllm::cutlass_3x_gemm_fp8_blockwise<...>>") == "FP8 GEMM (CUTLASS)"
    assert cat("void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u, 4096u, 4096u, 64u, 128u>") == "FP8 GEMM (DeepGEMM)"
    assert cat("kernel_unified_attention_2d") == "attention"
    assert cat("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "BF16 GEMM"
    assert cat("void vllm::rms_norm_kernel<c10::BFloat16>") == "norms and activation"
    assert cat("_topk_log_softmax_kernel") == "sampling / softmax"
    assert cat("void at::native::elementwise_kernel<...>") == "other"
    split = bench_vllm.decode_split({"nvjet_sm90_a": (6000.0, 3), "cutlass_x": (4000.0, 2), "foo": (2000.0, 1)},
                                    steps=4)
    assert {k: v for k, v in split.items() if v} == {"BF16 GEMM": 1.5, "FP8 GEMM (CUTLASS)": 1.0, "other": 0.5,
                                                       "total": 3.0}
    assert set(split) == {*(c for c, _ in bench_vllm.DECODE_CATEGORIES), "other", "total"}


def test_decode_profile_profiles_each_engine_alone_without_graphs(monkeypatch, capsys):
    import types

    built = []

    class LLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

        def generate(self, requests, params, use_tqdm):
            torch.ones(64, 64) @ torch.ones(64, 64)  # something for the profiler (no CUDA kernels on CPU)
            return []

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(vllm_decode, "shutdown", lambda llm: None)
    monkeypatch.setattr(vllm_decode, "cuda_sync", lambda: None)
    vllm_common.RESULTS.clear()
    opts = bench_vllm.parse_args(["--parts", "decode_profile", "--decode-layers", "1", "--batches", "2"])
    bench_vllm.part_decode_profile(opts)
    assert len(built) == 2 and all(k["enforce_eager"] for k in built)
    assert built[0]["quantization"] == "fp8" and "quantization" not in built[1]
    out = capsys.readouterr().out
    assert "### decode_profile" in out and "FP8 activation quantizer" in out
    assert set(vllm_common.RESULTS["decode_profile"]) == {"vLLM FP8", "vLLM BF16"}


def test_decode_arms_reach_the_engine_with_their_own_backend_and_format(monkeypatch):
    """Each --decode-arms engine hands vllm.LLM its own GEMM backend / quantization format, after the numerics
    defaults (an arm's linear_backend beats fp8_engine_numerics_kwargs's "cutlass")."""
    import types

    seen = []
    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda **kwargs: seen.append(kwargs) or object()
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    opts = bench_vllm.parse_args(["--parts", "decode", "--decode-arms",
                                  "bf16,fp8,fp8_dg,fp8_dg_fused,online,rowwise,tensorwise"])
    opts.dummy_bf16 = True
    specs = bench_vllm.decode_engine_specs(opts.decode_arms)
    assert [label for label, _ in specs][:2] == ["vLLM BF16", "vLLM FP8"]
    for _, kwargs in specs:
        bench_vllm.make_llm("unused", opts, max_model_len=64, max_num_seqs=2, batches=[2], gpu_util=0.1, **kwargs)
    bf16, fp8, dg, dg_fused, online, rowwise, tensorwise = seen
    assert "quantization" not in bf16 and bf16["load_format"] == "dummy"
    assert fp8["linear_backend"] == "cutlass" and fp8["compilation_config"]["pass_config"]["fuse_act_quant"] is False
    assert dg["linear_backend"] == "deep_gemm" and dg["compilation_config"]["pass_config"]["fuse_norm_quant"] is False
    assert dg["hf_overrides"]["quantization_config"]["weight_block_size"] == [128, 128]
    assert dg_fused["linear_backend"] == "deep_gemm" and "pass_config" not in dg_fused["compilation_config"]
    assert online["quantization"] == "fp8" and "hf_overrides" not in online and online["load_format"] == "dummy"
    for kw, weights, acts in ((rowwise, "channel", "token"), (tensorwise, "tensor", "tensor")):
        group = kw["hf_overrides"]["quantization_config"]["config_groups"]["group_0"]
        assert kw["quantization"] == "compressed-tensors"
        assert (group["weights"]["strategy"], group["input_activations"]["strategy"]) == (weights, acts)
        assert group["input_activations"]["dynamic"] is True
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--decode-arms", "fp8,nope"])


def test_grpo_part_keeps_the_steps_a_timed_out_run_finished(monkeypatch, tmp_path):
    """A worker stopped by --grpo-timeout leaves the timings of the steps it finished (written after each step):
    those past --grpo-warmup count; one that finished no step past the warm-up is an error."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    left = {"fp8": [9.0, 1.1, 1.3], "bf16": [2.0]}

    def run(cmd, capture_output, text, timeout):
        arm = cmd[cmd.index("--grpo-worker") + 1]
        Path(cmd[cmd.index("--grpo-json") + 1]).write_text(json.dumps(
            {"step_s": left[arm], "generate_s": [1.0] * len(left[arm]), "sync_s": [0.01] * len(left[arm]),
             "startup_s": 40.0, "partial": True}))
        raise bench_vllm.subprocess.TimeoutExpired(cmd, timeout, output=b"capturing", stderr=b"")

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-warmup", "1", "--grpo-timeout", "5"]))
    grpo = vllm_common.RESULTS["grpo"]
    assert grpo["fp8"]["timed_steps"] == 2 and grpo["fp8"]["step_median_s"] == pytest.approx(1.2)
    assert grpo["fp8"]["runs"][0]["timed_out_after_s"] == 5 and grpo["fp8"]["startup_median_s"] == 40.0
    assert "timed out after 5 s" in grpo["bf16"]["error"]
    assert "bf16_over_fp8_step" not in grpo


def test_grpo_part_leaves_the_profiled_step_out_and_prints_where_its_rollout_went(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    times = {"nvjet_sm90_tst_256x128": (3000.0, 64), "void deep_gemm::sm90_fp8_gemm_1d2d_impl<>": (1500.0, 64),
             "_per_token_group_quant_fp8": (500.0, 64), "kernel_unified_attention_2d": (800.0, 16)}
    # the host side: two graph replays and one eager launch on the CPU; the eager kernel ran 100 us after the
    # replays' last kernel, launched from the sampler
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, device, start, end, id, parent=None):
        return types.SimpleNamespace(name=name, device_type=device, time_range=types.SimpleNamespace(start=start,
                                     end=end), id=id, cpu_parent=parent, cpu_time_total=end - start)

    sampler = event("aten::argmax", cpu, 0, 1, 0)
    events = [event("cudaGraphLaunch", cpu, 0, 1, 1), event("cudaGraphLaunch", cpu, 1, 2, 2),
              event("cudaLaunchKernel", cpu, 2, 3, 3, sampler), sampler,
              event("graph_kernel", cuda, 10, 50, 1), event("graph_kernel", cuda, 50, 90, 2),
              event("argmax_kernel", cuda, 190, 200, 3)]
    prof = types.SimpleNamespace(events=lambda: events)
    monkeypatch.setattr(bench_vllm._common, "kernel_times", lambda p: times if p is prof else {})
    profile = bench_vllm.rollout_profile(prof, 0.010, step=2)
    assert profile["kernel_ms"] == pytest.approx(5.8) and profile["busy_share"] == pytest.approx(0.58)
    assert profile["split_ms"]["FP8 GEMM (DeepGEMM)"] == pytest.approx(1.5) and profile["launches"] == 208
    assert profile["top"][0] == ("nvjet_sm90_tst_256x128", 3.0, 64)
    assert profile["graph_launches"] == 2 and profile["launch_calls"] == 1
    assert profile["idle_ms"] == pytest.approx(0.1) and profile["idle_top"] == [("aten::argmax", 0.1, 1)]

    def run(cmd, capture_output, text, timeout):
        arm = cmd[cmd.index("--grpo-worker") + 1]
        assert cmd[cmd.index("--grpo-profile-rollout") + 1] == "3" and cmd[cmd.index("--grpo-detokenize") + 1] == "off"
        assert cmd[cmd.index("--grpo-capture-size") + 1] == "256"
        steps = [9.0, 1.0, 5.0, 1.2] if arm == "fp8" else [9.0, 1.4, 1.5, 1.6]  # fp8's profiled step 3: 5.0 s
        Path(cmd[cmd.index("--grpo-json") + 1]).write_text(json.dumps(
            {"step_s": steps, "generate_s": [s / 2 for s in steps], "sync_s": [0.01] * 4, "direct_sync": None,
             **({"rollout_profile": profile} if arm == "fp8" else {"host_profile": host})}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    # bf16's rollout 2 under cProfile: 400 of its 500 ms inside vLLM's step, 300 of them in the scheduler itself
    host = {"step": 1, "wall_ms": 500.0,
            "top_cumulative": [["vllm/v1/engine/llm_engine.py:280(step)", 20.0, 400.0, 256],
                               ["vllm/v1/core/sched/scheduler.py:240(schedule)", 300.0, 300.0, 256]],
            "top_own": [["vllm/v1/core/sched/scheduler.py:240(schedule)", 300.0, 300.0, 256]]}

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-warmup", "1",
                                                "--grpo-profile-rollout", "3", "--grpo-detokenize", "off",
                                                "--grpo-capture-size", "256"]))
    grpo = vllm_common.RESULTS["grpo"]
    assert grpo["fp8"]["timed_steps"] == 2 and grpo["fp8"]["step_median_s"] == pytest.approx(1.1)  # 5.0 left out
    assert grpo["bf16"]["timed_steps"] == 2 and grpo["bf16"]["step_median_s"] == pytest.approx(1.55)  # 1.4 out
    printed = capsys.readouterr().out
    assert "grpo rollout profile" in printed and "FP8 GEMM (DeepGEMM)" in printed and "58%" in printed
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in printed.splitlines() if line.startswith("| "))}
    assert rows["CUDA graph replays (cudaGraphLaunch)"] == ["2"] and rows["kernels launched outside graphs"] == ["1"]
    assert rows["GPU idle between kernels"] == ["0.1"]
    assert "fp8: where its GPU idled" in printed and rows["aten::argmax"] == ["0.1", "1"]
    assert "bf16: host profile of rollout 2 (cProfile, 500.0 ms wall" in printed
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines()
             if line.startswith("| vllm")]
    assert ["vllm/v1/engine/llm_engine.py:280(step)", "20.0", "400.0", "80.0%", "256"] in cells  # cumulative share
    assert ["vllm/v1/core/sched/scheduler.py:240(schedule)", "300.0", "300.0", "60.0%", "256"] in cells  # own share


def test_grpo_part_prints_and_saves_each_worker_as_it_ends(monkeypatch, tmp_path, capsys):
    """A device call cut short between workers (its time limit kills the parent) still has every finished worker:
    a line printed as each ends (steps, medians after the warm-up, first step, start-up) and $OUT's JSON."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})

    class CallCut(BaseException):
        pass

    def run(cmd, capture_output, text, timeout):
        if cmd[cmd.index("--grpo-worker") + 1] == "bf16":
            raise CallCut  # the second worker never ends
        Path(cmd[cmd.index("--grpo-json") + 1]).write_text(json.dumps(
            {"step_s": [98.0, 4.0, 4.4, 4.2], "generate_s": [20.0, 3.0, 3.4, 3.2], "sync_s": [0.1] * 4,
             "startup_s": 91.5, "direct_sync": None}))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    with pytest.raises(CallCut):
        bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-warmup", "1"]))
    printed = capsys.readouterr().out
    assert "4 step(s); after the first 1: step 4.200 s, rollout 3.200 s" in printed
    assert "first step 98.000 s, start-up 91.500 s" in printed
    saved = json.loads((tmp_path / "bench_vllm.json").read_text())
    assert saved["grpo"]["workers"]["fp8"][0]["step_s"] == [98.0, 4.0, 4.4, 4.2]


def test_gc_clock_counts_the_collections_inside_its_block_only():
    import gc

    clock = bench_vllm.GcClock()
    with clock:
        gc.collect(0)
        gc.collect()  # generation 2
    assert clock.collections == [1, 0, 1] and clock.pause_ms > 0
    gc.collect()  # outside: neither counted nor timed
    assert clock.collections == [1, 0, 1] and clock._callback not in gc.callbacks
    with clock:  # entering again starts from zero
        pass
    assert clock.collections == [0, 0, 0] and clock.pause_ms == 0.0


def test_grpo_worker_summary_gives_the_rollouts_cpu_share_and_the_host_load():
    """The line each worker prints: the rollout's CPU time as a share of its wall (a host-bound decode on a shared
    machine drops here) and the load average, both medians after the warm-up; older worker files have neither."""
    run = {"step_s": [9.0, 3.0, 3.0, 3.2], "generate_s": [5.0, 1.0, 2.0, 1.0], "sync_s": [0.1] * 4,
           "rollout_cpu_s": [5.0, 0.9, 1.0, 0.8], "load1": [1.0, 2.0, 9.0, 3.0]}
    line = bench_vllm.worker_summary(run, warmup=1)
    # shares after the first step 0.9, 0.5, 0.8: median 80%; load median of 2, 9, 3
    assert "rollout CPU time 80% of its wall (spin-waits included), host load average 3.000" in line
    assert "stolen" not in line  # no steal readings (an older worker file)
    run["steal"] = [0.5, 0.01, None, 0.05]  # the warm-up's 50% left out, a rollout without a reading skipped
    assert "CPU stolen by the hypervisor 3.0% (max 5.0%)" in bench_vllm.worker_summary(run, warmup=1)
    run["deep_gemm_new"] = [40, 0, 0, 0]  # compiles in the warm-up only: nothing to say
    assert "DeepGEMM" not in bench_vllm.worker_summary(run, warmup=1)
    run["deep_gemm_new"] = [40, 2, None, 3]
    assert "DeepGEMM's JIT cache grew by 5 file(s) during 2 of the 2 timed rollouts" in \
        bench_vllm.worker_summary(run, warmup=1)
    assert "allocator" not in bench_vllm.worker_summary(run, warmup=1)  # an older worker file
    quiet = dict.fromkeys(bench_vllm.ALLOCATOR_EVENTS, 0)
    run["allocator"] = [{**quiet, "num_device_alloc": 90}, quiet, None, {**quiet, "num_device_alloc": 4,
                        "num_device_free": 2, "num_alloc_retries": 1, "num_sync_all_streams": 3}]
    assert ("CUDA allocator per rollout 2 cudaMalloc / 1 cudaFree, 0.5 retries, 1.5 device syncs (medians)"
            in bench_vllm.worker_summary(run, warmup=1))  # the warm-up's 90 left out, a rollout without CUDA skipped
    del run["rollout_cpu_s"], run["load1"], run["steal"], run["deep_gemm_new"]
    assert "CPU time" not in bench_vllm.worker_summary(run, warmup=1)


def test_allocator_events_read_the_caching_allocators_counters_and_their_growth():
    """The four counters from torch.cuda.memory_stats (0 where a torch build lacks one), their growth between two
    readings, and None without CUDA or without both readings."""
    stats = {"num_device_alloc": 7, "num_device_free": 3, "num_alloc_retries": 1, "allocated_bytes.all.current": 9}
    before = bench_vllm.allocator_events(stats)
    assert before == {"num_device_alloc": 7, "num_device_free": 3, "num_alloc_retries": 1, "num_sync_all_streams": 0}
    after = bench_vllm.allocator_events({**stats, "num_device_alloc": 10, "num_sync_all_streams": 2})
    assert bench_vllm.allocator_delta(before, after) == {"num_device_alloc": 3, "num_device_free": 0,
                                                         "num_alloc_retries": 0, "num_sync_all_streams": 2}
    assert bench_vllm.allocator_delta(None, after) is None and bench_vllm.allocator_delta(before, None) is None
    if not torch.cuda.is_available():
        assert bench_vllm.allocator_events() is None


def test_deep_gemm_cache_files_counts_the_jit_cache_vllm_points_deep_gemm_at(tmp_path):
    """DG_JIT_CACHE_DIR where set; else $VLLM_CACHE_ROOT/deep_gemm, else $XDG_CACHE_HOME/vllm/deep_gemm (else
    ~/.cache/vllm/deep_gemm: vllm.envs' rule); files in every subfolder; None without the folder."""
    cache = tmp_path / "vllm" / "deep_gemm"
    (cache / "kernel.a").mkdir(parents=True)
    (cache / "kernel.a" / "kernel.cubin").write_text("x")
    (cache / "kernel.a" / "kernel.cu").write_text("x")
    (cache / "tmp.txt").write_text("x")
    assert bench_vllm.deep_gemm_cache_files({"DG_JIT_CACHE_DIR": str(cache)}) == 3
    assert bench_vllm.deep_gemm_cache_files({"VLLM_CACHE_ROOT": str(tmp_path / "vllm")}) == 3
    assert bench_vllm.deep_gemm_cache_files({"XDG_CACHE_HOME": str(tmp_path)}) == 3
    assert bench_vllm.deep_gemm_cache_files({"DG_JIT_CACHE_DIR": str(tmp_path / "none")}) is None


def test_host_cpu_ticks_reads_the_steal_column_and_the_share_between_two_readings(tmp_path):
    """/proc/stat's first line: steal is its eighth number; the share is stolen ticks over all ticks between two
    readings; a file without the column, a missing file or a clock that did not move gives None."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert bench_vllm.host_cpu_ticks(str(stat)) == (40, 1000)
    stat.write_text("cpu  150 0 50 900 10 0 0 90 0 0\n")
    after = bench_vllm.host_cpu_ticks(str(stat))
    assert after == (90, 1200) and bench_vllm.steal_share((40, 1000), after) == 0.25
    assert bench_vllm.steal_share((40, 1000), (40, 1000)) is None and bench_vllm.steal_share(None, after) is None
    stat.write_text("cpu  1 2 3 4\n")
    assert bench_vllm.host_cpu_ticks(str(stat)) is None
    assert bench_vllm.host_cpu_ticks(str(tmp_path / "missing")) is None
    if Path("/proc/stat").exists():  # this machine's own reading
        stolen, total = bench_vllm.host_cpu_ticks()
        assert 0 <= stolen <= total


def test_engine_async_scheduling_reads_the_resolved_config_or_says_none():
    def llm(value):
        return types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(async_scheduling=value))))

    assert bench_vllm.engine_async_scheduling(llm(True)) is True
    assert bench_vllm.engine_async_scheduling(llm(False)) is False
    assert bench_vllm.engine_async_scheduling(llm(None)) is None  # not resolved: say nothing rather than guess
    assert bench_vllm.engine_async_scheduling(object()) is None  # an engine without a vllm_config


def _earlier_call(path, steps: dict[str, list[float]], device="NVIDIA H100 80GB HBM3", layers="8"):
    """A parent's bench_vllm.json as an earlier grpo call leaves it: its command line, workload, device and one run
    per arm."""
    grpo = {arm: {"runs": [{"step_s": s, "generate_s": [v / 2 for v in s], "sync_s": [0.01] * len(s),
                            "direct_sync": None}]} for arm, s in steps.items()}
    argv = ["--parts", "grpo", "--grpo-arms", ",".join(steps), "--grpo-layers", layers]
    workload = bench_vllm.grpo_workload(bench_vllm.parse_args(argv))
    path.write_text(json.dumps({"argv": argv, "env": {"device": device},
                                "grpo": {**grpo, "bf16_baseline": "bf16", "workload": workload}}))
    return str(path)


def test_grpo_earlier_pools_calls_into_rounds_and_refuses_other_work_or_devices(monkeypatch, tmp_path, capsys):
    """--grpo-earlier: the runs of earlier calls (each its parent's bench_vllm.json) pool with this call's per arm,
    round by round in the files' order; --grpo-rounds 0 summarizes the files alone without running a worker. A file
    of other work (an option of GRPO_WORKLOAD differs), of another device, or without grpo runs is refused by name."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    monkeypatch.setattr(bench_vllm.subprocess, "run", lambda *a, **k: pytest.fail("--grpo-rounds 0 ran a worker"))
    first = _earlier_call(tmp_path / "a.json", {"fp8": [9.0, 5.0, 1.0, 1.0], "bf16": [9.0, 5.0, 1.2, 1.2]})
    second = _earlier_call(tmp_path / "b.json", {"fp8": [9.0, 5.0, 2.0, 2.0], "bf16": [9.0, 5.0, 2.0, 2.0]})
    opts = bench_vllm.parse_args(["--parts", "grpo", "--grpo-rounds", "0", "--grpo-layers", "8",
                                  "--grpo-earlier", f"{first},{second}"])
    bench_vllm.part_grpo(opts)
    out = capsys.readouterr().out
    grpo = vllm_common.RESULTS["grpo"]
    assert "pooled with 2 earlier call(s): fp8 2 run(s), bf16 2 run(s)" in out
    assert grpo["fp8"]["timed_steps"] == 4 and grpo["fp8"]["step_median_s"] == pytest.approx(1.5)
    assert grpo["bf16_over_fp8_step_by_round"] == pytest.approx([1.2, 1.0])  # round i = file i
    # paired over the two rounds: geometric mean sqrt(1.2); t interval with 1 degree of freedom (12.706)
    paired = grpo["bf16_over_fp8_step_paired"]
    half = 12.706 * (math.log(1.2) / math.sqrt(2)) / math.sqrt(2)
    assert paired["rounds"] == 2 and paired["geomean"] == pytest.approx(math.sqrt(1.2))
    assert paired["low"] == pytest.approx(math.exp(math.log(1.2) / 2 - half))
    assert paired["high"] == pytest.approx(math.exp(math.log(1.2) / 2 + half))
    assert "step ratio bf16 / fp8 paired over 2 rounds: geometric mean 1.10x, 95% interval [0.34-3.49]x" in out
    assert grpo["bf16_over_fp8_rollout_by_round"] == pytest.approx([1.2, 1.0])  # rollouts = steps / 2 here
    # training part = step - rollout - sync = step / 2 - 0.01: round 1 (0.6 - 0.01) / (0.5 - 0.01)
    assert grpo["bf16_over_fp8_train_by_round"] == pytest.approx([0.59 / 0.49, 1.0])
    assert "training ratio bf16 / fp8 paired over 2 rounds" in out
    assert grpo["bf16_over_fp8_train_paired"]["geomean"] == pytest.approx(math.sqrt(0.59 / 0.49))
    assert grpo["earlier_calls"] == [first, second]
    # a call that pooled earlier ones saves only its own runs (none here), so a later call reads each run once
    assert grpo["fp8"]["runs"] == [] and grpo["bf16"]["runs"] == []
    third = tmp_path / "c_pooled.json"
    third.write_text(json.dumps({"argv": ["--parts", "grpo", "--grpo-layers", "8", "--grpo-earlier", "gone.json"],
                                 "env": {"device": "NVIDIA H100 80GB HBM3"}, "grpo": grpo}))
    opts.grpo_earlier = [first, str(third)]  # its own --grpo-earlier file need not exist any more
    assert [len(v) for v in bench_vllm.earlier_grpo_runs(opts, None).values()] == [1, 1]
    summary = json.loads((tmp_path / "bench_vllm.json").read_text())  # as this summary saved itself
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "argv": ["--parts", "grpo", "--grpo-layers", "8"],
                                                       "env": {"device": None}}))
    opts.grpo_earlier = [first, str(tmp_path / "summary.json")]  # ran nothing itself: adds nothing, refuses nothing
    assert [len(v) for v in bench_vllm.earlier_grpo_runs(opts, None).values()] == [1, 1]

    other_work = _earlier_call(tmp_path / "w.json", {"fp8": [1.0] * 4, "bf16": [1.0] * 4}, layers="16")
    other_device = _earlier_call(tmp_path / "d.json", {"fp8": [1.0] * 4, "bf16": [1.0] * 4}, device="NVIDIA H200")
    no_runs = tmp_path / "e.json"
    no_runs.write_text(json.dumps({"argv": ["--parts", "decode"], "decode": {}}))
    unsaved = tmp_path / "u.json"  # a workload saved without one of GRPO_WORKLOAD's options: not comparable
    saved = json.loads(Path(first).read_text())
    del saved["grpo"]["workload"]["grpo_capture_size"]
    unsaved.write_text(json.dumps(saved))
    for files, message in (([first, other_work], "--grpo-layers was 16, this call's is 8"),
                           ([first, other_device], "ran on 'NVIDIA H200', not 'NVIDIA H100 80GB HBM3'"),
                           ([str(no_runs)], "no grpo runs"),
                           ([str(unsaved)], "--grpo-capture-size was 'not saved', this call's is None")):
        opts.grpo_earlier = files
        with pytest.raises(ValueError, match=re.escape(message)):
            bench_vllm.earlier_grpo_runs(opts, None)
    with pytest.raises(SystemExit):  # nothing to run and nothing to summarize
        bench_vllm.parse_args(["--parts", "grpo", "--grpo-rounds", "0"])
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--parts", "grpo", "--grpo-earlier", str(tmp_path / "missing.json")])


def test_grpo_earlier_pairs_rounds_by_call_when_an_arm_missed_one(monkeypatch, tmp_path, capsys):
    """Three earlier calls, the second without its FP8 run: round ratios pair each FP8 run with the BF16 run of its own
    call (by position the third call's FP8 run would pair with the second call's BF16 run), and the round the FP8 arm
    missed reads "-"."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    files = [_earlier_call(tmp_path / "a.json", {"fp8": [9.0, 5.0, 1.0, 1.0], "bf16": [9.0, 5.0, 1.5, 1.5]}),
             _earlier_call(tmp_path / "b.json", {"bf16": [9.0, 5.0, 3.0, 3.0]}),
             _earlier_call(tmp_path / "c.json", {"fp8": [9.0, 5.0, 2.0, 2.0], "bf16": [9.0, 5.0, 2.2, 2.2]})]
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", "--grpo-rounds", "0", "--grpo-layers", "8",
                                                "--grpo-earlier", ",".join(files)]))
    grpo = vllm_common.RESULTS["grpo"]
    assert grpo["bf16_over_fp8_step_by_round"] == [pytest.approx(1.5), None, pytest.approx(1.1)]
    assert "step ratio bf16 / fp8 round by round: 1.50x, -, 1.10x" in capsys.readouterr().out
    untagged = [{"step_s": [1.0, 2.0]}, {"step_s": [1.0, 4.0]}]  # one call's runs: paired by position
    assert bench_vllm.round_ratios(untagged, [{"step_s": [1.0, 1.0]}] * 2, 1) == [2.0, 4.0]


def test_paired_ratio_interval_is_a_t_interval_on_the_log_ratios():
    """Three rounds whose log-ratios are 0.1, 0.2, 0.3 (mean 0.2, standard deviation 0.1): geometric mean e^0.2 and
    e^(0.2 -+ 4.303 * 0.1 / sqrt(3)); a missing round is left out, one round gives no interval, a ratio <= 0 is refused,
    and past 31 rounds the normal quantile is used."""
    import _common

    got = _common.paired_ratio_interval([math.exp(0.1), None, math.exp(0.2), math.exp(0.3)])
    half = 4.303 * 0.1 / math.sqrt(3)
    assert got["rounds"] == 3 and got["geomean"] == pytest.approx(math.exp(0.2))
    assert (got["low"], got["high"]) == (pytest.approx(math.exp(0.2 - half)), pytest.approx(math.exp(0.2 + half)))
    assert _common.paired_ratio_interval([1.3]) is None and _common.paired_ratio_interval([1.3, None]) is None
    same = _common.paired_ratio_interval([1.25, 1.25])
    assert same["low"] == pytest.approx(1.25) and same["high"] == pytest.approx(1.25)
    many = _common.paired_ratio_interval([math.exp(0.1), math.exp(0.3)] * 20)  # 40 rounds: 39 degrees of freedom
    sd = statistics.stdev([0.1, 0.3] * 20)
    assert many["high"] == pytest.approx(math.exp(0.2 + 1.96 * sd / math.sqrt(40)))
    with pytest.raises(ValueError, match="ratios must be > 0"):
        _common.paired_ratio_interval([1.1, 0.0])


def grpo_worker_commands(monkeypatch, tmp_path, argv: list[str]) -> list[list[str]]:
    """The worker command lines ``--parts grpo`` + ``argv`` starts (each worker made to fail at once)."""
    commands = []

    def run(cmd, capture_output, text, timeout):
        commands.append(cmd)
        return types.SimpleNamespace(returncode=1, stdout="", stderr="stop")

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(vllm_common, "RESULTS", {})
    monkeypatch.setattr(bench_vllm.subprocess, "run", run)
    bench_vllm.part_grpo(bench_vllm.parse_args(["--parts", "grpo", *argv]))
    return commands


def test_the_entry_point_runs_the_parts_from_their_modules_and_workers_rerun_it(monkeypatch, tmp_path):
    """bench_vllm.py keeps the command line and the child processes; each part lives in its own module (vllm_mismatch:
    ops and mismatch, vllm_decode, vllm_grpo; vllm_common: what they share). A grpo worker and a part's child process
    re-invoke bench_vllm.py itself, and the grpo part's --grpo-earlier reads the files with the entry point's parser
    when bench_vllm.py runs as a script: a summary of two earlier calls, through a child process."""
    import os
    import subprocess

    import vllm_mismatch

    assert bench_vllm.part_ops is vllm_mismatch.part_ops and bench_vllm.part_mismatch is vllm_mismatch.part_mismatch
    assert bench_vllm.part_decode is vllm_decode.part_decode and bench_vllm.part_grpo is vllm_grpo.part_grpo
    commands = grpo_worker_commands(monkeypatch, tmp_path, ["--grpo-arms", "bf16"])
    assert [cmd[1] for cmd in commands] == [str(ROOT / "benchmarks" / "bench_vllm.py")]
    monkeypatch.undo()

    first = _earlier_call(tmp_path / "a.json", {"fp8": [9.0, 5.0, 1.0, 1.0], "bf16": [9.0, 5.0, 1.2, 1.2]})
    second = _earlier_call(tmp_path / "b.json", {"fp8": [9.0, 5.0, 2.0, 2.0], "bf16": [9.0, 5.0, 2.0, 2.0]})
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "--parts", "grpo",
                           "--grpo-rounds", "0", "--grpo-layers", "8", "--grpo-earlier", f"{first},{second}"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OUT": str(out)},
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pooled with 2 earlier call(s): fp8 2 run(s), bf16 2 run(s)" in proc.stdout, proc.stdout
    assert "== grpo: " in proc.stdout  # the part ran in a child process, as every part does without --in-process
    grpo = json.loads((out / "bench_vllm.json").read_text())["grpo"]
    assert grpo["bf16_over_fp8_step_by_round"] == pytest.approx([1.2, 1.0])
