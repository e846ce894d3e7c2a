"""Print calclip's internal import graph: every module with its line count and the calclip modules it imports,
then the cycles (strongly connected components of more than one module).

    python tests/_import_graph.py [--root calclip] [--edges]

Reads the source with ``ast`` (nothing is imported), so it runs without torch. Every ``import`` statement counts,
module level or inside a function: a deferred import still ties two files together for a reader, and a cycle
through one is still a cycle. ``from calclip.x import y`` counts as an edge to ``calclip.x.y`` when that is a module,
else to ``calclip.x``; an import of a package also pulls in its ``__init__``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect(root: Path) -> dict[str, tuple[Path, int]]:
    return {module_name(p, root): (p, len(p.read_text().splitlines())) for p in sorted(root.rglob("*.py"))}


def imports_of(path: Path, name: str, modules: dict, top: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t != top and not t.startswith(top + "."):
                continue
            while t and t not in modules:  # `import calclip.fp8.quant as q` style names, or attributes
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph_of(root: Path) -> tuple[dict[str, tuple[Path, int]], dict[str, set[str]]]:
    """(module -> (path, lines), module -> the package-internal modules it imports) for the package at ``root``."""
    modules = collect(root)
    return modules, {m: imports_of(path, m, modules, root.name) for m, (path, _) in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1 (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1] / "calclip"))
    p.add_argument("--edges", action="store_true", help="list each module's calclip imports")
    args = p.parse_args(argv)
    root = Path(args.root).resolve()
    modules, graph = graph_of(root)
    top = root.name
    print(f"{'module':44s} {'lines':>6s}  imports")
    for m in sorted(modules):
        deps = sorted(graph[m])
        tail = ", ".join(d.removeprefix(top + ".") for d in deps) if args.edges else str(len(deps))
        print(f"{m:44s} {modules[m][1]:6d}  {tail}")
    total = sum(n for _, n in modules.values())
    largest = sorted(modules.items(), key=lambda kv: -kv[1][1])[:5]
    print(f"\nfiles: {len(modules)}   lines: {total}   edges: {sum(len(v) for v in graph.values())}")
    print("largest: " + ", ".join(f"{m.removeprefix(top + '.')} ({n})" for m, (_, n) in largest))
    found = cycles(graph)
    print(f"cycles: {len(found)}")
    for comp in found:
        members = set(comp)
        print("  " + " <-> ".join(c.removeprefix(top + ".") for c in comp))
        for c in comp:
            inside = sorted(d.removeprefix(top + ".") for d in graph[c] if d in members)
            print(f"    {c.removeprefix(top + '.')} -> {', '.join(inside)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
