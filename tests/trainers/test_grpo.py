"""Short offline runs of CalibratedGRPOTrainer on a tiny Llama: every clip mode, with and without FP8 and TIS.

Each run is one generation round of 16 completions split into 4 mini-batches over 2 optimizer steps, so the second
optimizer step sees a moved policy and calibrates.
"""

import copy
import math
import warnings

import pytest
import torch

from calclip.fp8 import FP8BlockLinear
from calclip.trainers.config import CalibratedGRPOConfig
from calclip.trainers.grpo import BF16_OLD_LOGPS_KEY
from tests.fixtures import (
    build_tiny_model,
    build_tiny_tokenizer,
    logged,
    tiny_prompt_dataset,
    tiny_trainer,
    tiny_training_args,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def make_trainer(tokenizer, tmp_path, hidden_size=128, **overrides):
    model = build_tiny_model(tokenizer, hidden_size=hidden_size, intermediate_size=2 * hidden_size)
    return tiny_trainer(tmp_path, tokenizer=tokenizer, model=model, **overrides)


RUNS = {
    "static_fp8": dict(clip_mode="static", fp8=True),
    "clip_higher_bf16_token_mask": dict(clip_mode="clip_higher", fp8=False, tis_mode="token_mask"),
    "dual_clip_fp8_token_truncate": dict(clip_mode="dual_clip", fp8=True, tis_mode="token_truncate", tis_cap=1.5),
    "calibrated_fp8_sequence_truncate": dict(clip_mode="calibrated", fp8=True, tis_mode="sequence_truncate"),
    "calibrated_bf16_every_step_quantile": dict(
        clip_mode="calibrated", fp8=False, calibration_schedule="every_step", calibration_upper="quantile",
        # two rounds of two steps; interval 4: round 1 calibrates, round 2 (steps 2-3) refits on its FP8 ratios
        max_steps=4, calibration_interval=4, loss_type="grpo",
    ),
    # hidden 192, intermediate 384: ragged 128-blocks in every FP8 GEMM
    "calibrated_fp8_ragged_blocks_fp8_backward_bf16": dict(clip_mode="calibrated", fp8=True, hidden_size=192,
                                                          fp8_backward="bf16", tis_mode="token_mask"),
    "calibrated_fp8_bypass_ema": dict(clip_mode="calibrated", fp8=True, old_logps_source="rollout",
                                      calibration_ema=0.5, loss_type="bnpo"),
    "oracle_fp8": dict(clip_mode="oracle", fp8=True),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_short_run(tokenizer, tmp_path, name):
    overrides = RUNS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(tokenizer, tmp_path, **overrides)
        assert any(isinstance(m, FP8BlockLinear) for m in trainer.model.modules()) == overrides["fp8"]
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()

    # parameters changed, FP8 layers included
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "lm_head.weight" in changed

    # every logged metric is finite
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)

    # bounds in force stay within the rails; static modes keep their configured bounds
    lows, highs = logged(trainer, "calib/low"), logged(trainer, "calib/high")
    assert len(lows) == trainer.args.max_steps
    args = trainer.args
    if args.clip_mode == "calibrated":
        (low_min, low_max), (high_min, high_max) = args.calibration_low_rails, args.calibration_high_rails
        # the default rails: never tighter than the static bounds
        assert low_max == 1 - args.epsilon and high_min == 1 + args.clip_epsilon_high
        assert all(low_min <= v <= low_max for v in lows)
        assert all(high_min <= v <= high_max for v in highs)
        assert trainer.calibrator.calibrated  # the moved mini-batches calibrated
        # The fit commits after a round's last micro-batch: no mini-batch trains with bounds fitted on its own
        # tokens. A one-round run trains every step with the initial bounds; the fit is in force after it.
        assert logged(trainer, "calib/fit")[0] == 1.0
        if args.max_steps * args.gradient_accumulation_steps == args.steps_per_generation:
            assert (lows[-1], highs[-1]) == pytest.approx(args.calibration_init_bounds)
        assert (lows[0], highs[0]) == pytest.approx(args.calibration_init_bounds)  # step 1 is on-policy
        assert trainer.calibrator.bounds != tuple(args.calibration_init_bounds)
    else:
        assert lows == pytest.approx([1 - args.epsilon] * len(lows))
        assert highs == pytest.approx([1 + args.clip_epsilon_high] * len(highs))
    if args.calibration_schedule == "every_step":
        assert trainer.calibrator.state_dict()["num_refits"] >= 1

    # monitoring: FP8 runs compare against the BF16 shadow on calibration steps
    if args.fp8:
        assert len(logged(trainer, "clip/neg_low_frac_bf16")) >= 1
        static_fp8 = logged(trainer, "clip/neg_low_frac_fp8_static")
        assert static_fp8 and all(0.0 <= v <= 1.0 for v in static_fp8)
        assert logged(trainer, "mismatch/fp8_bf16_token_mult_prob_error")[0] > 1.0  # FP8 noise is visible
    per_step = ("entropy", "entropy/neg_adv", "entropy/spike", "clip/neg_low_frac_fp8", "completions/repeat_ngram_frac")
    for key in per_step:
        assert logged(trainer, key), key
    if args.tis_mode != "none":
        weights = logged(trainer, "tis/weight_mean")
        assert weights and all(0.0 <= w <= args.tis_cap for w in weights)
    if args.old_logps_source == "trainer":
        assert all(v >= 1.0 for v in logged(trainer, "mismatch/token_mult_prob_error"))

    # out-of-sample scores of the bounds in force, on the moved mini-batches (step 2 on)
    neg, drops = logged(trainer, "oos/neg_tokens"), logged(trainer, "oos/fp8_drops")
    assert neg and all(n > 0 for n in neg) and all(0 <= d <= n for d, n in zip(drops, neg))
    if args.fp8 or args.clip_mode == "calibrated":
        assert logged(trainer, "oos/shadow_neg_tokens")
    if args.clip_mode == "oracle":  # it drops exactly what the BF16 shadow drops
        assert logged(trainer, "oos/shadow_fp8_drops") == logged(trainer, "oos/shadow_bf16_drops")
        assert all(v == 1.0 for v in logged(trainer, "oos/drop_recall") + logged(trainer, "oos/drop_precision"))


@pytest.mark.slow
def test_on_policy_config_never_calibrates(tokenizer, tmp_path):
    with pytest.warns(UserWarning, match="on-policy"):
        trainer = make_trainer(tokenizer, tmp_path, clip_mode="calibrated", fp8=False, steps_per_generation=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert not trainer.calibrator.calibrated
    assert trainer.calibrator.bounds == tuple(trainer.args.calibration_init_bounds)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("steps_per_generation", "accumulation", "expected_moved"),
    [
        # round 1: micro-batches 0,1 (step 0) 2 (step 1); round 2, generated at step 1: 3 (step 1) 4,5 (step 2)
        (3, 2, [False, False, True, False, True, True]),
        # rounds of 2 inside windows of 3: micro-batch 3 is the first of step 1 in a round generated at step 0
        (2, 3, [False, False, False, True, False, False]),
    ],
)
def test_misaligned_rounds_calibrate_exactly_the_moved_micro_batches(
    tokenizer, tmp_path, steps_per_generation, accumulation, expected_moved
):
    """Generation rounds that straddle optimizer steps: a micro-batch counts as moved exactly when an optimizer step
    ran since its generation batch was produced, i.e. exactly when its ratio is not 1."""
    with warnings.catch_warnings():
        # no false "on-policy" warning for these configs (fp8=False warns, rightly, that calibration is static here)
        warnings.filterwarnings("error", message=".*on-policy", category=UserWarning)
        args = tiny_training_args(
            CalibratedGRPOConfig, tmp_path, clip_mode="calibrated", fp8=False, max_steps=2 if accumulation == 3 else 3,
            steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation,
        )  # fmt: skip
    assert args.calibration_is_meaningful
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, tokenizer=tokenizer, args=args)
    seen = []
    calibrate = trainer._calibrate

    def recording_calibrate(inputs, logps, old_logps, advantages, mask):
        keep = mask.bool()
        seen.append((trainer._policy_moved(inputs), (logps.detach() - old_logps)[keep].abs().max().item()))
        return calibrate(inputs, logps, old_logps, advantages, mask)

    trainer._calibrate = recording_calibrate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert [moved for moved, _ in seen] == expected_moved
    assert all((gap > 1e-4) == moved for moved, gap in seen)  # moved exactly where the ratio is not 1
    assert trainer.calibrator.calibrated


