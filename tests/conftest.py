"""Suite-wide setup.

Without CUDA, Triton's interpreter runs calclip's Triton kernels on CPU tensors, so tests/fp8/test_triton.py
checks them against the torch reference in CI too (the variable must be set before triton is imported).
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
