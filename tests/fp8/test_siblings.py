"""Sibling groups (calclip.fp8.siblings, Fp8Config.decode_group_siblings): one fused decode launch for a decoder
layer's q/k/v and one for gate/up, with the same codes, output bits and non-finite count as each linear alone.

Runs the fused kernel under Triton's interpreter on CPU (TRITON_INTERPRET=1, set by conftest.py without CUDA).
"""

import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="triton is not installed")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="CPU test of the fused kernel under the interpreter")

from calclip.fp8 import Fp8Config, quantize_model  # noqa: E402
from calclip.fp8 import kernels as tk  # noqa: E402
from calclip.fp8.linear import FP8BlockLinear, pop_nonfinite_count  # noqa: E402
from calclip.fp8.reference import quantize_128x128  # noqa: E402
from calclip.fp8.shadow import bf16_shadow  # noqa: E402
from calclip.fp8.siblings import SiblingGroup  # noqa: E402
from calclip.fp8.weight_codes import fp8_layers  # noqa: E402

NAN = float("nan")


class _Attention(nn.Module):
    """q/k/v reading one x, as a Llama attention does; widths with ragged 128-blocks (SmolLM2's 576 / 192)."""

    def __init__(self, k=200, nq=300, nkv=70, bias=False):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(k, nq, bias=bias), nn.Linear(k, nkv, bias=bias)
        self.v_proj = nn.Linear(k, nkv, bias=bias)
        self.o_proj = nn.Linear(nq, k, bias=bias)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(q * (k.sum(-1, keepdim=True) + v.mean(-1, keepdim=True)))


def _pair(max_m=16, seed=0, bias=False):
    """The same module converted without and with sibling groups (fused decode on in both)."""
    torch.manual_seed(seed)
    base = nn.Sequential(_Attention(bias=bias))
    plain = quantize_model(_copy(base), Fp8Config(decode_fused_max_m=max_m))
    grouped = quantize_model(_copy(base), Fp8Config(decode_fused_max_m=max_m, decode_group_siblings=True))
    return plain, grouped


def _copy(module):
    import copy

    return copy.deepcopy(module)


class _Launches:
    def __init__(self, monkeypatch):
        self.calls = []
        real = tk.fp8_linear_decode_unchecked

        def counted(x2, qw, *args, **kwargs):
            self.calls.append((qw.shape[0], kwargs.get("members", 1)))
            return real(x2, qw, *args, **kwargs)

        monkeypatch.setattr(tk, "fp8_linear_decode_unchecked", counted)


