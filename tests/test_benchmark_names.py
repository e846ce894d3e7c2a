"""Every calclip name the benchmark and probe scripts import or reach through a module alias still exists.

The scripts run on the GPU machine, whose time is scarce; most of their code only runs there. A rename inside
calclip (the FP8 split moved ``_gemm_choice`` from ``calclip.fp8.linear`` to ``calclip.fp8.linear_math``) then
surfaces as an AttributeError after minutes of device time, as ``probe_mismatch_bursts.py`` did on 2026-12-02.
This reads each script with ast (imports at any depth, inside functions too) and checks the names here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))


def calclip_references(tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """(module, attribute or None, line) for every ``import calclip.x[ as a]``, ``from calclip.x import y`` and
    ``a.attr`` where ``a`` was bound by ``import calclip.x as a`` anywhere in the file."""
    refs: list[tuple[str, str | None, int]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "calclip":
                    refs.append((alias.name, None, node.lineno))
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "calclip":
            for alias in node.names:
                if alias.name != "*":
                    refs.append((node.module, alias.name, node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            refs.append((aliases[node.value.id], node.attr, node.lineno))
    return refs


def missing_names(refs: list[tuple[str, str | None, int]]) -> list[str]:
    missing = []
    for module_name, attr, line in refs:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            missing.append(f"line {line}: import {module_name} ({err})")
            continue
        if attr is None or hasattr(module, attr):
            continue
        try:  # ``from calclip.fp8 import kernels``: a submodule, not an attribute until imported
            importlib.import_module(f"{module_name}.{attr}")
        except ImportError:
            missing.append(f"line {line}: {module_name}.{attr}")
    return missing


def test_the_check_finds_a_stale_name_inside_a_function():
    source = ("def f():\n    import calclip.fp8.linear as linear\n    linear._gemm_choice.clear()\n"
              "    from calclip.fp8 import Fp8Config, no_such_name\n")
    assert missing_names(calclip_references(ast.parse(source))) == [
        "line 4: calclip.fp8.no_such_name", "line 3: calclip.fp8.linear._gemm_choice"]


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT / "benchmarks")) for p in SCRIPTS])
def test_benchmark_script_names_exist(script):
    refs = calclip_references(ast.parse(script.read_text(), filename=str(script)))
    assert missing_names(refs) == []
