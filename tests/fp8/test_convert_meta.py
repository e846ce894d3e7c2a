"""quantize_model on a meta-device model: a clear error if called before materialization, exact FP8 after it."""

import warnings

import pytest
import torch

from calclip.fp8 import quantize_model
from calclip.fp8.linear import FP8BlockLinear
from tests.fixtures import build_tiny_model, build_tiny_tokenizer


def test_meta_model_raises_clearly_until_materialized_then_matches_a_converted_real_model():
    tokenizer = build_tiny_tokenizer()
    reference = build_tiny_model(tokenizer)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = type(reference)(reference.config)
    quantize_model(model)
    assert isinstance(model.model.layers[0].mlp.up_proj, FP8BlockLinear)
    ids = torch.randint(0, len(tokenizer), (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"still have their weights on the meta device: materialize the model"):
        model(input_ids=ids)

    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():  # non-persistent buffers (rotary inv_freq) are not in the state dict
        for name, buffer in reference.named_buffers():
            model.get_buffer(name).copy_(buffer)
    quantize_model(reference)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same FP8 computation on the same weights
    assert "_calclip_meta_guard" not in model.__dict__  # the guard removed itself: no per-call cost afterwards
    model(input_ids=ids).logits.sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
