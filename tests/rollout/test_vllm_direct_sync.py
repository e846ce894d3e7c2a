"""In-place weight syncs into a colocated engine once its layout is checked (calclip.rollout.vllm_direct_sync),
through TRL 1.16's own ``sync_weights``. The engine is a stand-in: an nn.Module with vLLM's parameter names (fused
qkv_proj / gate_up_proj, a padded vocabulary table) whose ``load_weights`` writes each incoming tensor where vLLM's
weight loaders put it (q, k, v stacked along dim 0; codes and block scales alike), written out here with its own
offsets rather than derived from calclip's layout rule."""

import logging

import pytest
import torch
from torch import nn

pytest.importorskip("trl.generation.vllm_generation")

from calclip.rollout.vllm_direct_sync import DirectSync  # noqa: E402
from calclip.rollout.vllm_sync import engine_fp8_mismatches, expected_engine_fp8_tensors  # noqa: E402
from tests.rollout.test_vllm_sync import fake_reload, make_generation, tiny_fp8_llama  # noqa: E402,F401

FP8 = torch.float8_e4m3fn
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# tiny_fp8_llama: hidden 256, intermediate 384, 4 heads of 64, 2 KV heads: q 256 rows, k and v 128 each
ROWS = {"q_proj": 256, "k_proj": 128, "v_proj": 128, "gate_proj": 384, "up_proj": 384}
OFFSETS = {"q_proj": 0, "k_proj": 256, "v_proj": 384, "gate_proj": 0, "up_proj": 384}
VOCAB_PADDED = 384  # the policy's 320 rows, padded as vLLM pads its vocabulary table


class FakeEngine(nn.Module):
    """vLLM's parameters for the policy, filled by ``load_weights`` like vLLM's loaders (``swap_kv``: a loader that
    puts v before k, i.e. a layout calclip's rule does not predict; ``scale_factor``: one that re-scales the block
    scales after loading, like a requantization)."""

    def __init__(self, policy, recorder, *, swap_kv=False, scale_factor=1.0, extra_qkv_rows=0):
        super().__init__()
        self.recorder, self.swap_kv, self.scale_factor = recorder, swap_kv, scale_factor
        self.store = nn.ParameterDict()
        self.names = {}
        fp8 = expected_engine_fp8_tensors(policy)
        for name, t in fp8.items():
            shape = list(t.shape)
            if ".qkv_proj." in name:
                shape[0] += extra_qkv_rows if name.endswith("weight") else extra_qkv_rows // 128
            value = torch.zeros(shape, dtype=FP8 if name.endswith(".weight") else torch.float32)
            self._add(name, value)
        for name, p in policy.named_parameters():
            module, _, short = name.rpartition(".")[0].rpartition(".")
            if short in ROWS or short in ("o_proj", "down_proj"):
                continue
            shape = list(p.shape)
            if "embed_tokens" in name or name.startswith("lm_head"):
                shape[0] = VOCAB_PADDED
            self._add(name, torch.zeros(shape, dtype=p.dtype))

    def _add(self, name, value):
        key = name.replace(".", "__")
        self.store[key] = nn.Parameter(value, requires_grad=False)
        self.names[name] = key

    def named_parameters(self, *args, **kwargs):  # vLLM's names, as the live model reports them
        return iter([(name, self.store[key]) for name, key in self.names.items()])

    def load_weights(self, weights):
        for name, t in weights:
            self.recorder.events.append(("load", name))
            module, _, leaf = name.rpartition(".")
            parent, _, short = module.rpartition(".")
            scale = leaf == "weight_scale_inv"
            if short in ROWS:
                fused = "qkv_proj" if short in PACKED["qkv_proj"] else "gate_up_proj"
                offset = OFFSETS[short]
                if self.swap_kv and short in ("k_proj", "v_proj"):
                    offset = 384 if short == "k_proj" else 256
                start = offset // 128 if scale else offset
                target = self.store[self.names[f"{parent}.{fused}.{leaf}"]]
                target.data[start:start + t.shape[0]] = t * self.scale_factor if scale else t
            else:
                target = self.store[self.names[name]]
                target.data[: t.shape[0]] = t * self.scale_factor if scale else t


