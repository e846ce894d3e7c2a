"""The weight quantizations a piece of code makes: calclip.fp8.quant's weight quantizers, patched for one test to
record each call by name before running it."""

from calclip.fp8 import quant

WEIGHT_QUANTIZERS = ("requantize_128x128_", "quantize_128x128")  # a layer's in-place refresh, and the unfused one


def count_weight_quantizations(monkeypatch) -> list[str]:
    """A list that grows by the function's name at every later call of a weight quantizer (until the test ends)."""
    calls: list[str] = []
    for name in WEIGHT_QUANTIZERS:
        original = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    return calls
