"""Suite-wide setup.

Without CUDA, Triton's interpreter runs calclip's Triton kernels on CPU tensors, so tests/fp8/test_triton.py
checks them against the torch reference in CI too (the variable must be set before triton is imported).
"""

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Property tests draw new examples on every run by default; CI pins the seed (same number of examples) so a
# red CI run is reproducible: HYPOTHESIS_PROFILE=ci, which .ci/run sets.
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:  # hypothesis is a test extra
    pass


@pytest.fixture
def fresh_dynamo():
    """A clean Dynamo for a test that counts what it compiles: caches reset before and after, and the process-wide
    counters (which ``torch._dynamo.reset()`` leaves to earlier tests) cleared."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
