"""The quantizer dispatch (calclip.fp8.quant): a machine whose Triton kernels cannot be imported runs the torch
reference, and says so once, naming the import error."""

import sys
import warnings

import calclip.fp8
from calclip.fp8 import quant


def test_unimportable_kernels_fall_back_to_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "calclip.fp8.kernels", None)  # `import calclip.fp8.kernels` now raises
    monkeypatch.delattr(calclip.fp8, "kernels", raising=False)  # (a previous import left the attribute)
    monkeypatch.setattr(quant, "_triton_module", quant._UNSET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert quant.triton_kernels() is None
        assert quant.triton_kernels() is None  # decided once: no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "cannot be imported (ModuleNotFoundError: import of calclip.fp8.kernels halted" in messages[0]
    assert "torch reference" in messages[0]
    assert "triton>=3.4" in messages[0]
