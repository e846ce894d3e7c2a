"""calclip's internal import graph (benchmarks/probes/import_graph.py reads it from the source with ast): no import
cycle, and no runtime module imports the test fixtures of calclip.testing."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "benchmarks" / "probes" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