def _generation_batch(trainer, tokenizer):
    trainer.model.train()
    inputs = [row for row in tiny_prompt_dataset(2) for _ in range(trainer.num_generations)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer._generate_and_score_completions(copy.deepcopy(inputs))


def _trainer_logps(trainer, batch):
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
            batch["completion_ids"].size(1),
        )
    return logps


@pytest.mark.slow
def test_rollout_logprobs_on_the_generate_path_are_the_sampling_distribution(tokenizer, tmp_path):
    """Without top-k/top-p the processed scores are logits / temperature: the rollout log-probs equal the trainer's
    log-probs of the same tokens (up to KV-cache numerics). With top-k the sampling distribution is renormalized
    over k tokens, so every rollout log-prob is at least the trainer's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(tokenizer, tmp_path, clip_mode="static", fp8=False, temperature=0.7)
    batch = _generation_batch(trainer, tokenizer)
    mask = batch["completion_mask"].bool()
    rollout = batch["sampling_per_token_logps"]
    assert rollout.shape == mask.shape and torch.isfinite(rollout[mask]).all()
    torch.testing.assert_close(rollout[mask], _trainer_logps(trainer, batch)[mask], rtol=0, atol=1e-4)

    trainer.generation_config.top_k = 5
    batch = _generation_batch(trainer, tokenizer)
    mask = batch["completion_mask"].bool()
    gap = batch["sampling_per_token_logps"][mask] - _trainer_logps(trainer, batch)[mask]
    assert (gap > -1e-4).all() and (gap > 1e-2).any()
    assert "generate" not in vars(trainer.model)  # the generate wrapper was removed


@pytest.mark.slow
def test_shadow_old_logps_are_computed_only_when_a_calibration_is_due(tokenizer, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(tokenizer, tmp_path, clip_mode="calibrated", fp8=True, calibration_interval=10)
    batch = _generation_batch(trainer, tokenizer)  # step 0: the first calibration is due
    assert BF16_OLD_LOGPS_KEY in batch
    shadow_old, fp8_old = batch[BF16_OLD_LOGPS_KEY], batch["old_per_token_logps"]
    mask = batch["completion_mask"].bool()
    assert 0 < (shadow_old - fp8_old)[mask].abs().max() < 1.0  # FP8 noise, not another model

    # one A>0 and one A<0 token: enough for a fit with the tiny runs' calibration_min_tokens of 1
    trainer.calibrator.calibrate(torch.ones(1, 2), torch.ones(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    trainer.state.global_step = 3  # calibrated at 0; next due at step 10, beyond this round's steps 3 and 4
    assert BF16_OLD_LOGPS_KEY not in _generation_batch(trainer, tokenizer)
    trainer.calibrator.request_recalibration()
    assert BF16_OLD_LOGPS_KEY in _generation_batch(trainer, tokenizer)


def test_entropy_spike_warns_logs_and_requests_recalibration(tokenizer, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(tokenizer, tmp_path, clip_mode="calibrated", fp8=False, entropy_spike_warmup=3)
    # one A>0 and one A<0 token: enough for a fit with the tiny runs' calibration_min_tokens of 1
    trainer.calibrator.calibrate(torch.ones(1, 2), torch.ones(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    for value in (3.0, 3.01, 2.99, 3.0):
        trainer._step_entropies = [(value, value)]
        trainer._end_of_step_monitoring()
    assert trainer._metrics["train"]["entropy/spike"] == [0.0] * 4
    assert not trainer.calibrator.needs_calibration(1)
    trainer._step_entropies = [(3.0, 3.0), (5.0, 5.0)]  # the step mean, 4.0, is far above the history
    with pytest.warns(RuntimeWarning, match="entropy spike"):
        trainer._end_of_step_monitoring()
    assert trainer._metrics["train"]["entropy/spike"][-1] == 1.0
    assert trainer.calibrator.needs_calibration(1)  # recalibration requested
    assert trainer.spike_detector.num_spikes == 1


def test_plain_grpo_config_is_rejected(tokenizer, tmp_path):
    from trl import GRPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = tiny_training_args(GRPOConfig, tmp_path)
    with pytest.raises(TypeError, match="CalibratedGRPOConfig"):
        tiny_trainer(tmp_path, tokenizer=tokenizer, args=args, num_prompts=4)


@pytest.mark.slow
def test_compile_generation_undoes_trls_disable_compile(tokenizer, tmp_path):
    """TRL builds GenerationConfig(disable_compile=True); compile_generation lets transformers compile the decode
    step (it does so on CUDA with a static cache), and the default keeps TRL's behaviour."""
    stock = make_trainer(tokenizer, tmp_path / "stock")
    assert stock.generation_config.disable_compile is True
    trainer = make_trainer(tokenizer, tmp_path / "compiled", fp8=True, compile_generation=True)
    assert trainer.generation_config.disable_compile is False
    assert trainer.generation_config.cache_implementation == "static"
    assert trainer.generation_kwargs["cache_implementation"] == "static"
    kept = make_trainer(tokenizer, tmp_path / "kept", compile_generation=True, cache_implementation="dynamic")
    assert kept.generation_config.cache_implementation == "dynamic"
    trainer.train()  # on CPU transformers does not compile; the run must still work with a static cache
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))
    with pytest.raises(ValueError, match="compile_generation"):
        tiny_training_args(CalibratedGRPOConfig, tmp_path / "bad", compile_generation="yes")


