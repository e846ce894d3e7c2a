"""Launching calclip's Triton kernels: autotuning once per shape, a direct launch path, and the host-side checks
every launcher shares.

On CUDA the launchers autotune the tile shapes over a few configs (keyed on the inner dim and a bucket of the
outer one, so a new sequence length does not retune); set ``CALCLIP_TRITON_AUTOTUNE=0`` to use the default
config only. The timings are kept on disk in Triton's cache (``triton.autotune(cache_results=True)``, keyed by the
Triton version, the GPU target, the kernel source, the key and the configs), so a second process on the machine
reuses them instead of re-timing every config; ``CALCLIP_TRITON_AUTOTUNE_CACHE=0`` turns that off.

After the first launch of a specialization, ``_Tuned.launch`` calls the compiled kernel's C launcher directly
(``_fast_launch``; off with ``CALCLIP_TRITON_FAST_LAUNCH=0``). That path reads ``triton.knobs`` (the launch hooks),
which Triton has had since 3.4: the ``gpu`` extra's lower bound.

On CPU tensors the kernels run under ``TRITON_INTERPRET=1`` (tests only): ``_check_device`` says so, and the
kernels then encode e4m3fn codes in software (``numerics._e4m3fn_bits``) and store them through a uint8 view
(``_codes_out``).

The underscore names are private to ``calclip.fp8.kernels``: its modules share them, nothing else imports them
(tests excepted).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton
from triton import knobs

from calclip.fp8.config import BLOCK
from calclip.fp8.tracing import is_traced

_AUTOTUNE = os.environ.get("CALCLIP_TRITON_AUTOTUNE", "1") != "0"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """Plain-Python next power of two (triton.next_power_of_2 is a constexpr function: slow to call on the host)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _bucket(n: int) -> int:
    """Autotune key for an outer (token) dim: next power of two, capped, so varying lengths reuse a tuning.
    A symbolic size (torch.compile with dynamic shapes) is passed through: Inductor tunes the kernels itself."""
    if type(n) is not int:
        return n
    return min(_next_pow2(max(n, 1)), 1 << 16)


def _check_block(block: int) -> None:
    if block != BLOCK:
        raise ValueError(f"the Triton kernels support block={BLOCK} only, got block={block}")


def _check_device(*tensors: Tensor) -> bool:
    """Return True when the kernels must encode fp8 in software (CPU tensors under TRITON_INTERPRET=1)."""
    device = tensors[0].device
    if len(tensors) > 1 and any(t.device != device for t in tensors[1:]):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if device.type == "cuda":
        return False
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    raise ValueError(f"Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {device}")


def _counter_operands(x: Tensor, nonfinite_count: Tensor, weight_bad: Tensor | None) -> tuple[bool, Tensor]:
    """(soft_fp8, weight_bad) for a kernel that adds x's non-finite rows to ``nonfinite_count`` (int64 [] on x's
    device; checked here) — every row when ``weight_bad`` (bool [], default False) is set."""
    if weight_bad is None:
        weight_bad = torch.zeros((), dtype=torch.bool, device=nonfinite_count.device)
    soft_fp8 = _check_device(x, nonfinite_count, weight_bad)
    if nonfinite_count.dtype != torch.int64 or nonfinite_count.numel() != 1:
        raise ValueError(f"nonfinite_count must be an int64 [] tensor, got {nonfinite_count.dtype} "
                         f"{tuple(nonfinite_count.shape)}")
    return soft_fp8, weight_bad


def _as_float_input(x: Tensor) -> Tensor:
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"expected a bf16/fp16/fp32/fp64 tensor, got {x.dtype}")
    return x.float() if x.dtype == torch.float64 else x  # fp64 is rounded to fp32 first, as the reference does


def _check_2d(name: str, x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} needs a 2-D tensor, got shape {tuple(x.shape)}")


def _codes_out(q: Tensor, soft_fp8: bool) -> Tensor:
    return q.view(torch.uint8) if soft_fp8 else q


