"""Every Triton launch the CPU tests run (under the interpreter) is also keyed as the GPU's direct launch path keys
it (``kernels.launch._launch_key``), so an argument that path cannot key (a float scalar once, 2026-12-05: every
ragged-token FP8 forward failed on the H100 and nowhere here) fails here too, not first on a GPU; and its constexprs
are bound as that path binds them (``_constexpr_values``), with the table's default and with every config the
autotuner may pick (a constexpr left to its default, 2026-12-06: every eager FP8 launch failed on the H100 with
KeyError 'DIV_FREE')."""

import inspect

import pytest


@pytest.fixture(autouse=True)
def _launch_args_keyable_by_the_fast_launch(monkeypatch):
    try:
        from calclip.fp8.kernels import launch
    except ImportError:  # no Triton: nothing launches
        yield
        return
    original = launch._Tuned.launch

    def checked(self, grid, key, soft_fp8, *args, **kwargs):
        if not launch.is_traced(args[0]):
            name = getattr(self.kernel, "__name__", self.kernel)
            launch._launch_key(self.kernel, -1, args, kwargs, self._default_launch[1])
            params = inspect.signature(self.kernel.fn).parameters
            late = [n for n in self.kernel.arg_names[len(args):] if "constexpr" not in str(params[n].annotation)]
            assert not late, f"{name}: {late} after the {len(args)} arguments are not constexprs"
            for config in (self.default, *self.autotuner.configs):
                try:
                    launch._constexpr_values(self.kernel, len(args), kwargs, config.all_kwargs())
                except KeyError as missing:
                    raise AssertionError(f"{name}: the direct launch finds no value for constexpr {missing} "
                                         f"(config {config.kwargs})") from None
        return original(self, grid, key, soft_fp8, *args, **kwargs)

    monkeypatch.setattr(launch._Tuned, "launch", checked)
    yield
