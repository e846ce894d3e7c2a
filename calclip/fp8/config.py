"""FP8 constants, the recipe registry and the one configuration object of ``calclip.fp8``.

``Fp8Config`` follows torchao's float8 config: a frozen dataclass whose ``__post_init__`` validates every
field with a message naming the field and the allowed values. It is plain data: ``calclip.fp8`` never reads
a trainer config, the trainer builds an ``Fp8Config`` from its own fields.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from enum import Enum, unique

import torch

# Largest finite float8_e4m3fn value (448). Named, never written as a literal.
FP8_E4M3_MAX: float = torch.finfo(torch.float8_e4m3fn).max
FP8_DTYPE = torch.float8_e4m3fn
# DeepSeek-V3 block size: 1x128 groups for activations/gradients, 128x128 blocks for weights.
BLOCK: int = 128

BACKWARD_MODES = ("fp8", "bf16")
GEMM_BACKENDS = ("auto", "scaled_mm", "triton", "emulated")

TORCHAO_INSTALL_HINT = 'install the torchao extra: pip install "calclip[torchao]"'


@unique
class Fp8Recipe(str, Enum):
    """FP8 scaling granularity of the linear layers, chosen by name (``Fp8Config.recipe``, ``fp8_recipe``).

    Coarser scales give faster GEMMs and more quantization noise (more ratio noise, more A<0 tokens pushed below
    the lower clip bound); calclip's trainer works the same on each."""

    # DeepSeek-V3, calclip's own kernels: x and dy in 1x128 groups, W in 128x128 blocks, e4m3 throughout. Ragged
    # dims, FP8-saved activations, codes identical to vLLM's block-FP8 layers (rowwise / tensorwise export per channel).
    BLOCKWISE = "blockwise"
    # torchao "rowwise": one scale per token row of x and dy and per output row of W, e4m3 throughout. Exact
    # scales unless power_of_two_scales (torchao's own recipe rounds them to a power of two: see Fp8Config).
    ROWWISE = "rowwise"
    # torchao "tensorwise": one scale per tensor (x, W, dy), dy in e5m2; the fastest and the noisiest.
    TENSORWISE = "tensorwise"

    @property
    def uses_torchao(self) -> bool:
        return self is not Fp8Recipe.BLOCKWISE


def fp8_recipe_names() -> tuple[str, ...]:
    return tuple(recipe.value for recipe in Fp8Recipe)


def get_fp8_recipe(name: str | Fp8Recipe) -> Fp8Recipe:
    """Fp8Recipe for a config string; an unknown name raises ValueError listing the valid ones."""
    if isinstance(name, Fp8Recipe):
        return name
    try:
        return Fp8Recipe(name)
    except ValueError:
        raise ValueError(f"unknown FP8 recipe {name!r}; valid recipes: {', '.join(fp8_recipe_names())}") from None


def require_recipe_available(recipe: str | Fp8Recipe, *, field: str = "Fp8Config.recipe") -> Fp8Recipe:
    """The Fp8Recipe for ``recipe``; raises ImportError naming the extra when a torchao recipe is chosen but
    torchao is not installed (checked without importing it)."""
    recipe = get_fp8_recipe(recipe)
    if recipe.uses_torchao and importlib.util.find_spec("torchao") is None:
        raise ImportError(f"{field}={recipe.value!r} runs on torchao, which is not installed; {TORCHAO_INSTALL_HINT}")
    return recipe


def blockwise_only_options(recipe: str | Fp8Recipe, *, backward: str = "fp8", gemm: str = "auto",
                           block_size: int = BLOCK, decode_fused_max_m: int | None = None,
                           decode_group_siblings: bool = False,
                           scaled_mm_row_scales: bool | None = None, resident_weight_codes: bool = True) -> list[str]:
    """``Fp8Config`` option names set to a value that only the blockwise recipe honours, for ``recipe``.

    torchao's rowwise/tensorwise recipes always quantize the backward in FP8, have no block size, no fused
    decode kernel and no Triton GEMM backend of calclip's; silently ignoring such a setting
    would measure something else than asked. (power_of_two_scales is honoured by every recipe.)
    """
    if not get_fp8_recipe(recipe).uses_torchao:
        return []
    conflicts = {"backward": backward != "fp8", "gemm": gemm == "triton", "block_size": block_size != BLOCK,
                 "decode_fused_max_m": decode_fused_max_m not in (None, 0),
                 "decode_group_siblings": decode_group_siblings, "scaled_mm_row_scales": scaled_mm_row_scales,
                 "resident_weight_codes": not resident_weight_codes}
    return [name for name, conflict in conflicts.items() if conflict]