class _Tuned:
    """A kernel, its autotune configs and the config chosen per autotune key.

    The first call with a new key runs Triton's autotuner (it times every config, then launches the best);
    later calls look the config up in a dict and launch the plain kernel with it, so a steady-state call pays
    one dict lookup instead of the autotuner's per-call argument dicts and key building. The interpreter and
    ``CALCLIP_TRITON_AUTOTUNE=0`` always use the first (default) config.

    The timings persist in Triton's on-disk cache (``cache_results``; off with ``CALCLIP_TRITON_AUTOTUNE_CACHE=0``):
    in the first H200 comparison (docs/benchmarks-log.md, 2026-12-01) every FP8 process spent minutes more than BF16 on
    its first step, twelve processes compiling and timing the same configs at once.
    """

    def __init__(self, kernel, configs: list[triton.Config], key: list[str],
                 restore_value: list[str] | None = None) -> None:
        if not configs:  # a config table filtered to nothing for some shape: say so here, not as an IndexError
            raise ValueError(f"{kernel.__name__}: no autotune config to launch with")
        self.kernel = kernel
        self.default = configs[0]
        # restore_value: arguments the kernel accumulates into (a counter), restored after each timing run
        cache_results = os.environ.get("CALCLIP_TRITON_AUTOTUNE_CACHE", "1") != "0"
        self.autotuner = triton.autotune(configs=configs, key=key, restore_value=restore_value,
                                         cache_results=cache_results)(kernel)
        self.chosen: dict[tuple, tuple[dict, dict]] = {}  # key -> (config.kwargs, all launch kwargs)
        self._default_launch = (self.default.kwargs, self.default.all_kwargs())
        # what torch.compile records (wrap_triton): the configs to tune over, or the default alone
        self.traced = self.autotuner if _AUTOTUNE else triton.autotune(
            configs=[self.default], key=key, restore_value=restore_value)(kernel)

    @contextlib.contextmanager
    def pinned(self, config: triton.Config):
        """Until the block ends, this launcher's eager launches take ``config``, as CALCLIP_TRITON_AUTOTUNE=0 takes the
        default (it turns autotuning off for every launcher meanwhile): what a benchmark timing one config
        (``bench_quant.py --configs``) or a test checking one does. Not for torch.compile's traces (``traced``)."""
        global _AUTOTUNE
        saved = _AUTOTUNE, self._default_launch
        _AUTOTUNE, self._default_launch = False, (config.kwargs, config.all_kwargs())
        try:
            yield
        finally:
            _AUTOTUNE, self._default_launch = saved

    def launch(self, grid, key: tuple, soft_fp8: bool, *args, **kwargs) -> None:
        """grid: meta-parameter dict -> launch grid; key: the autotune key values plus the input dtypes.
        ``args``: every non-constexpr kernel parameter, positionally; ``kwargs``: the constexpr ones.
        Under torch.compile's tracing (calclip's triton ops, linear.py) the launch is recorded through
        ``wrap_triton``, so Inductor launches the kernel from its own generated code."""
        if is_traced(args[0]):
            wrap_triton(self.traced)[grid](*args, **kwargs)
            return
        launch = self._default_launch if soft_fp8 or not _AUTOTUNE else self.chosen.get(key)
        if launch is None:
            self.autotuner[grid](*args, **kwargs)
            best = self.autotuner.best_config
            self.chosen[key] = (best.kwargs, best.all_kwargs())
            return
        meta, config_kwargs = launch
        if soft_fp8 or not _FAST_LAUNCH:
            self.kernel[grid(meta)](*args, **kwargs, **config_kwargs)
            return
        _fast_launch(self.kernel, grid(meta), args, kwargs, config_kwargs)