def engine_gen(fake_reload, policy, **engine_options):
    gen = make_generation(policy, "colocate", fake_reload)
    engine = FakeEngine(policy, fake_reload, **engine_options)
    gen.llm.llm_engine.model_executor.driver_worker.model_runner.model = engine
    return gen, engine


def kinds(recorder):
    return [e[0] for e in recorder.events]


def bf16_params_match(engine, policy):
    params = dict(engine.named_parameters())
    compared = [n for n, _ in policy.named_parameters() if n in params and params[n].dtype != FP8]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(compared)
    return all(torch.equal(params[n].data[: policy.get_parameter(n).shape[0]], policy.get_parameter(n).data)
               for n in compared)


def step(policy, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)


def test_later_syncs_copy_in_place_once_the_engine_holds_every_tensor_as_loaded(fake_reload, caplog):
    policy = tiny_fp8_llama()
    gen, engine = engine_gen(fake_reload, policy)
    storage = {n: p.data.data_ptr() for n, p in engine.named_parameters()}
    with caplog.at_level(logging.INFO, logger="calclip.rollout.vllm_sync"):
        gen.sync_weights()  # TRL 1.16's own method
    first = kinds(fake_reload)
    assert first[0] == "init" and "finalize" in first and first[-1] == "reset" and "load" in first
    assert gen._direct_sync.verified and gen._direct_sync.reason is None
    assert "later syncs copy in place" in caplog.text
    assert engine_fp8_mismatches(engine, policy) == [] and bf16_params_match(engine, policy)

    for seed in (1, 2):  # optimizer steps: the codes and the BF16 tensors change
        step(policy, seed)
        assert engine_fp8_mismatches(engine, policy)  # the engine is stale before the sync
        fake_reload.events.clear()
        gen.sync_weights()
        assert kinds(fake_reload) == ["reset"]  # no reload, no load_weights: in-place copies only
        assert engine_fp8_mismatches(engine, policy) == [] and bf16_params_match(engine, policy)
    assert {n: p.data.data_ptr() for n, p in engine.named_parameters()} == storage  # the CUDA graphs' storage
    # the padding rows of the vocabulary tables are untouched
    assert not dict(engine.named_parameters())["model.embed_tokens.weight"].data[320:].any()


@pytest.mark.parametrize("options, why", [
    (dict(swap_kv=True), "model.layers.0.self_attn.k_proj.weight -> model.layers.0.self_attn.qkv_proj.weight: the "
                         "engine holds other values"),
    (dict(scale_factor=2.0), "weight_scale_inv -> "),
    (dict(extra_qkv_rows=128), "qkv_proj.weight: its shards fill 512 of 640 rows"),
])
def test_an_engine_with_another_layout_keeps_the_reload_and_says_why(fake_reload, caplog, options, why):
    policy = tiny_fp8_llama()
    gen, engine = engine_gen(fake_reload, policy, **options)
    with caplog.at_level(logging.WARNING, logger="calclip.rollout.vllm_sync"):
        gen.sync_weights()
    direct = gen._direct_sync
    assert not direct.verified and why in direct.reason
    assert "stays on vLLM's layerwise reload" in caplog.text
    step(policy, 1)
    fake_reload.events.clear()
    gen.sync_weights()
    later = kinds(fake_reload)
    assert later[0] == "init" and "finalize" in later and "load" in later  # every sync through the reload
    assert direct.reason is not None and not direct.verified  # checked once, not again


