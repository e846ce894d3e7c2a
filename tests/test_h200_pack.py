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