# Triton's JITFunction.run re-binds and re-specializes every argument, looks the kernel up and checks globals on
# every call: host time on every launch, the largest part of FP8BlockLinear's host time on the
# H200 host (docs/benchmarks-log.md). Once a launch has compiled, later launches with the same specialization call
# the compiled kernel's C launcher directly. The key holds everything Triton specializes on: each tensor's dtype and
# 16-byte alignment, each int's ==1 / %16 / 64-bit class, the constexpr values and the launch options.
_FAST_LAUNCH = os.environ.get("CALCLIP_TRITON_FAST_LAUNCH", "1") != "0"
_compiled_launches: dict[tuple, tuple] = {}


_MAX_LAUNCH_ENTRIES = 1 << 14  # one per distinct argument tuple (shapes, strides); cleared when full


def _launch_hook(hook):
    """A Triton launch hook, or None when there is none to call. Triton 3.6 keeps each hook in a ``HookChain`` that
    exists even when empty, and its own launch path then builds the launch metadata and calls both empty chains from
    C on every launch; calclip's passes None instead, as Triton does where no hook was ever set."""
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


def _launch_key(kernel, device: int, args: tuple, kwargs: dict, config_kwargs: dict) -> tuple:
    """The exact int and float arguments (shapes, strides, fp32 scalars) and each tensor's dtype and address mod 16:
    a finer key than Triton's specialization (==1, %16 for ints; none for floats), so a hit always means Triton
    would have picked this very kernel. Anything else is refused by name: a key that ignored it could reuse the
    wrong kernel. (One comprehension: this runs on every launch, host time the direct launch exists to save.)"""
    try:
        parts = [a if type(a) is int else (float, a) if type(a) is float else (a.dtype, a.data_ptr() & 15)
                 for a in args]  # (float, a): 1 and 1.0 compile to different kernels
    except AttributeError:
        index, a = next((i, a) for i, a in enumerate(args) if type(a) not in (int, float)
                        and not isinstance(a, torch.Tensor))
        raise TypeError(f"{getattr(kernel, '__name__', kernel)}: argument {index} ({kernel.arg_names[index]}) is a "
                        f"{type(a).__name__}; the fast launch keys ints, floats and tensors only") from None
    return (kernel, device, id(config_kwargs), *kwargs.values(), *parts)  # id: _fast_launch keeps the dict alive


def _constexpr_values(kernel, n_args: int, kwargs: dict, config_kwargs: dict) -> tuple:
    """The values the compiled kernel's C launcher takes after the arguments: every parameter past the first
    ``n_args`` (calclip's kernels declare their constexprs last), by name from the launch's and the config's
    keywords. A constexpr neither names raises KeyError: Triton's own launch would have used its default, which the
    direct path cannot see (tests/fp8/conftest.py binds every CPU launch this way, for every config of its table)."""
    merged = {**kwargs, **config_kwargs}
    return tuple(merged[n] for n in kernel.arg_names[n_args:])


def _fast_launch(kernel, grid: tuple, args: tuple, kwargs: dict, config_kwargs: dict) -> None:
    device = torch.cuda.current_device()  # Triton launches on the current device too
    key = _launch_key(kernel, device, args, kwargs, config_kwargs)
    entry = _compiled_launches.get(key)
    if entry is None:
        if len(_compiled_launches) >= _MAX_LAUNCH_ENTRIES:
            _compiled_launches.clear()
        compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs, **config_kwargs)  # compiles and launches
        # The entry holds config_kwargs: the key has its id, and CPython gives a freed dict's address to the next
        # dict at once, so a config dict made per launch and dropped (a test or sweep pinning one config after
        # another) would otherwise find the previous config's kernel under its own key and run that instead.
        _compiled_launches[key] = (compiled, _constexpr_values(kernel, len(args), kwargs, config_kwargs), config_kwargs)
        return
    compiled, constexprs, _ = entry
    enter, leave = _launch_hook(knobs.runtime.launch_enter_hook), _launch_hook(knobs.runtime.launch_exit_hook)
    stream = torch._C._cuda_getCurrentRawStream(device)
    hooked = enter is not None or leave is not None
    metadata = compiled.launch_metadata(grid, stream, *args, *constexprs) if hooked else None
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave,
                 *args, *constexprs)
