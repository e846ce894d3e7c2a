"""compile_layers on the GPU: Inductor compiles the FP8 policy's decoder layers by default (auto), and the BF16
policy's (the fair baseline), the trainer trains with them, rollouts stay eager, and the compiled log-prob forward
stays close to the eager one."""

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from calclip.fp8.regional_compile import compiled_block_count, eager_blocks  # noqa: E402
from tests.fixtures import build_tiny_model, build_tiny_tokenizer, tiny_trainer, train_and_check  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_auto_compiles_the_layers_and_trains(tmp_path, fp8):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=256, intermediate_size=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, tokenizer=tokenizer, model=model, fp8=fp8, use_cpu=False, bf16=True,
                               max_steps=4)
        assert trainer.args.compile_layers is None and trainer._layers_compiled  # auto: FP8 and BF16 on CUDA
        assert compiled_block_count(trainer.model) == len(trainer.model.model.layers)
        train_and_check(trainer)
    frames = torch._dynamo.utils.counters["frames"]
    assert 1 <= frames["ok"] <= 4, dict(frames)  # one graph per grad mode; decode calls stay eager

    # after the optimizer steps: the compiled forward reads the refreshed codes, as the eager one does
    ids = torch.randint(5, 40, (4, 40), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        compiled, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 16)
        with eager_blocks(trainer.model):
            eager, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 16)
    gap = (compiled - eager).abs()
    print(f"compiled vs eager log-probs: max {gap.max().item():.4g}, mean {gap.mean().item():.4g} nats")
    assert gap.mean().item() < 0.02 and gap.max().item() < 0.25, (gap.mean().item(), gap.max().item())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_recipes_train_on_bucketed_static_layers(tmp_path, recipe):
    """torchao's recipes: compile_layers_shapes auto buckets them, the trainer trains on static graphs (every length
    it met a bucket length, at most a few graphs per length: with grad, an input without grad, no grad, and a batch
    without padding, whose attention_mask transformers drops), and the bucketed compiled log-probs stay close to the
    eager, unpadded ones."""
    pytest.importorskip("torchao.float8")
    from calclip.rollout.compiled_layers import BUCKET_GRAPHS_PER_LENGTH, bucket_length

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=256, intermediate_size=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, tokenizer=tokenizer, model=model, fp8=True, fp8_recipe=recipe,
                               use_cpu=False, bf16=True, max_steps=4)
        assert trainer._layers_compiled and trainer._layer_buckets  # auto: bucketed for torchao's recipes
        train_and_check(trainer)
    shapes = trainer._bucket_shapes
    assert shapes and all(bucket_length(length) == length for _, length in shapes), shapes
    frames = torch._dynamo.utils.counters["frames"]
    assert 1 <= frames["ok"] <= (BUCKET_GRAPHS_PER_LENGTH + 1) * len(shapes), (dict(frames), shapes)

    ids = torch.randint(5, 40, (4, 40), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        compiled, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 16)  # 40 -> 48 tokens
        trainer._layer_buckets = False
        with eager_blocks(trainer.model):
            eager, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 16)
        trainer._layer_buckets = True
    assert (4, 48) in trainer._bucket_shapes
    gap = (compiled - eager).abs()
    print(f"{recipe}: bucketed compiled vs unpadded eager log-probs: max {gap.max().item():.4g}, "
          f"mean {gap.mean().item():.4g} nats")
    assert gap.mean().item() < 0.02 and gap.max().item() < 0.25, (gap.mean().item(), gap.max().item())
