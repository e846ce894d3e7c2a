"""CalibratedGRPOConfig / CalibratedDAPOConfig: defaults, validation naming the field, YAML + CLI parsing."""

import warnings

import pytest
from trl import TrlParser

from calclip.losses.registry import clip_mode_names
from calclip.trainers.config import CalibratedDAPOConfig, CalibratedGRPOConfig

CPU = dict(report_to="none", use_cpu=True, bf16=False, num_generations=2, per_device_train_batch_size=2)


def make(cls=CalibratedGRPOConfig, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(output_dir="unused", **{**CPU, **overrides})


def test_defaults_are_the_documented_ones():
    config = make(steps_per_generation=4)
    assert config.clip_mode == "calibrated" and config.fp8 is True
    assert config.calibration_schedule == "interval" and config.calibration_interval == 20
    assert config.calibration_init_bounds == [0.6, 1.8]
    assert config.tis_mode == "none" and config.tis_cap == 2.0 and config.old_logps_source == "trainer"
    assert config.fp8_keep_patterns == ["lm_head"]
    assert config.clip_epsilon_high == config.epsilon == 0.2  # TRL's rule: epsilon_high defaults to epsilon
    assert config.calibration_is_meaningful  # 4 mini-batches per generation, 1 per optimizer step


def test_every_grpo_field_keeps_working():
    config = make(loss_type="bnpo", beta=0.04, num_iterations=2, epsilon=0.1, epsilon_high=0.3, temperature=0.7)
    assert (config.loss_type, config.beta, config.num_iterations) == ("bnpo", 0.04, 2)
    assert config.clip_epsilon_high == 0.3 and config.temperature == 0.7


def test_clip_modes_are_the_registry_keys():
    for mode in clip_mode_names():
        assert make(clip_mode=mode, steps_per_generation=2).clip_mode == mode


def test_clip_higher_defaults_epsilon_high_to_dapo_value():
    assert make(clip_mode="clip_higher").epsilon_high == pytest.approx(0.28)
    assert make(clip_mode="clip_higher", epsilon_high=0.4).epsilon_high == pytest.approx(0.4)


def test_dapo_preset():
    config = make(CalibratedDAPOConfig, steps_per_generation=2, max_completion_length=128)
    assert (config.epsilon, config.epsilon_high, config.loss_type) == (0.2, 0.28, "dapo")
    assert config.mask_truncated_completions and config.dynamic_sampling
    assert config.dynamic_sampling_max_rounds >= 1 and 0 < config.overlong_buffer_length < 128


BAD = [
    (dict(clip_mode="calibrate"), "clip_mode"),
    (dict(dual_clip_c=1.0), "dual_clip_c"),
    (dict(calibration_schedule="sometimes"), "calibration_schedule"),
    (dict(calibration_interval=0), "calibration_interval"),
    (dict(calibration_ema=1.0), "calibration_ema"),
    (dict(calibration_upper="max"), "calibration_upper"),
    (dict(calibration_init_bounds=[1.2, 1.8]), "calibration_init_bounds"),
    (dict(calibration_init_bounds=[0.6]), "calibration_init_bounds"),
    (dict(calibration_init_bounds=[0.1, 1.8]), "calibration_init_bounds"),  # below calibration_low_min
    (dict(calibration_low_min=0.9, calibration_low_max=0.8), "calibration_low_min"),
    (dict(calibration_high_max=0.9), "calibration_high_min"),
    (dict(tis_mode="truncate"), "tis_mode"),
    (dict(tis_cap=0.0), "tis_cap"),
    (dict(tis_lower_cap=3.0), "tis_lower_cap"),
    (dict(tis_mode="token_truncate", old_logps_source="rollout"), "tis_mode"),
    (dict(old_logps_source="vllm"), "old_logps_source"),
    (dict(tis_mode="token_mask", use_transformers_continuous_batching=True), "tis_mode"),
    (dict(fp8_backward="fp16"), "fp8_backward"),
    (dict(fp8_gemm="cublas"), "fp8_gemm"),
    (dict(fp8_keep_first_n_layers=-1), "fp8_keep_first_n_layers"),
    (dict(fp8_decode_fused_max_m=-1), "fp8_decode_fused_max_m"),
    (dict(fp8_decode_fused_max_m=8.0), "fp8_decode_fused_max_m"),
    (dict(fp8_decode_fused_max_m=8, fp8_gemm="emulated"), "fp8_decode_fused_max_m"),
    (dict(fp8_keep_patterns="lm_head"), "fp8_keep_patterns"),
    (dict(fp8_keep_patterns=["lm_head", "layers.(0"]), "fp8_keep_patterns: invalid regex"),
    (dict(entropy_spike_window=1), "entropy_spike_window"),
    (dict(entropy_spike_z=0.0), "entropy_spike_z"),
    (dict(repeat_ngram_size=0), "repeat_ngram_size"),
    (dict(loss_type="cispo"), "loss_type"),
    (dict(top_entropy_quantile=0.2), "top_entropy_quantile"),
    (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
    (dict(delta=2.0), "delta"),
    (dict(clip_mode="clip_higher", epsilon_high=0.1), "epsilon_high"),
    # bounds calibrated on token ratios must not clip sequence (GSPO) ratios
    (dict(clip_mode="calibrated", importance_sampling_level="sequence"), "importance_sampling_level"),
    # bypass with vLLM: TRL's own correction would weight the loss by pi_old/pi_rollout a second time
    (dict(old_logps_source="rollout", use_vllm=True), "vllm_importance_sampling_correction"),
    # colocated vLLM with its Transformers backend patches the policy's own model class (H200, vLLM 0.24.0)
    (dict(use_vllm=True, vllm_mode="colocate", vllm_model_impl="transformers"), "vllm_model_impl"),
]


@pytest.mark.parametrize("overrides,field_name", BAD, ids=[f"{name}-{i}" for i, (_, name) in enumerate(BAD)])
def test_bad_config_fails_naming_the_field(overrides, field_name):
    with pytest.raises(ValueError, match=field_name):
        make(**overrides)


@pytest.mark.parametrize(
    "overrides,field_name",
    [(dict(dynamic_sampling_max_rounds=0), "dynamic_sampling_max_rounds"),
     (dict(overlong_buffer_length=256), "overlong_buffer_length"),
     (dict(overlong_penalty_factor=-1.0), "overlong_penalty_factor")],
)  # fmt: skip
def test_bad_dapo_config_fails_naming_the_field(overrides, field_name):
    with pytest.raises(ValueError, match=field_name):
        make(CalibratedDAPOConfig, max_completion_length=256, **overrides)


def test_warns_when_calibration_is_meaningless():
    on_policy = dict(output_dir="unused", **CPU)  # steps_per_generation defaults to gradient_accumulation_steps
    with pytest.warns(UserWarning, match="on-policy"):
        CalibratedGRPOConfig(**on_policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        CalibratedGRPOConfig(**on_policy, num_iterations=2)  # moved policy: no warning
        # bypass with vLLM: the engine's log-probs differ from the trainer's: no warning
        CalibratedGRPOConfig(**on_policy, old_logps_source="rollout", use_vllm=True,
                             vllm_importance_sampling_correction=False)  # fmt: skip
        CalibratedGRPOConfig(**on_policy, clip_mode="static")  # no calibration: no warning


def test_yaml_and_cli_overrides_parse_into_the_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "output_dir: out\nreport_to: none\nuse_cpu: true\nbf16: false\nnum_generations: 2\n"
        "per_device_train_batch_size: 2\nsteps_per_generation: 4\nclip_mode: dual_clip\ndual_clip_c: 2.5\n"
        "calibration_init_bounds: [0.5, 2.0]\nfp8_keep_patterns: [lm_head, 'layers\\.0\\.']\ntis_mode: token_mask\n"
    )
    parser = TrlParser((CalibratedGRPOConfig,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (config,) = parser.parse_args_and_config(
            args=["--config", str(path), "--calibration_interval", "5", "--fp8", "false"]
        )
    assert isinstance(config, CalibratedGRPOConfig)
    assert (config.clip_mode, config.dual_clip_c, config.tis_mode) == ("dual_clip", 2.5, "token_mask")
    assert config.calibration_init_bounds == [0.5, 2.0]
    assert config.fp8_keep_patterns == ["lm_head", "layers\\.0\\."]
    assert config.calibration_interval == 5 and config.fp8 is False


@pytest.mark.parametrize("accumulation", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("steps_per_generation", [1, 2, 3, 4])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_calibration_is_meaningful_exactly_when_trl_computes_old_logps(accumulation, steps_per_generation,
                                                                       num_iterations):  # fmt: skip
    """TRL 1.16 computes old log-probs (the policy moves inside a generation round) exactly when
    gradient_accumulation_steps is not a multiple of steps_per_generation * num_iterations: e.g. GA=3 with
    steps_per_generation=2 moves mid-round, GA=2 with num_iterations=2 and steps_per_generation=1 does not."""
    config = make(gradient_accumulation_steps=accumulation, steps_per_generation=steps_per_generation,
                  num_iterations=num_iterations, per_device_train_batch_size=2)  # fmt: skip
    moves_mid_round = accumulation % (steps_per_generation * num_iterations) != 0
    assert config.calibration_is_meaningful == moves_mid_round
    assert make(gradient_accumulation_steps=accumulation, steps_per_generation=steps_per_generation,
                num_iterations=num_iterations, old_logps_source="rollout").calibration_is_meaningful == moves_mid_round


def test_fp8_option_combinations_are_refused_exactly_where_fp8config_refuses_them():
    """One source of truth: every combination of the FP8 options the trainer exposes is accepted by the trainer
    config iff Fp8Config accepts it (the trainer applies Fp8Config's own rules), and a refusal names the trainer's
    fp8_* fields, not Fp8Config's."""
    import itertools

    from calclip.fp8.config import Fp8Config

    grid = itertools.product(("blockwise", "rowwise"), ("fp8", "bf16"), ("auto", "triton", "emulated"), (None, 0, 8),
                             (False, True))
    refused = 0
    for recipe, backward, gemm, max_m, siblings in grid:
        options = dict(recipe=recipe, backward=backward, gemm=gemm, decode_fused_max_m=max_m,
                       decode_group_siblings=siblings)
        try:
            Fp8Config(**options)
            library_error = None
        except ValueError as error:
            library_error = str(error)
        fields = {f"fp8_{name}": value for name, value in options.items()}
        if library_error is None:
            assert make(**fields).fp8_recipe == recipe
            continue
        refused += 1
        with pytest.raises(ValueError) as trainer_error:
            make(**fields)
        message = str(trainer_error.value)
        assert "Fp8Config." not in message and "fp8_" in message, message
        # the same rule: the library's message with its option names spelled as trainer fields
        for name in options:
            library_error = library_error.replace(f"Fp8Config.{name}", f"fp8_{name}")
        assert message.split(";")[0] == _as_trainer_fields(library_error.split(";")[0]), (options, message)
        make(fp8=False, **fields)  # FP8 off: the options are not used, nothing to refuse
    assert refused >= 20  # the grid exercises every cross-field rule several times


def _as_trainer_fields(text):
    import re

    names = ("backward", "gemm", "decode_fused_max_m", "decode_group_siblings", "recipe", "block_size")
    return re.sub(rf"(?<![\w.])({'|'.join(names)})(?==)", r"fp8_\1", text)


def test_vllm_transformers_backend_is_refused_only_where_it_shares_the_policys_process():
    with pytest.raises(ValueError, match=r"vllm_model_impl='transformers' cannot run with vllm_mode='colocate'"):
        make(use_vllm=True, vllm_mode="colocate", vllm_model_impl="Transformers")
    assert make(use_vllm=True, vllm_mode="server", vllm_model_impl="transformers").vllm_model_impl == "transformers"
    assert make(use_vllm=True, vllm_mode="colocate", vllm_model_impl="vllm").vllm_model_impl == "vllm"
    assert make(use_vllm=False, vllm_model_impl="transformers").use_vllm is False  # no engine: nothing to refuse


# ------------------------------------------------------------------ calibration settings that cannot work (issue 40)


@pytest.mark.parametrize("clip_mode", ["calibrated", "oracle"])
def test_calibrated_and_oracle_without_fp8_warn_that_they_are_static_clipping(clip_mode):
    moved = dict(output_dir="unused", **CPU, num_iterations=2)  # a moved policy: no on-policy warning
    with pytest.warns(UserWarning, match=rf"clip_mode='{clip_mode}' with fp8=False is static clipping"):
        CalibratedGRPOConfig(**moved, clip_mode=clip_mode, fp8=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*static clipping", category=UserWarning)
        CalibratedGRPOConfig(**moved, clip_mode=clip_mode, fp8=True)
        CalibratedGRPOConfig(**moved, clip_mode="static", fp8=False)


def test_a_calibration_minimum_the_run_can_never_pool_warns_with_the_numbers():
    """No fit ever came, the bounds stayed at calibration_init_bounds and the pool grew every step, silently. Here a
    step is 2 completions (per_device_train_batch_size 2, one accumulation step) of at most 16 tokens: 3 steps
    generate at most 96."""
    run = dict(output_dir="unused", **CPU, num_iterations=2, max_steps=3, max_completion_length=16)
    with pytest.warns(UserWarning, match=r"calibration_min_tokens=97 cannot be reached: the whole run generates at "
                                         r"most 96 completion tokens \(max_steps 3 x 2 completions a step x "
                                         r"max_completion_length 16\)"):
        CalibratedGRPOConfig(**run, calibration_min_tokens=97)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cannot be reached", category=UserWarning)
        CalibratedGRPOConfig(**run, calibration_min_tokens=96)  # reachable: every token pooled
        CalibratedGRPOConfig(**run, calibration_min_tokens=97, clip_mode="static")  # no calibration to wait for
        CalibratedGRPOConfig(**{**run, "max_steps": -1}, calibration_min_tokens=97)  # epochs: not known here
