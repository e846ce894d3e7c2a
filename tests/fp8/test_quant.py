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


def test_the_implementation_is_chosen_once_per_device_type_and_block(monkeypatch):
    """kernel_table decides which implementation serves each quantizer once per (device type, block): CPU tensors
    and non-128 blocks get the reference (None), CUDA the kernels' functions; later calls reuse the table."""
    import types

    import torch

    fake = types.SimpleNamespace(**{name: object() for name in quant.QUANTIZER_NAMES})
    asked = []
    monkeypatch.setattr(quant, "_kernel_tables", {})
    monkeypatch.setattr(quant, "triton_kernels", lambda: asked.append(1) or fake)
    cuda = quant.kernel_table("cuda", 128)
    assert cuda == {name: getattr(fake, name) for name in quant.QUANTIZER_NAMES}
    assert quant.kernel_table("cuda", 128) is cuda and asked == [1]  # chosen once, the kernels not asked again
    assert set(quant.kernel_table("cuda", 64).values()) == {None}  # the kernels serve block 128 only
    assert set(quant.kernel_table("cpu", 128).values()) == {None} and asked == [1]
    x = torch.zeros(2, 128)
    assert quant._impl(x, "quantize_1x128", 128) is quant.reference.quantize_1x128
