"""calclip's internal import graph (tests/_import_graph.py reads it from the source with ast): no import
cycle; and no cycle between calclip's subpackages, imports inside functions included (read here with ast, on its
own). That no library module imports the test fixtures (tests/fixtures.py) is tests/test_layout_rules.py's rule."""

import sys
from pathlib import Path

from tests.test_layout_rules import imports_of, package_modules

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _probe():
    import _import_graph

    return _import_graph


def test_no_import_cycle():
    probe = _probe()
    modules, graph = probe.graph_of(ROOT / "calclip")
    assert "calclip.fp8.kernels.quantize" in modules and graph["calclip.fp8.quant"]  # the graph is really read
    assert probe.cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]  # and a cycle would be found
    assert probe.cycles(graph) == []


# ------------------------------------------------------------------------------------ cycles between subpackages

def _unit_graph(root: Path) -> dict[str, set[str]]:
    """package unit -> the units it imports, read from the source with ast by tests/test_layout_rules.py's reader
    (nothing is imported). A unit is a subpackage (calclip.trainers, with everything under it) or the package top;
    every import counts, including those inside functions (a deferred import hides a cycle, it does not remove one)."""
    modules = package_modules(root)

    def unit(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else root.name

    graph: dict[str, set[str]] = {unit(module): set() for module in modules}
    for module, path in modules.items():
        for target in imports_of(path, module, modules):
            if target in modules and unit(target) != unit(module):
                graph[unit(module)].add(unit(target))
    return graph


def _units_on_cycles(graph: dict[str, set[str]]) -> list[str]:
    """The units that can reach themselves."""
    def reachable(start):
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return seen

    return sorted(node for node in graph if node in reachable(node))


def test_the_subpackage_check_sees_imports_inside_functions(tmp_path):
    package = tmp_path / "pkg"
    for path, text in {
        "__init__.py": "",
        "a/__init__.py": "from pkg.a.inner import thing\n",
        "a/inner.py": "def thing():\n    from pkg.b import other  # deferred\n    return other\n",
        "b/__init__.py": "from .mod import other\n",
        "b/mod.py": "def other():\n    from ..a import inner\n    return inner\n",
        "c.py": "import pkg.b.mod\n",
    }.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    graph = _unit_graph(package)
    assert graph == {"pkg": set(), "a": {"b"}, "b": {"a"}, "c": {"b"}}
    assert _units_on_cycles(graph) == ["a", "b"]


def test_no_import_cycle_between_subpackages_lazy_imports_included():
    graph = _unit_graph(ROOT / "calclip")
    assert {"losses", "calibration"} <= graph["clipping"] and "clipping" in graph["trainers"]  # really read
    assert "cli" not in graph["compare"]  # calclip compare reads calclip train's arguments from calclip.trainers
    assert _units_on_cycles(graph) == []
    # the math rooms import nothing of calclip's above them (fp8 and losses nothing at all)
    assert graph["losses"] == set() and graph["fp8"] == set() and graph["calibration"] <= {"losses"}
    assert graph["clipping"] <= {"losses", "calibration"}