@pytest.mark.slow
def test_compile_generation_refuses_what_fails_on_cuda_and_runs_on_cpu(tokenizer, tmp_path):
    """fp32 master weights under bf16/fp16 autocast: CUDA-graphed decode failed on the H200 (static cache dtype),
    so that is refused on CUDA naming the fields; matching dtypes, no autocast, or CPU pass."""
    from calclip.trainers.grpo import compiled_generation_problem

    problem = compiled_generation_problem("cuda", torch.float32, True, False)
    assert "model_dtype: bfloat16" in problem and "compile_generation: false" in problem
    assert "model_dtype: float16" in compiled_generation_problem("cuda", torch.float32, False, True)
    assert "bfloat16 master weights under fp16" in compiled_generation_problem("cuda", torch.bfloat16, False, True)
    for ok in (("cuda", torch.bfloat16, True, False), ("cuda", torch.float32, False, False),
               ("cpu", torch.float32, True, False)):
        assert compiled_generation_problem(*ok) is None, ok
    # on CPU the fp32 + bf16-autocast combination trains with the static cache
    trainer = make_trainer(tokenizer, tmp_path, fp8=True, compile_generation=True, bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.model.dtype == torch.float32
    trainer.train()
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))


def test_fp8_decode_fused_max_m_reaches_every_fp8_layer(tokenizer, tmp_path):
    """The trainer field becomes Fp8Config.decode_fused_max_m of the policy's FP8 layers; automatic (None) by
    default, 0 turns it off."""
    layers = [m for m in make_trainer(tokenizer, tmp_path / "default").model.modules() if isinstance(m, FP8BlockLinear)]
    assert layers and all(m.fp8_config.decode_fused_max_m is None for m in layers)
    for value in (64, 0):
        trainer = make_trainer(tokenizer, tmp_path / f"set{value}", fp8_decode_fused_max_m=value)
        layers = [m for m in trainer.model.modules() if isinstance(m, FP8BlockLinear)]
        assert layers and all(m.fp8_config.decode_fused_max_m == value for m in layers)