def test_direct_sync_off_reloads_every_time(fake_reload):
    policy = tiny_fp8_llama()
    gen, engine = engine_gen(fake_reload, policy)
    gen.fp8_direct_sync = False
    for seed in (0, 1):
        step(policy, seed)
        fake_reload.events.clear()
        gen.sync_weights()
        assert kinds(fake_reload)[0] == "init" and "load" in kinds(fake_reload)
    assert gen._direct_sync is None and engine_fp8_mismatches(engine, policy) == []


def test_a_new_engine_is_checked_again(fake_reload, monkeypatch):
    policy = tiny_fp8_llama()
    gen, _ = engine_gen(fake_reload, policy)
    gen.sync_weights()
    assert gen._direct_sync.verified
    monkeypatch.setattr(type(gen).__mro__[2], "_start_engine", lambda self: None)  # ColocateEngineMixin's
    gen.fp8_check_vllm_shapes = False
    gen._start_engine()
    assert gen._direct_sync is None


def test_copy_refuses_before_verify_and_names_a_tensor_the_verified_sync_did_not_hold():
    direct = DirectSync(PACKED)
    param = torch.zeros(4, 3)
    with pytest.raises(RuntimeError, match="before a successful verify"):
        direct.copy({"w": param}, [("w", torch.ones(4, 3))])
    assert direct.verify({"w": param}, [("w", torch.zeros(4, 3))])
    with pytest.raises(RuntimeError, match="extra.weight was not in the sync"):
        direct.copy({"w": param}, [("extra.weight", torch.ones(4, 3))])


def test_verify_places_shards_that_arrive_before_their_predecessors():
    q, k, v = torch.arange(6.).view(2, 3), torch.arange(6., 9.).view(1, 3), torch.arange(9., 12.).view(1, 3)
    fused = torch.cat([q, k, v])
    direct = DirectSync(PACKED)
    assert direct.verify({"a.qkv_proj.weight": fused}, [("a.v_proj.weight", v), ("a.q_proj.weight", q),
                                                         ("a.k_proj.weight", k)])
    assert direct.slots["a.v_proj.weight"].start == 3 and direct.slots["a.k_proj.weight"].start == 2
    assert not DirectSync(PACKED).verify({"a.qkv_proj.weight": fused}, [("a.q_proj.weight", q),
                                                                          ("a.k_proj.weight", k)])
    missing = DirectSync(PACKED)
    missing.verify({"a.qkv_proj.weight": fused}, [("a.q_proj.weight", q), ("a.k_proj.weight", k)])
    assert missing.reason == "a.qkv_proj.weight: shards ['v_proj'] are not in the sync"
    nan = DirectSync(PACKED)  # bits, not values: a NaN held where a NaN was synced is equal
    assert nan.verify({"w": torch.tensor([[float("nan"), 1.0]])}, [("w", torch.tensor([[float("nan"), 1.0]]))])
    wrong_dtype = DirectSync(PACKED)
    assert not wrong_dtype.verify({"w": torch.zeros(2, 2, dtype=torch.bfloat16)}, [("w", torch.zeros(2, 2))])
    assert "engine dtype torch.bfloat16, sync dtype torch.float32" in wrong_dtype.reason


def test_engine_name_maps_shards_to_their_fused_layer_and_leaves_the_rest():
    from calclip.rollout.vllm_direct_sync import engine_name

    assert engine_name("model.layers.0.self_attn.k_proj.weight", PACKED) == (
        "model.layers.0.self_attn.qkv_proj.weight", "qkv_proj", 1)
    assert engine_name("model.layers.3.mlp.up_proj.weight_scale_inv", PACKED) == (
        "model.layers.3.mlp.gate_up_proj.weight_scale_inv", "gate_up_proj", 1)
    assert engine_name("model.layers.0.self_attn.o_proj.weight", PACKED) == (
        "model.layers.0.self_attn.o_proj.weight", None, 0)
    assert engine_name("q_proj.weight", PACKED) == ("qkv_proj.weight", "qkv_proj", 0)
    assert engine_name("model.norm.weight", PACKED) == ("model.norm.weight", None, 0)
