"""Every Triton launch the CPU tests run (under the interpreter) is also keyed as the GPU's direct launch path keys
it (``kernels.launch._launch_key``), so an argument that path cannot key (a float scalar once, 2026-12-05: every
ragged-token FP8 forward failed on the H100 and nowhere here) fails here too, not first on a GPU."""

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
            launch._launch_key(self.kernel, -1, args, kwargs, self._default_launch[1])
        return original(self, grid, key, soft_fp8, *args, **kwargs)

    monkeypatch.setattr(launch._Tuned, "launch", checked)
    yield
