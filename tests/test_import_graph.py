"""calclip's internal import graph (tests/_import_graph.py reads it from the source with ast): no import
cycle, and no runtime module imports the test fixtures of calclip.testing."""

import sys
from pathlib import Path

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


def test_runtime_modules_do_not_import_the_test_fixtures():
    _, graph = _probe().graph_of(ROOT / "calclip")
    importers = sorted(module for module, imported in graph.items() if "calclip.testing" in imported)
    assert importers == []