def _bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def test_one_launch_for_q_k_v_with_the_same_outputs_and_codes(monkeypatch):
    plain, grouped = _pair()
    attention = grouped[0]
    group = attention.q_proj._fp8_group
    assert isinstance(group, SiblingGroup) and group.members == [attention.q_proj, attention.k_proj,
                                                                   attention.v_proj]
    assert attention.o_proj._fp8_group is None and group.offsets == [0, 384, 512] and group.rows == 640
    launches = _Launches(monkeypatch)
    x = torch.randn(5, 200)
    x[3, 17] = NAN  # a non-finite input row: every sibling's output row is NaN, and each counts it
    with torch.no_grad():
        y_plain, y_grouped = plain(x), grouped(x)
    assert launches.calls == [(300, 1), (70, 1), (70, 1), (200, 1), (640, 3), (200, 1)]  # 4 launches, not 7
    assert torch.equal(_bits(y_plain), _bits(y_grouped))
    for name in ("q_proj", "k_proj", "v_proj"):
        a, b = getattr(plain[0], name), getattr(attention, name)
        assert torch.equal(a._fp8_qw.view(torch.uint8), b._fp8_qw.view(torch.uint8)) and torch.equal(a._fp8_sw,
                                                                                                     b._fp8_sw)
        q_ref, s_ref = quantize_128x128(b.weight.detach())
        assert torch.equal(b._fp8_qw.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(b._fp8_sw, s_ref)
    assert int(pop_nonfinite_count(plain)) == int(pop_nonfinite_count(grouped)) == 4  # q, k, v, o: one row each
    assert group._pending is None  # every sibling took its output


def test_a_weight_with_a_nan_block_counts_as_it_does_alone():
    plain, grouped = _pair(seed=1)
    for model in (plain, grouped):
        with torch.no_grad():
            model[0].k_proj.weight[5, 150] = NAN  # k's weight has a non-finite block: every row counts for k
    x = torch.randn(6, 200)
    x[0, 0] = NAN
    with torch.no_grad():
        y_plain, y_grouped = plain(x), grouped(x)
    assert torch.equal(_bits(y_plain), _bits(y_grouped))
    # q and v: the bad row; k: all 6 rows; o: every row (its input is NaN where k's sum is)
    assert int(pop_nonfinite_count(plain)) == int(pop_nonfinite_count(grouped))
    with torch.no_grad():
        for model in (plain, grouped):
            model[0].k_proj.weight[5, 150] = 0.25  # finite again: the group's count of bad weights follows
        x2 = torch.randn(6, 200)
        assert torch.equal(_bits(plain(x2)), _bits(grouped(x2)))
    assert int(pop_nonfinite_count(plain)) == int(pop_nonfinite_count(grouped)) == 0


@pytest.mark.slow
def test_training_steps_refresh_the_group_and_leave_training_forwards_alone(monkeypatch):
    """Grad-enabled forwards run each linear as before (their backward needs saved codes); after optimizer steps
    the grouped decode uses the new codes, written into the group's buffers in place."""
    plain, grouped = _pair(seed=2, bias=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, grouped)]
    launches = _Launches(monkeypatch)
    x = torch.randn(4, 200)
    stacked = grouped[0].q_proj._fp8_group
    for _ in range(2):
        for model, opt in zip((plain, grouped), opts):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert launches.calls == []
        with torch.no_grad():
            assert torch.equal(_bits(plain(x)), _bits(grouped(x)))
        qw = stacked.qw
        assert grouped[0].k_proj._fp8_qw.data_ptr() == qw.data_ptr() + 384 * 200
        launches.calls.clear()
    for a, b in zip(plain.parameters(), grouped.parameters()):
        assert torch.equal(a, b)


def test_a_sibling_called_with_another_input_gets_that_inputs_output(monkeypatch):
    """Outputs are kept for the same tensor only: another input, or the same tensor changed in place, launches the
    group again (a new x: the siblings' calls with it follow), and every output is the one computed alone."""
    _, grouped = _pair(seed=3)
    attention = grouped[0]
    launches = _Launches(monkeypatch)
    x, other = torch.randn(3, 200), torch.randn(3, 200)
    with torch.no_grad():
        q = attention.q_proj(x)
        k_other = attention.k_proj(other)  # not the x the last launch saw
        v_other = attention.v_proj(other)  # kept from k's launch
        k = attention.k_proj(x)
        x.add_(1.0)  # x changed in place: what k's launch left for v is stale
        v = attention.v_proj(x)
    assert launches.calls == [(640, 3), (640, 3), (640, 3), (640, 3)]
    alone = FP8BlockLinear.from_linear(attention.k_proj.to_linear(), Fp8Config(decode_fused_max_m=16))
    v_alone = FP8BlockLinear.from_linear(attention.v_proj.to_linear(), Fp8Config(decode_fused_max_m=16))
    with torch.no_grad():
        assert torch.equal(_bits(k_other), _bits(alone(other)))
        assert torch.equal(_bits(k), _bits(alone(x - 1.0)))
        assert torch.equal(_bits(v), _bits(v_alone(x)))
        assert torch.equal(_bits(v_other), _bits(v_alone(other)))
    assert q.shape == (3, 300)


def test_a_sibling_whose_weight_is_not_whole_runs_alone(monkeypatch):
    """ZeRO-3 gathers a module's parameters in its own call: while q runs, k's weight may be a partition. The group
    then does not refresh k's codes from it; each sibling runs alone."""
    plain, grouped = _pair(seed=5)
    launches = _Launches(monkeypatch)
    attention = grouped[0]
    whole = attention.k_proj.weight
    x = torch.randn(3, 200)
    with torch.no_grad():
        attention.k_proj.weight = nn.Parameter(torch.empty(0))  # a partitioned parameter's local shape
        q = attention.q_proj(x)
        attention.k_proj.weight = whole
        assert torch.equal(_bits(q), _bits(plain[0].q_proj(x)))
    assert launches.calls == [(300, 1), (300, 1)]


