"""compile_layers: the policy's decoder layers compiled one by one for the training forwards, rollouts eager.

On CPU with backend aot_eager (the same Dynamo/AOTAutograd tracing as Inductor, without generating kernels): the
auto rule, the blocks found, that a short run trains with one traced layer graph per grad mode while generate stays
eager, and that the compiled forward's log-probs equal the eager ones bit for bit. On the GPU (Inductor) in
tests/rollout/test_gpu_compiled_layers.py.
"""

import warnings

import pytest
import torch
from torch import nn

from calclip.fp8 import compile_repeated_blocks
from calclip.fp8.regional_compile import compiled_block_count, eager_blocks, repeated_blocks
from calclip.rollout.compiled_layers import (BUCKET_GRAPHS_PER_LENGTH, BUCKETED_RECOMPILE_LIMIT, bucket_length,
                                             bucket_overflow, pad_to_bucket, resolve_compile_layers,
                                             resolve_layer_shapes)
from calclip.trainers.config import CalibratedGRPOConfig
from tests.fixtures import build_tiny_model, build_tiny_tokenizer, tiny_trainer, tiny_training_args, train_and_check

AUTO = dict(device_type="cuda", fp8=True, torch_compile=False, compile_generation=False,
            gradient_checkpointing=False, sharded=False)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def test_auto_is_on_for_fp8_and_bf16_policies_on_cuda_only():
    assert resolve_compile_layers(None, **AUTO) == (True, "compile_layers auto: on (FP8 policy on CUDA)")
    # BF16 gets the same compilation (a fair baseline); the FP8-only options do not apply to it
    bf16 = {**AUTO, "fp8": False}
    assert resolve_compile_layers(None, **bf16) == (True, "compile_layers auto: on (BF16 policy on CUDA)")
    assert resolve_compile_layers(None, **bf16, fp8_backward="bf16")[0]
    ruled_out = [({"device_type": "cpu"}, "cpu"), ({"torch_compile": True}, "torch_compile"),
                 ({"compile_generation": True}, "decode step"), ({"gradient_checkpointing": True}, "checkpointing"),
                 ({"sharded": True}, "sharded")]
    for change, reason in ruled_out:
        on, why = resolve_compile_layers(None, **{**bf16, **change})
        assert not on and reason in why, (change, why)
    for change, reason in [({"device_type": "cpu"}, "cpu"),
                           ({"torch_compile": True}, "torch_compile"), ({"compile_generation": True}, "decode step"),
                           ({"gradient_checkpointing": True}, "checkpointing"), ({"sharded": True}, "sharded"),
                           ({"fp8_backward": "bf16"}, "fp8_backward")]:
        on, why = resolve_compile_layers(None, **{**AUTO, **change})
        assert not on and reason in why, (change, why)
    assert resolve_compile_layers(True, **{**AUTO, "device_type": "cpu", "fp8": False})[0]  # the user's choice
    assert not resolve_compile_layers(False, **AUTO)[0]


@pytest.mark.parametrize("field", ["torch_compile", "compile_generation"])
def test_explicit_true_with_a_whole_model_compile_raises_naming_both(field):
    with pytest.raises(ValueError, match=f"compile_layers.*{field}|{field}.*compile_layers"):
        resolve_compile_layers(True, **{**AUTO, field: True})


@pytest.mark.parametrize("value", ["yes", 1])
def test_config_rejects_a_non_bool_compile_layers(tmp_path, value):
    with pytest.raises(ValueError, match="compile_layers must be a boolean"):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, compile_layers=value)
    with pytest.raises(ValueError, match="compile_layers_backend"):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, compile_layers_backend=" ")


def test_bucket_lengths_cover_every_length_with_little_padding_and_few_graphs():
    lengths = [bucket_length(n) for n in range(1, 9000)]
    for n, padded in enumerate(lengths, start=1):
        assert padded >= n and padded % 16 == 0, (n, padded)
        assert padded - n < max(16, n / 16 + 1e-9), (n, padded)  # < 16 tokens, or at most 1/16 more past 256
        assert bucket_length(padded) == padded  # a bucket length is its own bucket
    assert lengths == sorted(lengths)  # a longer sequence never gets a shorter bucket
    for low in (256, 1024, 4096):  # 16 lengths from one power of two to the next (a static graph each)
        assert len({bucket_length(n) for n in range(low + 1, 2 * low + 1)}) == 16
    assert [bucket_length(n) for n in (1, 17, 276, 1300, 2048, 2049)] == [16, 32, 288, 1344, 2048, 2176]
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="tokens must be an integer >= 1"):
            bucket_length(bad)


