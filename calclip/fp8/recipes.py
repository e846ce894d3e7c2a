"""One place that knows every recipe's FP8 linear module: build one from an nn.Linear, recognise one, pop the
non-finite counts of all of them.

blockwise is ``FP8BlockLinear`` (calclip's kernels); rowwise and tensorwise are
``calclip.fp8.torchao_recipes.TorchaoFloat8Linear``. That module imports torchao, so it is imported here only
when a torchao recipe is converted; until then no torchao layer can exist, and nothing here imports torchao.
"""

from __future__ import annotations

import importlib
import sys

from torch import Tensor, nn

from calclip.fp8.config import Fp8Config, get_fp8_recipe, require_recipe_available
from calclip.fp8.linear import FP8BlockLinear
from calclip.fp8.linear import pop_nonfinite_count as _pop_nonfinite_count

_TORCHAO_MODULE = "calclip.fp8.torchao_recipes"


def _torchao_recipes(import_it: bool = False):
    """The torchao recipe module: imported when ``import_it``, else only if something imported it already."""
    if import_it:
        return importlib.import_module(_TORCHAO_MODULE)
    return sys.modules.get(_TORCHAO_MODULE)


def fp8_linear_types() -> tuple[type[nn.Linear], ...]:
    """The FP8 linear module types that can exist in this process."""
    torchao_recipes = _torchao_recipes()
    return (FP8BlockLinear,) if torchao_recipes is None else (FP8BlockLinear, torchao_recipes.TorchaoFloat8Linear)


def is_fp8_linear(module: nn.Module) -> bool:
    return isinstance(module, fp8_linear_types())


def torchao_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every torchao-recipe FP8 linear of ``model``."""
    torchao_recipes = _torchao_recipes()
    if torchao_recipes is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, torchao_recipes.TorchaoFloat8Linear)]


def fp8_linear_from(linear: nn.Linear, config: Fp8Config, fqn: str = "") -> nn.Linear:
    """The FP8 linear of ``config.recipe`` sharing ``linear``'s Parameters."""
    recipe = get_fp8_recipe(config.recipe)
    if not recipe.uses_torchao:
        return FP8BlockLinear.from_linear(linear, config)
    require_recipe_available(recipe)
    return _torchao_recipes(import_it=True).TorchaoFloat8Linear.from_linear(linear, config, fqn)


def pop_nonfinite_count(model: nn.Module) -> Tensor:
    """Sum of ``nonfinite_count`` over every FP8 linear of ``model``, any recipe (0-dim int64 tensor, no sync),
    and reset them to zero. Returns a CPU zero when no layer has run yet."""
    return _pop_nonfinite_count(model, fp8_linear_types())
