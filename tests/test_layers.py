"""The package's layering, read from the imports themselves (pure ``ast``: no module is
imported, so this runs in well under a second).

``docs/architecture.md`` holds a fenced ``layers`` block, bottom layer first, one line per
layer: ``name: patterns``, where `` | `` separates sibling groups (different groups of one
layer must not import each other; modules of one group may). Every import of every module
under ``retromae_ds/`` (top level, inside functions, under ``TYPE_CHECKING``) is checked:

- every module matches exactly one pattern of the block;
- no import reaches a higher layer or a sibling group;
- no two modules import each other, directly or round a longer cycle;
- the library imports none of ``retromae_recipes``, ``tests``, ``scripts``, ``benchmarks``;
- each heavy dependency has one owner, and ``modeling/`` and ``attention/`` import neither
  DeepSpeed nor ``torch.distributed``.

``KNOWN`` lists the violations that exist today, each to be removed by the restructuring of
issue 29; the test also fails when one of them no longer occurs, so the list only shrinks.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "retromae_ds"
DOC = REPO / "docs" / "architecture.md"

OWNERS = {
    "deepspeed": {"components.engine"},
    "faiss": {"search.faiss_backend"},
    "jieba": {"data.segment"},
    "bm25s": {"eval.lexical"},
}
"""Third-party packages only their owner imports."""

NO_DISTRIBUTED = ("modeling", "modeling.*", "attention", "attention.*")

KNOWN: set[str] = set()
"""Violations present when this test was written (issue 29 removes them one by one)."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def module_name(path: Path) -> str:
    """``retromae_ds/ance/mining.py`` -> ``ance.mining``; the package itself -> ``retromae_ds``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "retromae_ds"


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` (without ``retromae_ds.``) that is a module."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


BY_NAME = re.compile(r"^retromae_ds(\.\w+)+:\w+$")
"""A ``module:attribute`` string naming what a registry imports later (``cli.ENTRIES``)."""


def imports(known: dict[str, Path]) -> tuple[list[Edge], list[Edge]]:
    """(edges between the package's modules, edges to anything else with the imported dotted
    name as ``Edge.target``): every ``import`` statement anywhere in each file, and every
    ``"retromae_ds.module:attribute"`` string (an import by name)."""
    inner: list[Edge] = []
    outer: list[Edge] = []
    for mod, path in known.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        if mod == "retromae_ds":
            package = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and BY_NAME.match(node.value)
            ):
                # "retromae_ds.module:attribute": a command loaded by name (cli's registry)
                names = [node.value.split(":")[0]]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package[: len(package) - (node.level - 1)]
                    base = ".".join(["retromae_ds", *parts, *([base] if base else [])])
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                if name == "retromae_ds" or name.startswith("retromae_ds."):
                    target = _resolve(name.removeprefix("retromae_ds").lstrip("."), known)
                    target = target or "retromae_ds"
                    if target != mod:
                        inner.append(Edge(mod, target, path, node.lineno))
                else:
                    outer.append(Edge(mod, name, path, node.lineno))
    return inner, outer


def folder_of(mod: str) -> str:
    """``ance.mining`` -> ``ance``; a module at the package root -> its own name."""
    return mod.split(".")[0]


def read_layers(text: str) -> list[tuple[str, list[list[str]]]]:
    """The ``layers`` block of docs/architecture.md: [(layer name, [sibling groups of
    patterns])], bottom first."""
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    if block is None:
        raise AssertionError(f"{DOC}: no ```layers block")
    out = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        name, _, patterns = line.partition(":")
        out.append((name.strip(), [g.split() for g in patterns.split("|")]))
    return out


def placement(mod: str, layers: list[tuple[str, list[list[str]]]]) -> list[tuple[int, int]]:
    return [
        (i, j)
        for i, (_, groups) in enumerate(layers)
        for j, group in enumerate(groups)
        if any(fnmatch.fnmatchcase(mod, p) for p in group)
    ]


def violations() -> dict[str, list[str]]:
    """``{violation: [file:line, ...]}`` of the current tree against the documented layers."""
    known = modules()
    layers = read_layers(DOC.read_text(encoding="utf-8"))
    found: dict[str, list[str]] = {}
    place = {}
    for mod in known:
        spots = placement(mod, layers)
        if len(spots) != 1:
            found.setdefault(f"placed {len(spots)} times: {mod}", []).append(str(known[mod]))
            continue
        place[mod] = spots[0]
    inner, outer = imports(known)
    for e in inner:
        if e.source not in place or e.target not in place:
            continue
        (ls, gs), (lt, gt) = place[e.source], place[e.target]
        if lt > ls:
            found.setdefault(f"upward {e.source} -> {e.target}", []).append(e.where())
        elif lt == ls and gs != gt:
            found.setdefault(f"sibling {e.source} -> {e.target}", []).append(e.where())
    graph: dict[str, set[str]] = {}
    for e in inner:
        graph.setdefault(e.source, set()).add(e.target)
    for cycle in cycles(graph):
        a, b = sorted(cycle)[:2] if len(cycle) == 2 else (sorted(cycle)[0], "...")
        key = f"cycle {a} <-> {b}" if len(cycle) == 2 else f"cycle {' -> '.join(sorted(cycle))}"
        found.setdefault(key, []).extend(e.where() for e in inner if {e.source, e.target} <= cycle)
    # the folders are the layers: no two folders import each other, directly or round a ring
    # (a module at the package root is its own "folder")
    folders: dict[str, set[str]] = {}
    for e in inner:
        a, b = folder_of(e.source), folder_of(e.target)
        if a != b:
            folders.setdefault(a, set()).add(b)
    for ring in cycles(folders):
        key = f"folder cycle {' <-> '.join(sorted(ring))}"
        found.setdefault(key, []).extend(
            e.where()
            for e in inner
            if {folder_of(e.source), folder_of(e.target)} <= ring
            and folder_of(e.source) != folder_of(e.target)
        )
    for e in outer:
        top = e.target.split(".")[0]
        if top in ("retromae_recipes", "recipes", "tests", "scripts", "benchmarks"):
            found.setdefault(f"outside {e.source} -> {top}", []).append(e.where())
        owners = OWNERS.get(top)
        if owners is not None and e.source not in owners:
            found.setdefault(f"owner {e.source} imports {top}", []).append(e.where())
        if any(fnmatch.fnmatchcase(e.source, p) for p in NO_DISTRIBUTED) and (
            top == "deepspeed" or e.target.startswith("torch.distributed")
        ):
            found.setdefault(f"distributed {e.source} -> {top}", []).append(e.where())
    for e in inner:
        if e.target == "components.engine" and any(
            fnmatch.fnmatchcase(e.source, p) for p in NO_DISTRIBUTED
        ):
            found.setdefault(f"distributed {e.source} -> engine", []).append(e.where())
    return found


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_imports_follow_the_documented_layers():
    found = violations()
    new = {k: v for k, v in found.items() if k not in KNOWN}
    gone = KNOWN - set(found)
    assert not new, "imports against docs/architecture.md's layers:\n" + "\n".join(
        f"  {k}: {', '.join(v)}" for k, v in sorted(new.items())
    )
    assert not gone, f"no longer violated, remove from KNOWN: {sorted(gone)}"


def test_the_checker_sees_what_it_checks(tmp_path):
    """The walker finds lazy, TYPE_CHECKING and relative imports, and the cycle finder a
    three-module loop: the layer test above cannot pass by seeing nothing."""
    inner, outer = imports(modules())
    kinds = {(e.source, e.target) for e in inner}
    assert ("components.checkpoint", "components.engine") in kinds  # lazy, in functions
    assert ("cli", "finetune") in kinds and ("cli", "export") in kinds  # by name (ENTRIES)
    assert any(e.target == "torch" for e in outer)
    assert any(e.target.startswith("torch.distributed") for e in outer)
    assert any(e.target == "deepspeed" and e.source == "components.engine" for e in outer)
    # one module talks to faiss: search/faiss_backend.py (exact and approximate indexes go
    # through it)
    assert {e.source for e in outer if e.target.split(".")[0] == "faiss"} == {
        "search.faiss_backend"
    }
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    # the folder graph: a folder is a module's first name; components/ lies wholly below
    # training/ (each component owns its config) since issue 47
    assert (folder_of("ance.mining"), folder_of("cli")) == ("ance", "cli")
    assert not [
        (a, b) for a, b in kinds if a.startswith("components.") and b.startswith("training")
    ]
    layers = read_layers("```layers\nbase: x y\nmid: a a.* | b\n```\n")
    assert layers == [("base", [["x", "y"]]), ("mid", [["a", "a.*"], ["b"]])]
    assert placement("a.z", layers) == [(1, 0)]
    with pytest.raises(AssertionError, match="no ```layers block"):
        read_layers("no block")


LONGEST_FUNCTION = 80
"""Issue 47: a job reads top to bottom in functions a reader holds at once."""


def test_no_function_of_the_library_is_longer_than_80_lines():
    """Every function and method under ``retromae_ds/`` (docstring included) spans at most
    ``LONGEST_FUNCTION`` lines; the check measures a planted long function, so it cannot pass
    by measuring nothing."""

    def long_functions(tree: ast.AST, path: str) -> list[str]:
        return [
            f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
        ]

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += long_functions(tree, str(path.relative_to(REPO)))
    assert not found, "functions over 80 lines:\n" + "\n".join(found)
    planted = "def f():\n" + "    x = 1\n" * LONGEST_FUNCTION
    assert long_functions(ast.parse(planted), "planted.py") == ["planted.py:1 f (81 lines)"]