def check_keep_patterns(patterns, subject=lambda name: f"Fp8Config.{name}") -> tuple[str, ...]:
    """``keep_patterns`` as a tuple, each entry a regex that compiles; raises ValueError naming the option as
    ``subject`` spells it (``Fp8Config.keep_patterns`` here, ``fp8_keep_patterns`` in the trainer config, which
    checks its field at config time with this)."""
    if isinstance(patterns, str):
        # A bare string would be iterated character by character: almost surely a mistake.
        raise ValueError(f"{subject('keep_patterns')} must be a sequence of regexes, not a str: {patterns!r}")
    patterns = tuple(patterns)
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as err:
            raise ValueError(f"{subject('keep_patterns')}: invalid regex {pattern!r}: {err}") from None
    return patterns


def check_fp8_combination(*, recipe: str | Fp8Recipe, backward: str = "fp8", gemm: str = "auto",
                          block_size: int = BLOCK, decode_fused_max_m: int | None = None,
                          decode_group_siblings: bool = False,
                          scaled_mm_row_scales: bool | None = None, resident_weight_codes: bool = True,
                          cache_weights: bool = True, subject=lambda name: f"Fp8Config.{name}",
                          mention=lambda name: name) -> Fp8Recipe:
    """The rules between ``Fp8Config``'s options, in one place: ``Fp8Config.__post_init__`` applies them after
    checking each field alone, and the trainer config applies them to its ``fp8_*`` fields, so the two cannot
    disagree. Returns the Fp8Recipe; raises ValueError naming the options (ImportError when a torchao recipe is chosen
    without torchao). ``subject`` / ``mention`` spell an option's name as the caller's user writes it: the option a
    message is about, and the others it mentions (``Fp8Config.gemm`` / ``gemm`` here, ``fp8_gemm`` in the trainer).
    """
    max_m = decode_fused_max_m
    if max_m and block_size != BLOCK:
        raise ValueError(f"{subject('decode_fused_max_m')}={max_m} runs calclip's Triton kernel, which needs "
                         f"{mention('block_size')}={BLOCK}; got {mention('block_size')}={block_size}")
    if max_m and gemm == "emulated":
        raise ValueError(f"{subject('decode_fused_max_m')}={max_m} runs calclip's Triton kernel, but "
                         f"{mention('gemm')}='emulated' asks for the torch emulation; set "
                         f"{mention('decode_fused_max_m')}=0 or another {mention('gemm')}")
    if scaled_mm_row_scales and gemm not in ("auto", "scaled_mm"):
        raise ValueError(f"{subject('scaled_mm_row_scales')} runs GEMMs on torch._scaled_mm, which "
                         f"{mention('gemm')}={gemm!r} rules out; set {mention('gemm')} to 'auto' or 'scaled_mm', or "
                         f"{mention('scaled_mm_row_scales')}=False")
    if decode_group_siblings and max_m == 0:
        raise ValueError(f"{subject('decode_group_siblings')} groups fused decode calls, which "
                         f"{mention('decode_fused_max_m')}=0 turns off; set {mention('decode_fused_max_m')} to None "
                         "(automatic) or N > 0")
    if not resident_weight_codes and decode_group_siblings:
        raise ValueError(f"{subject('resident_weight_codes')}=False keeps no weight codes between calls, but "
                         f"{mention('decode_group_siblings')}=True keeps its members' codes in resident stacked "
                         f"buffers; set {mention('decode_group_siblings')}=False")
    if not resident_weight_codes and not cache_weights:
        raise ValueError(f"{subject('resident_weight_codes')}=False is not available with sharded parameters (FSDP, "
                         "ZeRO-3: cache_weights=False), whose FP8 layers re-quantize into their buffers in every call; "
                         f"set {mention('resident_weight_codes')}=True")
    try:
        recipe = get_fp8_recipe(recipe)
    except ValueError:
        raise ValueError(f"{subject('recipe')} must be one of {fp8_recipe_names()}, got {recipe!r}") from None
    values = {"backward": backward, "gemm": gemm, "block_size": block_size, "decode_fused_max_m": decode_fused_max_m,
              "decode_group_siblings": decode_group_siblings,
              "scaled_mm_row_scales": scaled_mm_row_scales, "resident_weight_codes": resident_weight_codes}
    conflicts = blockwise_only_options(recipe, **values)
    if conflicts:
        settings = ", ".join(f"{mention(name)}={values[name]!r}" for name in conflicts)
        raise ValueError(f"{subject('recipe')}={recipe.value!r} (torchao) cannot honour {settings}: these are "
                         "options of the 'blockwise' recipe; leave them at their defaults")
    require_recipe_available(recipe, field=subject("recipe"))
    return recipe