def test_pad_to_bucket_pads_ids_and_mask_on_the_right():
    ids = torch.arange(1, 41).reshape(2, 20)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded prompt keeps its mask
    padded_ids, padded_mask, pad = pad_to_bucket(ids, mask, pad_token_id=7)
    assert pad == 12 and padded_ids.shape == padded_mask.shape == (2, 32)
    assert torch.equal(padded_ids[:, :20], ids) and (padded_ids[:, 20:] == 7).all()
    assert torch.equal(padded_mask[:, :20], mask) and (padded_mask[:, 20:] == 0).all()
    same = pad_to_bucket(ids[:, :16], mask[:, :16], pad_token_id=7)  # already a bucket length: untouched
    assert same[0] is not None and same[2] == 0 and same[0].shape == (2, 16)
    with pytest.raises(ValueError, match="input_ids and attention_mask"):
        pad_to_bucket(ids, mask[:, :10], pad_token_id=0)


def test_layer_shapes_auto_buckets_torchao_recipes_only():
    assert resolve_layer_shapes(None, fp8=True, recipe="tensorwise")[0] == "bucketed"
    assert resolve_layer_shapes(None, fp8=True, recipe="rowwise")[0] == "bucketed"
    assert resolve_layer_shapes(None, fp8=True, recipe="blockwise")[0] == "dynamic"
    assert resolve_layer_shapes(None, fp8=False, recipe="tensorwise")[0] == "dynamic"  # a BF16 policy
    assert resolve_layer_shapes("bucketed", fp8=False, recipe=None) == ("bucketed", "compile_layers_shapes: bucketed")
    assert resolve_layer_shapes("dynamic", fp8=True, recipe="tensorwise")[0] == "dynamic"
    with pytest.raises(ValueError, match="compile_layers_shapes must be one of"):
        resolve_layer_shapes("static", fp8=True, recipe="blockwise")


@pytest.mark.parametrize("value", ["static", 1, True])
def test_config_rejects_an_unknown_compile_layers_shapes(tmp_path, value):
    with pytest.raises(ValueError, match="compile_layers_shapes must be (one of|a string)"):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, compile_layers_shapes=value)


def test_repeated_blocks_are_the_outermost_lists_of_one_class():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # inside a block: compiled with it

    model = nn.Module()
    model.layers = nn.ModuleList([Layer(), Layer(), Layer()])
    model.heads = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # mixed classes: not a repeated block
    model.empty = nn.ModuleList()
    assert repeated_blocks(model) == list(model.layers)
    model.single = nn.ModuleList([nn.Linear(4, 4)])  # a one-layer model's layers
    assert repeated_blocks(model) == [*model.layers, model.single[0]]
    with pytest.raises(ValueError, match="Linear has no repeated blocks"):
        compile_repeated_blocks(nn.Linear(4, 4))


def test_a_mode_and_options_together_reach_inductor_as_options(monkeypatch):
    """torch.compile refuses mode and options together (RuntimeError); compile_repeated_blocks hands Inductor the
    mode's own options with the given ones over them, and leaves other backends' arguments as given."""
    calls = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: calls.append(kw))
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert compile_repeated_blocks(model, mode="max-autotune-no-cudagraphs",
                                   options={"emulate_precision_casts": True, "coordinate_descent_tuning": False}) == 2
    assert calls[0] == calls[1] == {"backend": "inductor", "dynamic": True, "mode": None, "options": {
        "max_autotune": True, "coordinate_descent_tuning": False, "emulate_precision_casts": True}}
    calls.clear()
    compile_repeated_blocks(model, mode="max-autotune-no-cudagraphs")
    compile_repeated_blocks(model, backend="aot_eager", mode="default", options={"a": 1})
    assert calls[0]["mode"] == "max-autotune-no-cudagraphs" and calls[0]["options"] is None
    assert calls[2]["mode"] == "default" and calls[2]["options"] == {"a": 1}
    with pytest.raises(RuntimeError, match="Either mode or options"):  # what torch.compile does with both
        torch.compile(nn.Linear(2, 2), mode="max-autotune-no-cudagraphs", options={"emulate_precision_casts": True})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise", "tensorwise", None],
                         ids=["fp8", "fp8-rowwise", "fp8-tensorwise", "bf16"])
