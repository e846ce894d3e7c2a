"""torch.compile's on-disk caches must not serve a graph compiled under another calclip dispatch (compile_cache.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calclip.fp8 import compile_cache
from calclip.fp8.compile_cache import DISPATCH_ENV, TAG_PREFIX, dispatch_fingerprint, tag_compile_caches

ROOT = Path(__file__).resolve().parents[2]
FP8_DIR = ROOT / "calclip" / "fp8"


def test_fingerprint_follows_the_sources_and_the_dispatch_switches(tmp_path):
    copy = tmp_path / "fp8"
    shutil.copytree(FP8_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    base = dispatch_fingerprint(copy, {})
    assert base == dispatch_fingerprint(copy, {}) == dispatch_fingerprint(FP8_DIR, {})  # content, not location
    assert len(base) == 16 and int(base, 16) >= 0
    for name in DISPATCH_ENV:
        assert dispatch_fingerprint(copy, {name: "0"}) != base, name
    assert dispatch_fingerprint(copy, {"CALCLIP_UNRELATED": "1"}) == base
    gemm_py = copy / "gemm.py"
    gemm_py.write_text(gemm_py.read_text() + "\n# a changed line\n")
    assert dispatch_fingerprint(copy, {}) != base
    (copy / "notes.txt").write_text("not python")
    assert dispatch_fingerprint(copy, {}) == dispatch_fingerprint(copy, {})


def test_tag_keeps_the_users_tag_and_replaces_an_older_calclip_one(monkeypatch):
    import calclip.fp8.linear_ops  # noqa: F401  (registers the ops: the tag is in force from then on)

    config = torch.compiler.config
    ours = TAG_PREFIX + dispatch_fingerprint()
    assert ours in config.cache_key_tag.split("|")
    monkeypatch.setattr(config, "cache_key_tag", f"user-tag|{TAG_PREFIX}0123456789abcdef")
    assert tag_compile_caches() == f"user-tag|{ours}" == config.cache_key_tag
    assert tag_compile_caches() == f"user-tag|{ours}"  # idempotent, never stacked
    monkeypatch.setattr(config, "cache_key_tag", "")
    assert tag_compile_caches() == ours
    assert compile_cache.TAG_PREFIX == "calclip-fp8-"


_PROBE = r"""
import json, torch
from torch._dynamo.utils import counters
from calclip.fp8 import FP8BlockLinear
torch.manual_seed(0)
layer = torch.compile(FP8BlockLinear(256, 256), dynamic=False)
x = torch.randn(64, 256, requires_grad=True)
layer(x).sum().backward()
print("RESULT " + json.dumps(dict(counters["aot_autograd"])))
"""


@pytest.mark.slow
def test_a_compiled_layer_is_not_served_across_a_dispatch_change(tmp_path):
    """Three processes share one Inductor cache directory: the second (same dispatch) loads the first's compiled
    layer from AOTAutograd's cache; the third, with CALCLIP_SCALED_MM_PAD_ROWS=0, compiles its own. Without
    calclip's tag in the key the third loaded the first's graph (the H200 run of 2026-12-05)."""
    def run(**env_overrides):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env_overrides}
        for name in DISPATCH_ENV:
            if name not in env_overrides:
                env.pop(name, None)
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600,
                              cwd=ROOT)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr[-3000:]
        return json.loads(lines[-1][len("RESULT "):])

    first, again, other = run(), run(), run(CALCLIP_SCALED_MM_PAD_ROWS="0")
    assert first.get("autograd_cache_miss") == 1 and first.get("autograd_cache_saved") == 1, first
    assert again.get("autograd_cache_hit") == 1 and not again.get("autograd_cache_miss"), again
    assert other.get("autograd_cache_miss") == 1 and not other.get("autograd_cache_hit"), other