# Fp8Config.decode_fused_max_m=None's row limit: RL decode batches (a generation batch of completions is M); the
# H200 measured the fused kernel faster in eager calls up to M=256, the largest it timed (docs/usage.md, Fused decode).
DECODE_FUSED_AUTO_MAX_M = 256

# Fp8Config options that are off by default because no measurement has shown them to pay: kept so that a GPU run can
# measure them against the default, not recommended for training (docs/usage.md, Experimental FP8 options).
EXPERIMENTAL_OPTIONS: tuple[str, ...] = ("decode_group_siblings",)


@dataclass(frozen=True)
class Fp8Config:
    """How linear layers are quantized and which ones stay in BF16.

    Experimental options (``EXPERIMENTAL_OPTIONS``): decode_group_siblings.
    Each is off by default, changes no codes or scales, and exists to be measured against the default on a GPU.

    block_size: quantization block edge (1 x block_size groups, block_size x block_size weight blocks).
        Only 128 is supported by the GPU kernels; the CPU reference accepts any positive size.
    power_of_two_scales: round every scale UP to a power of two (exact scaling, nothing saturates), any recipe
        (torchao's ``round_scales_to_power_of_2`` for rowwise and tensorwise). Off by default for every recipe,
        although torchao's own rowwise recipe turns it on: a power-of-two scale keeps a weight's mantissa bits,
        so a weight with 5 significant bits (1 in 16 bf16 values) sits exactly on a rounding tie between two
        e4m3 codes, and the smallest update moves its code a whole e4m3 step in the update's direction. Fp32
        master weights loaded from a bf16 checkpoint then take an FP8 step far larger than their BF16 shadow's
        (docs/usage.md, FP8 recipes, has the measured drift).
    backward: "fp8" (DeepSeek-V3: dgrad and wgrad GEMMs in FP8) or "bf16" (straight-through: BF16
        matmuls against the dequantized weight and the unquantized activations).
    gemm: "auto" | "scaled_mm" | "triton" | "emulated" (see ``calclip.fp8.gemm``).
    keep_first_n_layers / keep_last_n_layers: decoder layers (``...layers.<i>.``) kept in BF16, counted in each
        layer stack separately (a vision tower's blocks and the language model's layers each keep their own).
    keep_last_fraction: share in [0, 1) of the last decoder layers kept in BF16 (rounded up).
    keep_patterns: regexes (``re.search`` on the fully qualified module name) of layers kept in BF16.
    recipe: "blockwise" (default) | "rowwise" | "tensorwise" (``Fp8Recipe``). rowwise and tensorwise run torchao's
        float8 training (the ``[torchao]`` extra); with them backward must be "fp8", gemm "auto" | "scaled_mm" |
        "emulated", and block_size, decode_fused_max_m stay at their defaults
        (``blockwise_only_options``).
    cache_weights: keep the quantized weight between calls until the weight changes (blockwise; torchao's
        recipes re-quantize the weight on every call). Turn it off when the parameters are sharded (FSDP,
        ZeRO-3): the forward's weight is a fresh all-gather whose buffer key does not follow the shards (the
        trainer does this itself; docs/usage.md, Multi-GPU).
    decode_fused_max_m: None (default: automatic), 0 (off) or the largest number of rows (tokens) a forward with
        grad disabled may have to run as ONE launch that quantizes x in the GEMM's prologue
        (``fp8_linear_fused_quant_gemm``) instead of a quantizer launch and a GEMM launch: meant for rollout decode
        steps (M = batch). Same codes and scales; the GEMM accumulates like the ``triton`` backend (not
        ``torch._scaled_mm``: fp32 rounding order only). Training forwards never take it.
        None: eager CUDA calls of up to ``DECODE_FUSED_AUTO_MAX_M`` (256) rows when gemm is "auto" or "triton"
        (blockwise, block_size 128), nothing else. That is where the H200 measured it faster, while inside CUDA
        graphs (compiled calls, or eager calls being captured) the two-launch path's GPU time was lower at every
        shape: the fused kernel redoes the quantization in each N tile (docs/usage.md, Fused decode).
        An int N > 0: eager and compiled calls of up to N rows on CUDA (compiled calls record the triton op
        ``calclip::fp8_linear_decode``), and eager CPU calls under TRITON_INTERPRET=1 (the tests).
    decode_group_siblings (experimental): in eager fused decode calls, run the sibling linears that read one input (a
        decoder layer's q_proj/k_proj/v_proj, gate_proj/up_proj) as ONE launch over their stacked codes: 4 launches per
        Llama-style layer instead of 7 (``calclip.fp8.siblings``). Same codes, scales and output bits; the
        non-finite count's total is the same, all of it on the first sibling. Off by default until measured on
        a GPU. Needs the fused decode (``decode_fused_max_m`` not 0) and the blockwise recipe.
    scaled_mm_row_scales: None (default: on wherever it applies, i.e. the blockwise recipe with gemm "auto" or
        "scaled_mm"; ``Fp8Config.row_scales`` resolves it), True, or False. On: on the H200, run the forward and dgrad
        GEMMs whose contraction dim is a multiple of 128 but not of 512 (Qwen2.5-1.5B's down projection, K = 8960; its
        gate/up and k/v dgrad; Qwen2.5-0.5B's every linear) on torch._scaled_mm with the weight's 128x128 scales
        repeated per row, instead of calclip's Triton GEMM: cuBLAS returns wrong results for a 128x128 scale whose K/128
        is not a multiple of 4, not for one scale per row (``calclip.fp8.gemm``). Same codes and scales, so the same
        products, summed in cuBLAS' order; costs one small copy of the weight's scales per call. Faster on the H200
        where it applies (docs/benchmarks.md, FP8 at real model shapes: the Qwen2.5-1.5B-dims model row, compiled);
        7B/8B dims have no such GEMM (every K/128 a multiple of 4), so nothing changes there.
    refresh_graph: on CUDA, once every FP8 layer of a converted model has its code buffers, re-quantize all of them
        after an optimizer step by one CUDA-graph replay instead of three launches per layer (``calclip.fp8.
        refresh_graph``; the root's pre-hook before compiled calls). Same kernels, same codes. Default True;
        ``CALCLIP_REFRESH_GRAPH=0`` switches it off for the whole process.
    share_sibling_inputs: the sibling linears that read one input (a decoder layer's q/k/v, gate/up) quantize it
        once in forwards that do not take the fused decode (training, old log-probs), and save one copy of its
        128x1 codes for backward instead of one each: per Llama-style layer 4 input quantizations instead of 7
        (``calclip.fp8.shared_input``). Same codes, outputs and gradients bit for bit; the non-finite count's total
        is the same, all of it on the member that quantized. Default True (blockwise, backward "fp8", cached
        weights; otherwise nothing is grouped).
    fuse_producers: quantize those shared inputs, and down_proj's, in the kernels that produce them: a Llama /
        Mistral / Qwen2 / Qwen3 decoder layer's RMSNorm writes its bf16 output with its FP8 codes (both layouts),
        its MLP's SiLU(gate) * up likewise (``calclip.fp8.producers``): per layer 3 input quantizations fewer, and
        each of those tensors read once instead of twice or three times. Same outputs, codes, gradients and
        non-finite count bit for bit (CPU tests, tiny Llama and Qwen2; its kernels' tests pass on an H100 too).
        Architectures it does not recognise (Phi-3, Gemma) keep today's path. Default False: in the compiled step
        (compile_layers) it bought 1.01x and no memory at Qwen2.5-7B dims on the H100, Inductor already recomputing
        what it drops; eager steps keep less (counted on CPU, not measured on a GPU). Needs share_sibling_inputs.
    resident_dgrad_codes: keep the W^T codes that the dgrad GEMM reads resident beside the W codes (a second
        1-byte-per-parameter copy on CUDA, refreshed with them), or, False, transpose them from the W codes in each
        backward that needs them (a transposing copy of N x K bytes per layer and backward, freed after its GEMM):
        FP8's resident weight codes halve. The transpose of 128x128-block codes is exact (each block's scale moves
        with it), so outputs and gradients are the same bit for bit. Default False: on the H100 (2026-12-05) the
        on-demand transpose made the step faster, not slower (Qwen2.5-7B dims 1.04x, 1.5B dims 1.01x, compiled by
        layer) and the peak lower by the W^T codes (0.65 GiB at 7B dims, 0.35 at 1.5B; docs/benchmarks.md).
    resident_weight_codes: keep every layer's W codes resident between calls (refreshed in place when the weight
        changes), or, False, quantize the weight in each call that reads it (one 128x128 quantization per layer and
        forward, a second in the backward for the dgrad GEMM, made from the weight the forward saved) and keep
        nothing but the layer's non-finite flag: FP8 then holds no copy of the weights through the step, so a training
        step's peak no longer carries 1 byte per FP8 parameter (0.65 GiB at Qwen2.5-7B dims, 3 layers; counted with
        ``benchmarks/memory_budget.py``). Inside ``frozen_fp8_weights`` (generation) the codes are built once on
        entry and freed on exit, so decode does not requantize per token. Same codes, outputs and gradients bit for
        bit. Costs a read of the weights per forward and backward. Default True until measured on a GPU. Needs
        ``cache_weights`` and rules out ``decode_group_siblings`` (whose stacked buffers are resident codes).
    """

    block_size: int = BLOCK
    power_of_two_scales: bool = False
    backward: str = "fp8"
    gemm: str = "auto"
    keep_first_n_layers: int = 0
    keep_last_n_layers: int = 0
    keep_last_fraction: float = 0.0
    keep_patterns: tuple[str, ...] = ("lm_head",)
    cache_weights: bool = True
    recipe: str = Fp8Recipe.BLOCKWISE.value
    decode_fused_max_m: int | None = None
    decode_group_siblings: bool = False
    scaled_mm_row_scales: bool | None = None
    refresh_graph: bool = True
    share_sibling_inputs: bool = True
    fuse_producers: bool = False
    resident_dgrad_codes: bool = False
    resident_weight_codes: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"Fp8Config.block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.power_of_two_scales, bool):
            raise ValueError(f"Fp8Config.power_of_two_scales must be a bool, got {self.power_of_two_scales!r}")
        if self.backward not in BACKWARD_MODES:
            raise ValueError(f"Fp8Config.backward must be one of {BACKWARD_MODES}, got {self.backward!r}")
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"Fp8Config.gemm must be one of {GEMM_BACKENDS}, got {self.gemm!r}")
        for name in ("keep_first_n_layers", "keep_last_n_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Fp8Config.{name} must be an int >= 0, got {value!r}")
        frac = self.keep_last_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not (0.0 <= frac < 1.0) or math.isnan(frac):
            raise ValueError(f"Fp8Config.keep_last_fraction must be a float in [0, 1), got {frac!r}")
        # lists from YAML become a hashable tuple
        object.__setattr__(self, "keep_patterns", check_keep_patterns(self.keep_patterns))
        for name in ("cache_weights", "decode_group_siblings", "scaled_mm_row_scales",
                     "refresh_graph", "share_sibling_inputs", "fuse_producers",
                     "resident_dgrad_codes", "resident_weight_codes"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "scaled_mm_row_scales" and value is None):
                extra = " or None (automatic)" if name == "scaled_mm_row_scales" else ""
                raise ValueError(f"Fp8Config.{name} must be a bool{extra}, got {value!r}")
        max_m = self.decode_fused_max_m
        if max_m is not None and (isinstance(max_m, bool) or not isinstance(max_m, int) or max_m < 0):
            raise ValueError(f"Fp8Config.decode_fused_max_m must be None (automatic) or an int >= 0 (0: off), "
                             f"got {max_m!r}")
        recipe = check_fp8_combination(
            recipe=self.recipe, backward=self.backward, gemm=self.gemm, block_size=self.block_size,
            decode_fused_max_m=max_m,
            decode_group_siblings=self.decode_group_siblings, scaled_mm_row_scales=self.scaled_mm_row_scales,
            resident_weight_codes=self.resident_weight_codes, cache_weights=self.cache_weights)
        object.__setattr__(self, "recipe", recipe)  # the Enum member (a str: compares equal to its name)
        row_scales = self.scaled_mm_row_scales
        if row_scales is None:  # automatic: on wherever the option applies
            row_scales = not recipe.uses_torchao and self.gemm in ("auto", "scaled_mm")
        object.__setattr__(self, "_row_scales", row_scales)  # resolved once; not a field (replace() re-resolves)

    @property
    def row_scales(self) -> bool:
        """``scaled_mm_row_scales`` resolved: its None (automatic) is on wherever the option applies, i.e. the
        blockwise recipe with gemm "auto" or "scaled_mm". The field keeps what was given, so that
        ``dataclasses.replace(config, gemm="triton")`` stays valid."""
        return self._row_scales

    def fused_decode_max_m(self, *, cuda: bool, compiled: bool) -> int:
        """The most rows a no-grad forward may have to take the fused decode kernel (0: never), for a call on CUDA
        or not, compiled (or captured into a CUDA graph) or eager: ``decode_fused_max_m`` resolved (its None means
        the automatic rule)."""
        if self.decode_fused_max_m is not None:
            return self.decode_fused_max_m
        automatic = (cuda and not compiled and self.recipe == Fp8Recipe.BLOCKWISE and self.block_size == BLOCK
                     and self.gemm in ("auto", "triton"))
        return DECODE_FUSED_AUTO_MAX_M if automatic else 0
