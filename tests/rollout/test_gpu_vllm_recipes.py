"""vLLM rollouts on torchao's rowwise and tensorwise FP8 codes, live: a per-channel FP8 vLLM engine
(compressed-tensors, CompressedTensorsW8A8Fp8 on CUTLASS) started and synced the way CalibratedGRPOTrainer does it,
and the trainer itself with vLLM colocate rollouts, one process per recipe (vLLM 0.24 engines sharing a process
disagree with their model: docs/vllm.md). Needs CUDA, vllm (written against 0.24.0) and torchao; the trainer test
also trl and datasets.

    PYTHONPATH=/tmp/vsite[:/tmp/site] python -m pytest -q tests/rollout/test_gpu_vllm_recipes.py

What is asserted: after the first sync (vLLM's layerwise reload) the engine holds the policy's torchao codes and
per-row scales bit for bit (``engine_fp8_mismatches`` empty), the in-place layout check passes (``DirectSync``: the
engine's FP8 weight is the loaded storage seen transposed), an in-place sync after a weight change leaves the engine
on the new codes in the same storage, and the rollout log-probs agree with the trainer's FP8 forward within what
FP8 noise allows (a loose sanity bound; the measurement is bench_vllm.py's).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm", reason="vllm is not installed")
pytest.importorskip("torchao.float8", reason="torchao is not installed")

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]  # the child scripts import tests.*: run them from the checkout
ATTENTION_BACKEND = os.environ.get("CALCLIP_VLLM_ATTENTION", "TRITON_ATTN")

ENGINE_SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch
    from calclip.fp8.export import LLAMA_PACKED_MODULES, fp8_weight_sync_tensors
    from calclip.rollout.vllm_direct_sync import DirectSync
    from calclip.rollout.vllm_sync import engine_fp8_mismatches, vllm_engine_model
    from tests.rollout._vllm_engine import (rollout, seeded_prompts, start_engine, tiny_policy, tmpe,
                                            trainer_logprobs)

    model_dir = tempfile.mkdtemp()
    _, policy = tiny_policy(model_dir, recipe=sys.argv[1])
    llm, quantization = start_engine(model_dir, policy, os.environ["CALCLIP_VLLM_ATTENTION"])
    engine, _ = vllm_engine_model(llm)
    result = {"quantization": quantization, "after_reload": engine_fp8_mismatches(engine, policy),
              "fp8_params": sum(p.dtype == torch.float8_e4m3fn for p in engine.parameters()),
              "scheme": type(engine.get_submodule("model.layers.0.self_attn.qkv_proj").scheme).__name__}

    def rollout_tmpe():
        prompts = seeded_prompts()
        ids, lps = rollout(llm, prompts)
        return tmpe(trainer_logprobs(policy, prompts, ids), lps)

    result["tmpe_before"] = rollout_tmpe()
    direct = DirectSync(LLAMA_PACKED_MODULES)
    def stream():
        return fp8_weight_sync_tensors(policy)

    result["direct_verified"] = [direct.verify(dict(engine.named_parameters()), stream()), direct.reason]
    storage = {n: p.data_ptr() for n, p in engine.named_parameters()}
    with torch.no_grad():  # an optimizer-sized change of every parameter: new codes and scales everywhere
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 1e-2 * p.abs().mean())
    result["stale"] = len(engine_fp8_mismatches(engine, policy))
    if direct.verified:
        direct.copy(dict(engine.named_parameters()), stream())
        llm.reset_prefix_cache()
    result["after_direct"] = engine_fp8_mismatches(engine, policy)
    result["same_storage"] = storage == {n: p.data_ptr() for n, p in engine.named_parameters()}
    result["tmpe_after"] = rollout_tmpe()
    print("RESULT " + json.dumps(result))
""")


def run_script(script, *args):
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                               "CALCLIP_VLLM_ATTENTION": ATTENTION_BACKEND})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_per_channel_engine_serves_the_policys_torchao_codes_and_syncs_in_place(recipe):
    result = run_script(ENGINE_SCRIPT, recipe)
    print(f"\n{recipe}: {result}")
    assert result["quantization"] == "compressed-tensors" and result["scheme"] == "CompressedTensorsW8A8Fp8"
    assert result["fp8_params"] == 8  # qkv, o, gate_up, down of 2 layers
    assert result["after_reload"] == []  # the engine holds the trainer's codes and per-row scales
    assert result["direct_verified"] == [True, None], result["direct_verified"]
    assert result["stale"] > 0  # the change moved codes; the check would see a stale engine
    assert result["after_direct"] == [] and result["same_storage"]
    for key in ("tmpe_before", "tmpe_after"):
        assert 1.0 <= result[key] < 1.25, result


TRAINER_SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch
    from tests.fixtures import build_tiny_model, build_tiny_tokenizer, digit_share_reward, tiny_prompt_dataset
    from calclip.trainers import CalibratedGRPOConfig, CalibratedGRPOTrainer
    from calclip.rollout.vllm_sync import engine_fp8_mismatches, vllm_engine_model

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=128, intermediate_size=256, num_key_value_heads=4,
                             dtype=torch.bfloat16)
    args = CalibratedGRPOConfig(
        output_dir=tempfile.mkdtemp(), report_to="none", bf16=True, fp8=True, fp8_recipe=sys.argv[1], use_vllm=True,
        vllm_mode="colocate", vllm_gpu_memory_utilization=0.2, per_device_train_batch_size=8, num_generations=4,
        gradient_accumulation_steps=2, steps_per_generation=4, max_completion_length=16, max_steps=2,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", seed=0, gradient_checkpointing=False)
    import trl.generation.vllm_generation as trl_vllm_generation
    from calclip.rollout.vllm_sync import merged_call_kwargs
    backend = {"attention_backend": os.environ["CALCLIP_VLLM_ATTENTION"]}
    with merged_call_kwargs(trl_vllm_generation, "LLM", backend):
        trainer = CalibratedGRPOTrainer(model=model, reward_funcs=digit_share_reward, args=args,
                                        train_dataset=tiny_prompt_dataset(16), processing_class=tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = sum(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    generation = trainer.vllm_generation
    generation.sync_weights()
    engine_model = vllm_engine_model(generation.llm)[0]
    direct = generation._direct_sync
    logs = [e for e in trainer.state.log_history if "loss" in e]
    print("RESULT " + json.dumps({"moved": moved, "mismatches": engine_fp8_mismatches(engine_model, trainer.model),
                                  "fp8_tensors": sum(p.dtype == torch.float8_e4m3fn for p in engine_model.parameters()),
                                  "direct_sync": [direct.verified, direct.reason],
                                  "loss": [e["loss"] for e in logs],
                                  "tmpe": [e.get("mismatch/token_mult_prob_error") for e in logs]}))
""")


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_trainer_trains_a_torchao_recipe_with_vllm_colocate_rollouts(recipe):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    result = run_script(TRAINER_SCRIPT, recipe)
    print(f"\n{recipe}: {result}")
    assert result["moved"] > 0 and result["fp8_tensors"] > 0
    assert result["mismatches"] == [] and result["direct_sync"] == [True, None], result
    assert all(v == v and abs(v) < 1e6 for v in result["loss"])
    assert all(t is None or 1.0 <= t < 1.5 for t in result["tmpe"]), result["tmpe"]
