"""The rowwise and tensorwise FP8 recipes, run by torchao's float8 training (the optional ``[torchao]`` extra).

``TorchaoFloat8Linear`` is torchao's ``Float8Linear`` (its autograd Function, scaling and GEMMs, untouched) plus
what calclip's trainer relies on from every FP8 linear, the same contract as ``FP8BlockLinear``:

- the same Parameters as the nn.Linear it replaces (torchao's ``from_float`` reuses them; no copy), hence the
  same ``state_dict`` keys (``weight``, ``bias``): checkpoints and resume are those of the unconverted model;
- ``bf16_shadow_depth > 0`` (``calclip.fp8.bf16_shadow``): forward is plain ``F.linear`` on those Parameters,
  bit-identical to the unconverted nn.Linear;
- ``nonfinite_count``: 0-dim int64 tensor on the input's device counting output rows (tokens) with a
  non-finite value, no host sync. torchao exposes no scales to count from (FP8BlockLinear counts NaN scales),
  so this reads the output once (one float32 row sum: NaN/Inf anywhere in a row makes its sum non-finite).
  A non-finite input under tensorwise scaling makes the whole tensor's scale 0, so every row of the call
  counts; under rowwise only the rows holding it;
- autocast: x is cast to the autocast dtype of its own device type (torchao's forward only reads CUDA's).

Scales are exact (448 / amax) unless ``Fp8Config.power_of_two_scales``, for both recipes: torchao's rowwise
recipe rounds them down to a power of two, which under fp32 master weights holding bf16 values turns a tiny
update into whole-code FP8 steps along the gradient (``Fp8Config.power_of_two_scales`` says why).

What torchao does differently from the blockwise recipe: dims must be multiples of 16 (torch._scaled_mm; the
conversion refuses other layers, on CPU too, so a CPU run predicts the GPU's), the weight is re-quantized on
every call (there is no weight cache: ``generate`` re-quantizes per decode step), activations are saved for
the backward in high precision, and the export (``torchao_weight_fp8``) is per output channel, not in 128x128 blocks:
the codes and dequantization scales torchao's weight cast computes in the training forward, for vLLM's per-channel
FP8 linear (``calclip.fp8.export``; docs/vllm.md, "Rowwise and tensorwise").

``gemm``: "emulated" runs torchao's emulation (dequantize, then an fp32 matmul: the same FP8 codes and scales as
the real kernels); "scaled_mm" torch._scaled_mm; "auto" emulates exactly when the input is not on CUDA, decided
again only when the device changes.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from calclip.fp8.config import TORCHAO_INSTALL_HINT, Fp8Config, Fp8Recipe, get_fp8_recipe
from calclip.fp8.linear import check_floating_input, linear_sharing_parameters

try:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig
except ImportError as err:  # the module is imported only when a torchao recipe is chosen
    raise ImportError(f"FP8 recipes rowwise/tensorwise need torchao's float8 training; {TORCHAO_INSTALL_HINT} "
                      f"({err})") from err

# torch._scaled_mm's alignment for both GEMM dims of every operand (torchao pads nothing by default).
SCALED_MM_ALIGNMENT = 16

# convert_to_float8_training installs torchao's workaround for a Triton FP8-store miscompile in compiled float8
# kernels (triton-lang/triton#11111) before any float8 kernel is compiled; converting an empty module applies
# exactly that and swaps nothing. Done once, on the first conversion.
_torchao_setup_done = False


def _torchao_setup() -> None:
    global _torchao_setup_done
    if not _torchao_setup_done:
        convert_to_float8_training(nn.Module())
        _torchao_setup_done = True


def torchao_linear_config(recipe: str | Fp8Recipe, *, emulate: bool,
                          power_of_two_scales: bool = False) -> Float8LinearConfig:
    """torchao's own recipe (``Float8LinearConfig.from_recipe_name``) with its emulation switch set and its scales
    rounded to powers of two exactly when ``power_of_two_scales`` (torchao's rowwise recipe rounds by default;
    calclip does not: see ``Fp8Config.power_of_two_scales``)."""
    recipe = get_fp8_recipe(recipe)
    if not recipe.uses_torchao:
        raise ValueError(f"recipe {recipe.value!r} is calclip's own, not a torchao recipe")
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe.value), emulate=emulate,
                               round_scales_to_power_of_2=power_of_two_scales)


def torchao_weight_fp8(weight: Tensor, recipe: str | Fp8Recipe, *, power_of_two_scales: bool = False
                       ) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (codes float8_e4m3fn [N, K], dequantization scale float32 [N, 1]): what the training forward of
    a ``TorchaoFloat8Linear`` of ``recipe`` multiplies with, computed by torchao's own weight cast.

    The cast is the one ``matmul_with_hp_or_float8_args.forward`` applies to ``weight.t()`` (role WEIGHT, the
    recipe's ``cast_config_weight``, axis 0 of W^T: one scale per output row for rowwise, one for the tensor for
    tensorwise), on the Parameter as stored (fp32 master weights are cast from fp32, as in training). torchao keeps
    the quantizing multiplier ``448 / amax``; its GEMMs multiply by its reciprocal (``addmm_float8_unwrapped``), which
    is the dequantization scale returned here, one per output row (tensorwise: the one scale repeated N times, so
    that vLLM's per-channel layers hold it without re-quantizing fused shards; see calclip.fp8.export).
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    config = torchao_linear_config(recipe, emulate=True, power_of_two_scales=power_of_two_scales)
    cast = config.cast_config_weight
    with torch.no_grad():
        fp8 = hp_tensor_to_float8_dynamic(
            weight.detach().t(), cast.target_dtype, LinearMMConfig(), gemm_input_role=GemmInputRole.WEIGHT,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(0, cast.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2)
        codes = fp8._data.t().contiguous()
        inverse = fp8._scale.reciprocal().to(torch.float32)
    return codes, inverse.reshape(-1, 1).expand(weight.shape[0], 1).contiguous()


def check_scaled_mm_shape(linear: nn.Linear, fqn: str, recipe: Fp8Recipe) -> None:
    """Raise, naming the layer, when torch._scaled_mm cannot run it (a dim not a multiple of 16)."""
    k, n = linear.in_features, linear.out_features
    if k % SCALED_MM_ALIGNMENT or n % SCALED_MM_ALIGNMENT:
        raise ValueError(
            f"layer {fqn!r} (in_features {k}, out_features {n}) cannot run FP8 recipe {recipe.value!r}: torchao's "
            f"torch._scaled_mm GEMMs need both dims to be multiples of {SCALED_MM_ALIGNMENT}; keep it in BF16 "
            f"(Fp8Config.keep_patterns / fp8_keep_patterns, e.g. {fqn!r}) or use recipe 'blockwise'"
        )


@contextlib.contextmanager
def _outside_inference_mode():
    with torch.inference_mode(False), torch.no_grad():
        yield


class TorchaoFloat8Linear(Float8Linear):
    """torchao's Float8Linear with calclip's shadow flag, non-finite count and autocast handling (see module
    docstring). Build it with ``from_linear``; ``to_linear`` gives the plain nn.Linear back."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config, fqn: str = "") -> TorchaoFloat8Linear:
        """A TorchaoFloat8Linear sharing ``linear``'s weight and bias Parameters (torchao's from_float)."""
        recipe = get_fp8_recipe(config.recipe)
        check_scaled_mm_shape(linear, fqn, recipe)
        _torchao_setup()
        emulate = config.gemm == "emulated" or (config.gemm == "auto" and linear.weight.device.type != "cuda")
        new = cls.from_float(linear, config=torchao_linear_config(
            recipe, emulate=emulate, power_of_two_scales=config.power_of_two_scales))
        new.train(linear.training)
        new.fp8_config = config
        new.bf16_shadow_depth = 0
        new.nonfinite_count: Tensor | None = None
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this module's Parameters."""
        return linear_sharing_parameters(self)

    @property
    def emulate(self) -> bool:
        return self.config.emulate

    def _set_emulate(self, emulate: bool) -> None:
        # torchao keeps the switch in the config and in the per-GEMM configs its constructor derives from it: take
        # both from a parameter-less module built by that constructor rather than editing torchao's tuples.
        template = Float8Linear(self.in_features, self.out_features, bias=False, device="meta",
                                config=dataclasses.replace(self.config, emulate=emulate))
        self.config, self.linear_mm_config = template.config, template.linear_mm_config

    def forward(self, x: Tensor) -> Tensor:
        check_floating_input(self, x)
        if self.bf16_shadow_depth > 0:
            return F.linear(x, self.weight, self.bias)
        if self.fp8_config.gemm == "auto" and self.config.emulate == x.is_cuda:
            self._set_emulate(not x.is_cuda)
        device_type = x.device.type
        # Token rows in, token rows out: the non-finite count counts rows.
        x2 = x.reshape(-1, x.shape[-1])
        autocast = torch.is_autocast_enabled(device_type)
        if autocast:
            x2 = x2.to(torch.get_autocast_dtype(device_type))
        # torchao's own autocast check reads CUDA autocast only: x2 is cast above, and autocast must not recast
        # torchao's operands. Under inference_mode torchao's rowwise path fails (a reshape of its FP8 tensor no
        # longer decomposes to a view): step out of it, without grad, which computes the same values. (Dynamo
        # cannot trace the inference-mode queries, and compiled code does not run under inference_mode.)
        if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            with _outside_inference_mode(), torch.autocast(device_type, enabled=False):
                y2 = super().forward(x2)
        elif autocast:
            with torch.autocast(device_type, enabled=False):
                y2 = super().forward(x2)
        else:
            y2 = super().forward(x2)
        self._count_nonfinite(y2)
        return y2.reshape(*x.shape[:-1], y2.shape[-1])

    def _count_nonfinite(self, y2: Tensor) -> None:
        counter = self.nonfinite_count
        if counter is None or counter.device != y2.device or (not torch.compiler.is_compiling() and (
                counter.is_inference() and not torch.is_inference_mode_enabled())):
            # (re)created outside inference mode too: an inference tensor cannot be updated in place later
            carried = 0 if counter is None or counter.device != y2.device else int(counter)
            counter = self.nonfinite_count = torch.full((), carried, dtype=torch.int64, device=y2.device)
        with torch.no_grad():
            counter.add_((~torch.isfinite(y2.detach().sum(dim=-1, dtype=torch.float32))).sum())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={get_fp8_recipe(self.fp8_config.recipe).value}, emulate={self.emulate}"
