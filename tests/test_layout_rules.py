"""The package layout of docs/architecture.md, checked from the source with ast (nothing is imported).

- calclip's top holds only ``__init__`` and ``__main__``; every other module lives in a room (a subpackage), and a
  new room is added to ``ROOMS`` here and to docs/architecture.md's map.
- The math rooms (losses, calibration, fp8, clipping) import the standard library, torch and triton, and of calclip
  only the math rooms below them (``MATH_DEPENDENCIES``); never trl, transformers, accelerate or datasets.
- The support rooms (rollout, run, monitoring, models, tasks) import of calclip only the math rooms: they never
  reach up into trainers/, cli/ or compare/, nor sideways into each other, so trainers/ stays the glue.
- Only trainers/, rollout/ and cli/ import trl.
- No module of calclip imports the test fixtures (tests/).

Every import counts, including those inside functions, and so does a string that names a calclip module exactly
(the lazy tables ``{"name": "calclip.x.y"}`` that ``importlib.import_module`` reads): a deferred import still ties
two files together.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "calclip"

MATH_ROOMS = ("losses", "calibration", "fp8", "clipping")
SUPPORT_ROOMS = ("rollout", "run", "monitoring", "models", "tasks")
ROOMS = (*MATH_ROOMS, *SUPPORT_ROOMS, "trainers", "cli", "compare")
TOP_MODULES = ("__init__", "__main__")  # nothing else at the package top

# What each math room may import of calclip: the rooms below it (losses is the bottom; calibration counts the
# penalties a clip bound drops, losses-side; a clip mode combines a surrogate's bounds with the calibrator).
MATH_DEPENDENCIES = {
    "losses": set(),
    "calibration": {"losses"},
    "fp8": set(),
    "clipping": {"losses", "calibration"},
}
MATH_LIBRARIES = {"torch", "triton"}
# fp8's two optional libraries, each imported inside the function that needs it: torchao for the rowwise /
# tensorwise recipes (the torchao extra) and safetensors for the block-FP8 checkpoint export (a transformers
# dependency, but read here without transformers).
FP8_LIBRARIES = {"torchao", "safetensors"}
TRL_ROOMS = {"trainers", "rollout", "cli"}


def package_modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``package`` (``pkg/a/__init__.py`` is ``pkg.a``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """Everything ``path`` imports: a calclip module (the deepest one an import names) or a top-level library
    name. Function-level imports count, relative ones are resolved, and a string constant equal to a module's
    name counts as an import of that module."""
    top = module.split(".")[0]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: against this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name inside base
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in modules:  # a lazy table names "calclip.x.y"; a bare "calclip" is a logger, a process
            targets = [node.value]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != top:
                found.add(target.split(".")[0])
                continue
            while target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target != module:
                found.add(target)
    return found


def room_of(path: Path) -> str:
    """The room (subpackage of calclip) a file lives in, or "<top>"."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "<top>"


def _room_imports():
    """room -> (the calclip rooms it imports, the libraries it imports), with the module that imports each."""
    modules = package_modules(PACKAGE)
    calclip_deps: dict[str, dict[str, str]] = {}
    libraries: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        room = room_of(path)
        calclip_deps.setdefault(room, {})
        libraries.setdefault(room, {})
        for target in imports_of(path, module, modules):
            if target in modules:
                other = room_of(modules[target])
                if other != room:
                    calclip_deps[room].setdefault(other, module)
            else:
                libraries[room].setdefault(target, module)
    return modules, calclip_deps, libraries


def test_the_reader_sees_deferred_relative_and_named_imports(tmp_path):
    package = tmp_path / "pkg"
    for path, text in {
        "__init__.py": "",
        "a/__init__.py": "from pkg.a.inner import thing\n",
        "a/inner.py": "import os\n\ndef thing():\n    from pkg.b import other  # deferred\n    import trl\n"
                      "    return other\n",
        "b/__init__.py": "from .mod import other\n",
        "b/mod.py": "def other():\n    from ..a import inner\n    return inner\n",
        "c.py": '_LAZY = {"X": "pkg.b.mod", "doc": "pkg.b.mod is a module"}\n',
    }.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    modules = package_modules(package)
    assert sorted(modules) == ["pkg", "pkg.a", "pkg.a.inner", "pkg.b", "pkg.b.mod", "pkg.c"]
    assert imports_of(modules["pkg.a.inner"], "pkg.a.inner", modules) == {"os", "pkg.b", "trl"}
    assert imports_of(modules["pkg.b"], "pkg.b", modules) == {"pkg.b.mod"}
    assert imports_of(modules["pkg.b.mod"], "pkg.b.mod", modules) == {"pkg.a.inner"}
    assert imports_of(modules["pkg.c"], "pkg.c", modules) == {"pkg.b.mod"}  # the exact name only, not the prose


def test_the_package_top_holds_only_init_and_main():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.stem not in TOP_MODULES)
    assert loose == [], f"modules at calclip's top: {loose}; put each in a room (docs/architecture.md)"
    rooms = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert {"losses", "calibration", "fp8", "rollout", "run", "monitoring", "trainers"} <= set(rooms)  # really read
    unknown = sorted(set(rooms) - set(ROOMS))
    assert unknown == [], f"rooms {unknown} are not in this test's ROOMS nor, likely, in docs/architecture.md"
    stray = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.glob("*/") if p.is_dir() and p.name != "__pycache__"
                   and not (p / "__init__.py").exists())
    assert stray == [], f"folders under calclip/ that are no package: {stray}"


def test_math_rooms_import_only_torch_triton_and_the_math_below_them():
    _, calclip_deps, libraries = _room_imports()
    assert "torch" in libraries["losses"] and "triton" in libraries["fp8"]  # the imports are really read
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for room in MATH_ROOMS:
        if room not in calclip_deps:  # clipping/ lands from another branch
            continue
        allowed = MATH_LIBRARIES | (FP8_LIBRARIES if room == "fp8" else set())
        extra = {lib: module for lib, module in libraries[room].items() if lib not in stdlib | allowed}
        assert extra == {}, f"calclip.{room} imports libraries beyond torch/triton (library: importing module)"
        reached = {other: module for other, module in calclip_deps[room].items()
                   if other not in MATH_DEPENDENCIES[room]}
        assert reached == {}, f"calclip.{room} imports calclip rooms it must not (room: importing module)"


def test_support_rooms_import_only_the_math_rooms():
    _, calclip_deps, _ = _room_imports()
    assert calclip_deps["rollout"] and calclip_deps["monitoring"]  # they do import fp8 / calibration
    for room in SUPPORT_ROOMS:
        reached = {other: module for other, module in calclip_deps[room].items() if other not in MATH_ROOMS}
        assert reached == {}, f"calclip.{room} imports rooms above or beside it (room: importing module)"


def test_only_trainers_rollout_and_cli_import_trl():
    _, _, libraries = _room_imports()
    importers = {room: libs["trl"] for room, libs in libraries.items() if "trl" in libs}
    assert "trainers" in importers and "rollout" in importers  # really read
    assert set(importers) <= TRL_ROOMS, f"trl imported outside {sorted(TRL_ROOMS)}: {importers}"


def test_no_module_of_calclip_imports_the_test_fixtures():
    modules = package_modules(PACKAGE)
    importers = sorted(m for m, path in modules.items() if "tests" in imports_of(path, m, modules))
    assert importers == []
    assert not (PACKAGE / "testing.py").exists()  # the fixtures live in tests/fixtures.py