def test_short_run_trains_compiled_layers_with_eager_rollouts(tokenizer, tmp_path, recipe):
    """Two optimizer steps of an FP8 policy of each recipe (torchao's rowwise / tensorwise too: compile_layers' auto
    turns them on), and of a BF16 one (the baseline gets the same compilation), with compile_layers (aot_eager):
    both layers run compiled, the parameters move, the metrics stay finite, and Dynamo traced the layer's forward
    once per grad mode (the training forward and the no-grad old log-probs), never generate's one-token decode
    calls."""
    if recipe in ("rowwise", "tensorwise"):
        pytest.importorskip("torchao.float8")
    fp8 = {"fp8": recipe is not None, **({"fp8_recipe": recipe} if recipe else {})}
    model = build_tiny_model(tokenizer, hidden_size=128, intermediate_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, tokenizer=tokenizer, model=model, **fp8, compile_layers=True,
                               compile_layers_backend="aot_eager")
        assert trainer._layers_compiled
        layers = trainer.model.model.layers
        assert compiled_block_count(trainer.model) == len(layers) == 2
        train_and_check(trainer)
    frames = torch._dynamo.utils.counters["frames"]
    assert 1 <= frames["ok"] <= 4, dict(frames)  # decode steps (one per token) would each add a frame

    # the compiled training forward gives the eager forward's log-probs, bit for bit
    ids = torch.randint(5, 40, (4, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    with torch.no_grad():
        compiled, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 8)
        with eager_blocks(trainer.model):
            eager, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 8)
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_auto_leaves_a_cpu_policy_eager(tokenizer, tmp_path, fp8):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, tokenizer=tokenizer, fp8=fp8)
    assert trainer.args.compile_layers is None and not trainer._layers_compiled
    assert compiled_block_count(trainer.model) == 0


def test_bucketed_layers_give_the_unpadded_log_probs_from_one_static_graph_per_bucket(tokenizer, tmp_path,
                                                                                      monkeypatch):
    """compile_layers_shapes bucketed (aot_eager, BF16 policy): the log-prob forward pads each sequence on the right
    to its bucket length, yet returns the log-probs and entropies of the unpadded forward, shaped as TRL expects;
    the layers compile static (Dynamo's recompile limit raised for the buckets), and every length of one bucket
    reuses that bucket's graph, where static shapes without the padding would compile one graph per length."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # both restored after the test
    monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 256)
    model = build_tiny_model(tokenizer, hidden_size=128, intermediate_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, tokenizer=tokenizer, model=model, fp8=False, compile_layers=True,
                               compile_layers_backend="aot_eager", compile_layers_shapes="bucketed")
    assert trainer._layers_compiled and trainer._layer_buckets
    assert torch._dynamo.config.recompile_limit == BUCKETED_RECOMPILE_LIMIT
    generator = torch.Generator().manual_seed(0)
    frames = torch._dynamo.utils.counters["frames"]
    with torch.no_grad():
        for tokens in (20, 23, 29):  # one bucket: 32
            ids = torch.randint(5, 40, (4, tokens), generator=generator)
            mask = torch.ones_like(ids)
            mask[0, :3] = 0  # a left-padded prompt
            mask[1, -2:] = 0  # a completion that ended early
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 8,
                                                                             compute_entropy=True)
            assert logps.shape == entropies.shape == (4, 8)
            if tokens == 20:
                graphs = frames["ok"]
                assert graphs >= 1
            trainer._layer_buckets = False  # the same forward, unpadded (eager: no graph for these lengths)
            with eager_blocks(trainer.model):
                plain, plain_entropies, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.model, ids, mask, 8, compute_entropy=True)
            trainer._layer_buckets = True
            # fp32 on CPU: SDPA over more (masked) keys may change the last bits of a sum (~3e-7 here); a wrong slice
            # or a pad seen by a real token is off by whole nats. (An FP8 policy turns such a last bit into another
            # activation code now and then: ~1e-3, as any change of batch composition does.)
            torch.testing.assert_close(logps, plain, rtol=0, atol=1e-5)
            torch.testing.assert_close(entropies, plain_entropies, rtol=0, atol=1e-5)
    assert frames["ok"] == graphs  # 23 and 29 tokens ran 20's graph (bucket 32); no recompile
    assert trainer._bucket_shapes == {(4, 32)} and not trainer._bucket_overflow_warned
    assert torch._dynamo.config.accumulated_recompile_limit == 2 * BUCKETED_RECOMPILE_LIMIT
    # past the shapes the limit holds graphs for, one warning naming the way out
    trainer._bucket_shapes |= {(1, 16 * n) for n in range(1, BUCKETED_RECOMPILE_LIMIT // BUCKET_GRAPHS_PER_LENGTH)}
    ids = torch.randint(5, 40, (4, 40), generator=generator)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="compile_layers_shapes: dynamic"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 8)
    assert trainer._bucket_overflow_warned


def test_bucket_overflow_warns_past_the_graphs_the_recompile_limit_holds():
    fits = BUCKETED_RECOMPILE_LIMIT // BUCKET_GRAPHS_PER_LENGTH
    assert fits >= 64  # four doublings of lengths (16 buckets each)
    assert bucket_overflow(1) is None and bucket_overflow(fits) is None
    message = bucket_overflow(fits + 1)
    assert f"{fits + 1} (batch, length) shapes" in message and "compile_layers_shapes: dynamic" in message