def test_fp8_decode_group_siblings_groups_the_policys_q_k_v_and_gate_up(tokenizer, tmp_path):
    """The trainer field becomes Fp8Config.decode_group_siblings: every decoder layer's q/k/v and gate/up form
    sibling groups (calclip.fp8.siblings); off by default."""
    default = [m for m in make_trainer(tokenizer, tmp_path / "default").model.modules()
               if isinstance(m, FP8BlockLinear)]
    assert default and all(m._fp8_group is None for m in default)
    model = make_trainer(tokenizer, tmp_path / "on", fp8_decode_group_siblings=True).model
    groups = {id(m._fp8_group): m._fp8_group for m in model.modules() if isinstance(m, FP8BlockLinear)
              if m._fp8_group is not None}
    layers = model.config.num_hidden_layers
    assert sorted(len(g.members) for g in groups.values()) == [2] * layers + [3] * layers


def test_fp8_share_sibling_inputs_is_on_by_default_and_can_be_turned_off(tokenizer, tmp_path):
    """The trainer field becomes Fp8Config.share_sibling_inputs: on by default, every decoder layer's q/k/v and
    gate/up quantize their input once (calclip.fp8.shared_input); false leaves every linear on its own."""
    model = make_trainer(tokenizer, tmp_path / "default").model
    layers = [m for m in model.modules() if isinstance(m, FP8BlockLinear)]
    groups = {id(m._fp8_share): m._fp8_share for m in layers if m._fp8_share is not None}
    n = model.config.num_hidden_layers
    assert sorted(len(g.members) for g in groups.values()) == [2] * n + [3] * n
    off = make_trainer(tokenizer, tmp_path / "off", fp8_share_sibling_inputs=False).model
    assert all(m._fp8_share is None and not m.fp8_config.share_sibling_inputs for m in off.modules()
               if isinstance(m, FP8BlockLinear))


