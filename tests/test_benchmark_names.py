"""Every calclip name the benchmark and probe scripts, and the GPU-only tests, import or reach through a module alias
still exists.

The scripts run on the GPU machine, whose time is scarce; most of their code only runs there. A rename inside
calclip (the FP8 split moved ``_gemm_choice`` from ``calclip.fp8.linear`` to ``calclip.fp8.linear_math``) then
surfaces as an AttributeError after minutes of device time, as ``probe_mismatch_bursts.py`` did on 2026-12-02. The
GPU-only test files skip at module level on CPU, so a stale name in them goes unnoticed here too. This reads each
file with ast (imports at any depth, inside functions too) and checks the names here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))
GPU_TESTS = sorted(p for p in (ROOT / "tests").rglob("*.py")
                   if "allow_module_level=True" in p.read_text() or "importorskip" in p.read_text())


def calclip_references(tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """(module, attribute or None, line) for every ``import calclip.x[ as a]``, ``from calclip.x import y[ as a]``
    and ``a.attr`` where ``a`` names a calclip module (``import calclip.x as a``, ``from calclip import x as a``)
    anywhere in the file. Names bound by ``from`` imports may be classes or functions: their attributes are only
    checked when the name turns out to be a module (``missing_names``)."""
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
                    aliases.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            refs.append((aliases[node.value.id], node.attr, node.lineno))
    return refs


def _module(name: str):
    """The module ``name`` if it is one (a name bound by ``from m import n`` may be a class: None)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        parent, _, attr = name.rpartition(".")
        if parent and not isinstance(getattr(_module(parent), attr, None), type(importlib)):
            return None
        raise


def missing_names(refs: list[tuple[str, str | None, int]]) -> list[str]:
    missing = []
    for module_name, attr, line in refs:
        try:
            module = _module(module_name)
        except ImportError as err:
            missing.append(f"line {line}: import {module_name} ({err})")
            continue
        if module is None:  # an attribute of a class or function imported by name: not checked
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


def test_the_check_follows_modules_imported_by_name():
    source = ("from calclip.fp8 import kernels as tk, Fp8Config\ntk.quantize_1x128\ntk.no_such_kernel\n"
              "Fp8Config.whatever\n")
    assert missing_names(calclip_references(ast.parse(source))) == ["line 3: calclip.fp8.kernels.no_such_kernel"]


@pytest.mark.parametrize("script", SCRIPTS + GPU_TESTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS + GPU_TESTS])
def test_benchmark_script_names_exist(script):
    refs = calclip_references(ast.parse(script.read_text(), filename=str(script)))
    assert missing_names(refs) == []
