"""benchmarks/h200_pack.py: the bundle's chunks fit the device calls they are carried in."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import h200_pack  # noqa: E402


@pytest.mark.parametrize("total,first_room,room,extra", [
    (116_066_556, 6_000_000, 55_500_000, 5197),  # this session's bundle and checkout
    (100, 10, 45, 5),  # the remainder fits a call but not beside the installer
    (100, 10, 50, 5),
    (5, 10, 50, 5),  # all in the first chunk
    (0, 10, 50, 5),
])
def test_cut_sizes_fit_every_call_and_cover_the_bundle(total, first_room, room, extra):
    sizes = h200_pack.cut_sizes(total, first_room, room, extra)
    assert sum(sizes) == total and all(s >= 0 for s in sizes)
    assert sizes[0] <= first_room and all(s <= room for s in sizes[1:])
    assert sizes[-1] + extra <= room or len(sizes) == 1


def test_cut_sizes_refuse_a_call_without_room():
    with pytest.raises(ValueError, match="no room"):
        h200_pack.cut_sizes(100, 10, 4, 5)


def test_checkout_bytes_counts_the_tracked_files():
    readme = (ROOT / "README.md").stat().st_size
    assert h200_pack.checkout_bytes() > readme > 0


def test_plan_cuts_the_gguf_so_call_one_fits_beside_the_wheels(tmp_path, monkeypatch):
    (tmp_path / ".gguf").mkdir()
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".vllm").mkdir()
    (tmp_path / ".gguf" / "part00").write_bytes(b"a" * 700)
    (tmp_path / ".gguf" / "part01").write_bytes(b"b" * 500)
    (tmp_path / ".gguf" / "init.py").write_bytes(b"x" * 3)
    (tmp_path / ".whl" / "w.whl").write_bytes(b"w" * 100)
    (tmp_path / ".vllm" / "p1").write_bytes(b"1" * 900)
    (tmp_path / ".vllm" / "p2").write_bytes(b"2" * 400)
    (tmp_path / ".vllm" / "install.sh").write_bytes(b"i" * 5)
    monkeypatch.setattr(h200_pack, "checkout_bytes", lambda root: 200)
    monkeypatch.setattr(h200_pack, "LIMIT", 1000)
    p = h200_pack.plan(tmp_path, margin=100)  # room 700 a call
    assert p["room"] == 700 and p["gguf_parts"] == [600, 600] and p["call1"] == 700 and p["fits_call1"]
    assert p["chunks"][0] == 700 - 600 - 3 and sum(p["chunks"]) == 1300
    assert all(c <= 700 for c in p["chunks"]) and p["chunks"][-1] + 5 <= 700
    h200_pack.cut_gguf(tmp_path, p["gguf_parts"])
    assert (tmp_path / ".gguf" / "part00").read_bytes() == b"a" * 600
    assert (tmp_path / ".gguf" / "part01").read_bytes() == b"a" * 100 + b"b" * 500