@pytest.mark.slow
def test_torch_compile_trains_the_fp8_policy_as_eager_does(tokenizer, tmp_path):
    """TRL's ``torch_compile`` switch on an FP8 policy (backend aot_eager on CPU: calclip's custom ops and their
    fake implementations, as Inductor sees them on the GPU): the model really runs compiled, and every loss and
    calibrated bound equals the eager run's, bit for bit."""
    from torch._dynamo.utils import counters

    def run(name, **compile_args):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = make_trainer(tokenizer, tmp_path / name, clip_mode="calibrated", fp8=True, seed=0,
                                   **compile_args)
            trainer.train()
        return trainer, [(e["loss"], e["calib/low"], e["calib/high"]) for e in trainer.state.log_history if "loss" in e]

    _, eager = run("eager")
    torch._dynamo.reset()
    counters.clear()
    compiled, logs = run("compiled", torch_compile=True, torch_compile_backend="aot_eager")
    torch._dynamo.reset()
    assert type(compiled.model_wrapped).__name__ == "OptimizedModule"
    assert counters["stats"]["unique_graphs"] >= 1  # the policy's forward ran as a compiled graph
    assert len(logs) == compiled.args.max_steps == 2
    assert logs == eager


def test_a_calibrated_run_whose_rounds_stay_below_the_minimum_says_so(tokenizer, tmp_path):
    """Three rounds (steps_per_generation 2 > gradient_accumulation 1: the second mini-batch of each is moved) whose
    pools stay far below calibration_min_tokens: the bounds stay initial, calib/short_rounds counts 1, 2, 3 at the
    round ends with the pool's A<0 tokens in calib/pool_tokens, and the third round end warns once, naming the
    minimum and the settings that fill a round."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tokenizer, tmp_path, clip_mode="calibrated", fp8=True, max_steps=6,
                               gradient_accumulation_steps=1, steps_per_generation=2, calibration_min_tokens=100_000)
        trainer.train()
    assert not trainer.calibrator.calibrated
    assert logged(trainer, "calib/fit") == [0.0, 0.0, 0.0]
    assert logged(trainer, "calib/short_rounds") == [1.0, 2.0, 3.0]
    pool = logged(trainer, "calib/pool_tokens")
    assert pool == logged(trainer, "calib/pool_neg_tokens") and 0 < pool[0] < pool[1] < pool[2]
    starved = [str(w.message) for w in caught if "rounds in a row without a fit" in str(w.message)]
    assert len(starved) == 1
    assert f"{int(pool[2])} A<0" in starved[0] and "calibration_min_tokens 100000" in starved[0]
    assert "per_device_train_batch_size" in starved[0]


def test_a_static_run_logs_no_starvation(tokenizer, tmp_path):
    """Static bounds never apply a fit: a short shadow pool there is not a problem to report."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tokenizer, tmp_path, clip_mode="static", fp8=True, max_steps=6,
                               gradient_accumulation_steps=1, steps_per_generation=2, calibration_min_tokens=100_000)
        trainer.train()
    assert logged(trainer, "calib/short_rounds") == []
    assert not any("rounds in a row without a fit" in str(w.message) for w in caught)


@pytest.mark.slow
def test_per_call_weight_codes_train_as_resident_codes_do(tokenizer, tmp_path):
    """``fp8_resident_weight_codes: false``: a calibrated FP8 run (rollouts in frozen_fp8_weights, old log-probs,
    training steps) logs every loss and calibrated bound of the default run bit for bit, and no FP8 layer holds
    weight codes once training ends; the field reaches every layer."""
    def run(name, **fields):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = make_trainer(tokenizer, tmp_path / name, clip_mode="calibrated", fp8=True, seed=0, **fields)
            trainer.train()
        logs = [(e["loss"], e["calib/low"], e["calib/high"]) for e in trainer.state.log_history if "loss" in e]
        return trainer, logs

    resident, resident_logs = run("resident")
    per_call, per_call_logs = run("per_call", fp8_resident_weight_codes=False)
    assert per_call_logs and per_call_logs == resident_logs
    layers = [m for m in per_call.model.modules() if isinstance(m, FP8BlockLinear)]
    assert layers and all(not m.fp8_config.resident_weight_codes and m._fp8_qw is None and m._fp8_qwt is None
                          for m in layers)
    assert all(m._fp8_qw is not None for m in resident.model.modules() if isinstance(m, FP8BlockLinear))
