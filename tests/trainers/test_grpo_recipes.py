"""CalibratedGRPOTrainer with the torchao FP8 recipes (``fp8_recipe`` rowwise / tensorwise, emulated on CPU): config
validation, short offline runs, checkpoint and resume."""

import math
import warnings

import pytest
import torch
from torch import nn
from transformers import TrainerCallback
from trl import TrlParser

pytest.importorskip("torchao.float8")

from calclip.fp8.torchao_recipes import TorchaoFloat8Linear  # noqa: E402
from calclip.trainers.config import CalibratedGRPOConfig  # noqa: E402
from tests.fixtures import build_tiny_model, build_tiny_tokenizer, logged, tiny_trainer  # noqa: E402

CPU = dict(output_dir="unused", report_to="none", use_cpu=True, bf16=False, num_generations=2,
           per_device_train_batch_size=2)


def _config(**overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CalibratedGRPOConfig(**{**CPU, **overrides})


def test_fp8_recipe_field_validation():
    assert _config().fp8_recipe == "blockwise"
    with pytest.raises(ValueError, match=r"fp8_recipe must be one of \('blockwise', 'rowwise', 'tensorwise'\)"):
        _config(fp8_recipe="channelwise")
    assert _config(fp8_recipe="rowwise", fp8_power_of_two_scales=True).fp8_power_of_two_scales  # every recipe's
    for option, value in (("fp8_backward", "bf16"), ("fp8_gemm", "triton"), ("fp8_decode_fused_max_m", 8)):
        with pytest.raises(ValueError, match=rf"fp8_recipe='rowwise' \(torchao\) cannot honour {option}={value!r}"):
            _config(fp8_recipe="rowwise", **{option: value})
        _config(fp8_recipe="rowwise", fp8=False, **{option: value})  # FP8 off: the recipe is not used
    # vLLM rollouts serve every recipe (rowwise / tensorwise per channel: tests/rollout/test_vllm_recipes_sync.py)
    assert _config(fp8_recipe="tensorwise", use_vllm=True).use_vllm


def test_fp8_recipe_parses_from_yaml_and_cli(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: out\nreport_to: none\nuse_cpu: true\nbf16: false\nnum_generations: 2\n"
                    "per_device_train_batch_size: 2\nfp8_recipe: rowwise\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (from_yaml,) = TrlParser((CalibratedGRPOConfig,)).parse_args_and_config(args=["--config", str(path)])
        (overridden,) = TrlParser((CalibratedGRPOConfig,)).parse_args_and_config(
            args=["--config", str(path), "--fp8_recipe", "tensorwise"])
    assert (from_yaml.fp8_recipe, overridden.fp8_recipe) == ("rowwise", "tensorwise")


def _trainer(tokenizer, tmp_path, callbacks=None, **overrides):
    return tiny_trainer(tmp_path, tokenizer=tokenizer, callbacks=callbacks, clip_mode="calibrated", fp8=True,
                        **overrides)


class _WeightsAtTrainBegin(TrainerCallback):
    """Copies the model's parameters when training starts, i.e. right after a resume loaded the checkpoint."""

    def __init__(self):
        self.params = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_short_calibrated_run(tmp_path, recipe):
    tokenizer = build_tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(tokenizer, tmp_path, fp8_recipe=recipe)
        fp8_layers = [n for n, m in trainer.model.named_modules() if isinstance(m, TorchaoFloat8Linear)]
        assert len(fp8_layers) == 14 and type(trainer.model.lm_head) is nn.Linear  # 2 layers x 7, LM head BF16
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()

    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= changed
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)
    assert logged(trainer, "fp8/nonfinite_tokens") == [0.0, 0.0]
    # the shadow calibration ran on the moved mini-batch: FP8 noise visible, bounds moved off the initial ones
    assert logged(trainer, "mismatch/fp8_bf16_token_mult_prob_error")[0] > 1.0
    assert len(logged(trainer, "clip/neg_low_frac_bf16")) == 1
    assert trainer.calibrator.calibrated and trainer.calibrator.bounds != tuple(trainer.args.calibration_init_bounds)


@pytest.mark.slow
def test_checkpoint_resume_loads_the_saved_weights_into_the_fp8_layers(tmp_path):
    tokenizer = build_tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _trainer(tokenizer, tmp_path, fp8_recipe="rowwise", save_strategy="steps", save_steps=1, max_steps=2)
        first.train()
        at_begin = _WeightsAtTrainBegin()
        resumed = _trainer(tokenizer, tmp_path / "resumed", [at_begin], fp8_recipe="rowwise", max_steps=2)
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoint-1" / "model.safetensors"))
    assert set(saved) == set(build_tiny_model(tokenizer).state_dict())  # the checkpoint of an unconverted model
    assert resumed.state.global_step == 2
    assert isinstance(resumed.model.model.layers[0].self_attn.q_proj, TorchaoFloat8Linear)
    assert at_begin.params.keys() == saved.keys()
    assert all(torch.equal(at_begin.params[n], saved[n]) for n in saved)  # resumed from exactly the checkpoint
    # training went on from the checkpoint: step 2 moved the weights away from it
    assert not torch.equal(resumed.model.model.layers[0].self_attn.q_proj.weight.detach(),
                           saved["model.layers.0.self_attn.q_proj.weight"])