def test_shadow_compiled_and_large_calls_run_each_sibling(monkeypatch):
    plain, grouped = _pair(max_m=4, seed=4)
    launches = _Launches(monkeypatch)
    with torch.no_grad():
        x = torch.randn(9, 200)  # 9 rows > max_m 4: the two-launch path, no group
        assert torch.equal(_bits(plain(x)), _bits(grouped(x)))
        with bf16_shadow(grouped), bf16_shadow(plain):
            assert torch.equal(plain(x[:2]), grouped(x[:2]))
    assert launches.calls == []


def test_grouping_needs_the_fused_decode_and_one_config():
    with pytest.raises(ValueError, match="decode_group_siblings"):
        Fp8Config(decode_fused_max_m=0, decode_group_siblings=True)
    model = nn.Sequential(_Attention())
    model[0].v_proj = nn.Linear(100, 70)  # another input width: not siblings
    quantize_model(model, Fp8Config(decode_group_siblings=True))
    assert all(m._fp8_group is None for m in fp8_layers(model))
    sharded = nn.Sequential(_Attention())  # cache_weights=False: the trainer's setting for sharded parameters
    quantize_model(sharded, Fp8Config(decode_group_siblings=True, cache_weights=False))
    assert all(m._fp8_group is None for m in fp8_layers(sharded))
    llama_like = nn.Sequential(_Attention())
    quantize_model(llama_like, Fp8Config(decode_group_siblings=True, keep_patterns=("v_proj",)))
    assert all(m._fp8_group is None for m in fp8_layers(llama_like))  # v stays BF16: no complete set


def test_trainer_config_field(tmp_path):
    pytest.importorskip("trl")
    from calclip.trainers.config import CalibratedGRPOConfig
    from tests.fixtures import tiny_training_args

    assert tiny_training_args(CalibratedGRPOConfig, tmp_path, fp8=True).fp8_decode_group_siblings is False
    assert tiny_training_args(CalibratedGRPOConfig, tmp_path, fp8=True, fp8_decode_group_siblings=True)
    with pytest.raises(ValueError, match="fp8_decode_group_siblings must be a bool"):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, fp8=True, fp8_decode_group_siblings="yes")
    with pytest.raises(ValueError, match="fp8_decode_group_siblings groups fused decode calls"):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, fp8=True, fp8_decode_group_siblings=True,
                           fp8_decode_fused_max_m=0)


@pytest.mark.slow
def test_hf_generate_with_sibling_groups_equals_without(monkeypatch):
    """A tiny Llama (ragged widths) generating greedily: with groups each decode step launches 4 fused kernels per
    layer instead of 7, and logits, tokens and non-finite counts are bit-equal."""
    pytest.importorskip("transformers")
    from tests.fixtures import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    models = {}
    for grouped in (False, True):
        model = build_tiny_model(tokenizer, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, seed=0).eval()
        models[grouped] = quantize_model(model, Fp8Config(decode_fused_max_m=4, decode_group_siblings=grouped))
    prompt = torch.randint(3, len(tokenizer), (3, 5), generator=torch.Generator().manual_seed(0))
    out = {}
    for grouped, model in models.items():
        launches = _Launches(monkeypatch)
        with torch.no_grad():
            result = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                    min_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
        out[grouped] = (result.sequences, torch.stack(result.logits), len(launches.calls))
        monkeypatch.undo()
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(_bits(out[True][1]), _bits(out[False][1]))
    decode_steps, layers = 2, 2  # the 15-row prefill is not fused; 3 rows per decode step
    assert out[False][2] == decode_steps * layers * 7 and out[True][2] == decode_steps * layers * 4
    assert [int(pop_nonfinite_count(m)) for m in models.values()] == [0, 0]
