"""The package's layering, read from the imports themselves (pure ``ast``: no module is
imported, so this runs in well under a second).

``docs/architecture.md`` holds a fenced ``layers`` block, bottom layer first, one line per
layer: ``name: patterns``, where `` | `` separates sibling groups (different groups of one
layer must not import each other; modules of one group may). Every import of every module
under ``retromae_ds/`` (top level, inside functions, under ``TYPE_CHECKING``, by name) is
checked:

- every module matches exactly one pattern of the block;
- no import reaches a higher layer or a sibling group;
- no two modules import each other, directly or round a longer cycle;
- the library imports none of ``retromae_recipes``, ``tests``, ``scripts``, ``benchmarks``,
  not even by name (a ``"module:attribute"`` string, ``importlib.import_module("...")``, a
  string naming a recipe module); the recipes reach ``retromae-ds`` through the
  ``retromae_ds.commands`` entry-point group, which names no module of theirs;
- each heavy dependency has one owner, and ``modeling/`` and ``attention/`` import neither
  DeepSpeed nor ``torch.distributed``, nor reach ``torch.distributed`` without importing it
  (``torch.distributed.barrier()`` after a plain ``import torch``, ``dist.all_reduce`` through
  an alias).

The recipes (``retromae_recipes/``) sit above the library: they import the library and each
other only (never ``tests``, ``scripts``, ``benchmarks``), with no cycle among their modules,
and the heavy dependencies keep their owners there too. No function of either package is
longer than 80 lines.

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
RECIPES = REPO / "retromae_recipes"
DOC = REPO / "docs" / "architecture.md"

OWNERS = {
    "deepspeed": {"components.engine"},
    "faiss": {"search.faiss_backend"},
    "jieba": {"data.segment"},
    "bm25s": {"retrieval.lexical"},
}
"""Third-party packages only their owner imports (in the library; the recipes import none)."""

NO_DISTRIBUTED = ("modeling", "modeling.*", "attention", "attention.*")

ABOVE_THE_LIBRARY = ("retromae_recipes", "recipes", "tests", "scripts", "benchmarks")
"""What the library never imports; the recipes import none of these but themselves."""

KNOWN: set[str] = set()
"""Violations present when this test was written (issue 29 removes them one by one)."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``retromae_ds/refresher/mining.py`` -> ``refresher.mining``; the package itself -> its name
    (``retromae_ds``, ``retromae_recipes``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or root.name


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` (without the package's name) that is a module."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


BY_NAME = re.compile(r"^(retromae_ds|retromae_recipes)(\.\w+)+:\w+$")
"""A ``module:attribute`` string naming what a registry imports later (``cli.ENTRIES``)."""
RECIPE_BY_NAME = re.compile(r"^retromae_recipes(\.\w+)*$")
"""A string naming a recipe module (``python -m retromae_recipes.study``, a lookup by name):
the library has no business naming one."""


def named_imports(node: ast.AST) -> list[str]:
    """The dotted names ``node`` imports, absolute ones as written (a relative ``from``
    import: ``"." * level`` before the module): an ``import`` statement, a ``"module:attribute"``
    string (an import by name: cli's registry), ``importlib.import_module("x")`` or
    ``__import__("x")`` of a constant, a string that is a recipe module's name."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = "." * node.level + (node.module or "")
        sep = "" if base.endswith(".") else "."
        return [f"{base}{sep}{a.name}" for a in node.names]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if BY_NAME.match(node.value):
            return [node.value.split(":")[0]]
        if RECIPE_BY_NAME.match(node.value):
            return [node.value]
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        arg = node.args[0]
        by_call = name in ("import_module", "__import__") and isinstance(arg, ast.Constant)
        if by_call and isinstance(arg.value, str) and not arg.value.startswith("."):
            # a recipe's name is counted once, as the string it is (above)
            return [] if RECIPE_BY_NAME.match(arg.value) else [arg.value]
    return []


def imports(known: dict[str, Path], package: str = "retromae_ds") -> tuple[list[Edge], list[Edge]]:
    """(edges between ``package``'s modules, edges to anything else with the imported dotted
    name as ``Edge.target``): every import anywhere in each file (``named_imports``)."""
    inner: list[Edge] = []
    outer: list[Edge] = []
    for mod, path in known.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        if mod == package:
            here = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for name in named_imports(node):
                if name.startswith("."):
                    level = len(name) - len(name.lstrip("."))
                    rest = name[level:]
                    parts = here[: len(here) - (level - 1)]
                    name = ".".join([package, *parts, *([rest] if rest else [])])
                if name == package or name.startswith(package + "."):
                    target = _resolve(name.removeprefix(package).lstrip("."), known)
                    target = target or package
                    if target != mod:
                        inner.append(Edge(mod, target, path, node.lineno))
                else:
                    outer.append(Edge(mod, name, path, node.lineno))
    return inner, outer


def _dotted(node: ast.AST, alias: dict[str, str]) -> str | None:
    """The full dotted name an expression stands for (``th.distributed`` after ``import torch
    as th``: ``torch.distributed``), or None when it is no imported name."""
    if isinstance(node, ast.Name):
        return alias.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, alias)
        return f"{base}.{node.attr}" if base else None
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        base = _dotted(node.args[0], alias)
        return f"{base}.{node.args[1].value}" if base else None
    return None


def _is_distributed(name: str | None) -> bool:
    return name is not None and (
        name == "torch.distributed" or name.startswith("torch.distributed.")
    )


def distributed_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` of every use of ``torch.distributed`` in ``tree``, however it is
    reached: ``torch.distributed.barrier()`` after a plain ``import torch``, an alias
    (``import torch as th``, ``import torch.distributed as dist``, ``from torch import
    distributed``, ``from torch.distributed import all_reduce``, ``dist = torch.distributed``)
    or ``getattr(torch, "distributed")``; one entry per chain, its longest name
    (``dist.all_reduce(x)``: ``torch.distributed.all_reduce``)."""
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                alias[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    for _ in range(3):  # names bound to torch or a part of torch.distributed, a few deep
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                value = _dotted(node.value, alias)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if value == "torch" or _is_distributed(value):
                    for t in targets:
                        if isinstance(t, ast.Name):
                            alias[t.id] = value
    uses = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute | ast.Name | ast.Call)
        and not isinstance(getattr(node, "ctx", None), ast.Store)
        and _is_distributed(_dotted(node, alias))
    ]
    # a chain's inner links (``torch.distributed`` inside ``torch.distributed.barrier``)
    inside = {id(n.value) for n in uses if isinstance(n, ast.Attribute)}
    inside |= {id(n.args[0]) for n in uses if isinstance(n, ast.Call)}
    return sorted((n.lineno, _dotted(n, alias)) for n in uses if id(n) not in inside)


def folder_of(mod: str) -> str:
    """``refresher.mining`` -> ``refresher``; a module at the package root -> its own name."""
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


def _cycle_violations(inner: list[Edge], found: dict[str, list[str]]) -> None:
    """No two modules import each other, directly or round a longer cycle."""
    graph: dict[str, set[str]] = {}
    for e in inner:
        graph.setdefault(e.source, set()).add(e.target)
    for cycle in cycles(graph):
        a, b = sorted(cycle)[:2] if len(cycle) == 2 else (sorted(cycle)[0], "...")
        key = f"cycle {a} <-> {b}" if len(cycle) == 2 else f"cycle {' -> '.join(sorted(cycle))}"
        where = (e.where() for e in inner if {e.source, e.target} <= cycle)
        found.setdefault(key, []).extend(dict.fromkeys(where))  # once per line


def _outer_violations(
    outer: list[Edge], forbidden: tuple[str, ...], found: dict[str, list[str]]
) -> None:
    """Nothing of ``forbidden`` imported, and each heavy dependency only by its owner."""
    for e in outer:
        top = e.target.split(".")[0]
        if top in forbidden:
            found.setdefault(f"outside {e.source} -> {top}", []).append(e.where())
        owners = OWNERS.get(top)
        if owners is not None and e.source not in owners:
            found.setdefault(f"owner {e.source} imports {top}", []).append(e.where())


def violations(root: Path = PACKAGE, layers_text: str | None = None) -> dict[str, list[str]]:
    """``{violation: [file:line, ...]}`` of the library under ``root`` against the layers of
    ``layers_text`` (docs/architecture.md's by default)."""
    known = modules(root)
    layers = read_layers(DOC.read_text(encoding="utf-8") if layers_text is None else layers_text)
    found: dict[str, list[str]] = {}
    place = {}
    for mod in known:
        spots = placement(mod, layers)
        if len(spots) != 1:
            found.setdefault(f"placed {len(spots)} times: {mod}", []).append(str(known[mod]))
            continue
        place[mod] = spots[0]
    inner, outer = imports(known, root.name)
    for e in inner:
        if e.source not in place or e.target not in place:
            continue
        (ls, gs), (lt, gt) = place[e.source], place[e.target]
        if lt > ls:
            found.setdefault(f"upward {e.source} -> {e.target}", []).append(e.where())
        elif lt == ls and gs != gt:
            found.setdefault(f"sibling {e.source} -> {e.target}", []).append(e.where())
    _cycle_violations(inner, found)
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
    _outer_violations(outer, ABOVE_THE_LIBRARY, found)
    for e in outer:
        top = e.target.split(".")[0]
        if any(fnmatch.fnmatchcase(e.source, p) for p in NO_DISTRIBUTED) and (
            top == "deepspeed" or e.target.startswith("torch.distributed")
        ):
            found.setdefault(f"distributed {e.source} -> {top}", []).append(e.where())
    for e in inner:
        if e.target == "components.engine" and any(
            fnmatch.fnmatchcase(e.source, p) for p in NO_DISTRIBUTED
        ):
            found.setdefault(f"distributed {e.source} -> engine", []).append(e.where())
    for mod, path in known.items():
        if any(fnmatch.fnmatchcase(mod, p) for p in NO_DISTRIBUTED):
            for line, name in distributed_uses(ast.parse(path.read_text(encoding="utf-8"))):
                found.setdefault(f"distributed {mod} uses {name}", []).append(
                    Edge(mod, name, path, line).where()
                )
    return found


def recipe_violations(root: Path = RECIPES) -> dict[str, list[str]]:
    """``{violation: [file:line, ...]}`` of the recipes under ``root``: they import the
    library and each other only (``ABOVE_THE_LIBRARY`` but themselves is out of reach), with
    no cycle among their modules, and no heavy dependency of ``OWNERS``."""
    known = modules(root)
    inner, outer = imports(known, root.name)
    found: dict[str, list[str]] = {}
    _cycle_violations(inner, found)
    _outer_violations(outer, tuple(t for t in ABOVE_THE_LIBRARY if t != root.name), found)
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
    assert (folder_of("refresher.mining"), folder_of("cli")) == ("refresher", "cli")
    assert not [
        (a, b) for a, b in kinds if a.startswith("components.") and b.startswith("training")
    ]
    layers = read_layers("```layers\nbase: x y\nmid: a a.* | b\n```\n")
    assert layers == [("base", [["x", "y"]]), ("mid", [["a", "a.*"], ["b"]])]
    assert placement("a.z", layers) == [(1, 0)]
    with pytest.raises(AssertionError, match="no ```layers block"):
        read_layers("no block")


def _plant(root: Path, files: dict[str, str]) -> Path:
    """A package folder ``root`` holding ``files`` (relative path -> source)."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


EVERYTHING = "```layers\nall: *\n```\n"
"""One layer holding every module: a planted library checked for all but layering."""


def test_the_recipes_import_the_library_and_themselves_only():
    found = recipe_violations()
    assert not found, "imports of retromae_recipes/:\n" + "\n".join(
        f"  {k}: {', '.join(v)}" for k, v in sorted(found.items())
    )


def test_the_recipes_checker_sees_what_it_checks(tmp_path):
    """A planted recipes folder with a three-module cycle (one link inside a function, one
    relative), an import of ``tests`` and one of ``scripts`` by ``importlib``, and a heavy
    dependency is caught on each; the walker reads the real recipes' imports of each other
    (lazy ones too) and of the library."""
    recipes = _plant(
        tmp_path / "retromae_recipes",
        {
            "__init__.py": "",
            "a.py": "from retromae_recipes import b\nimport tests.helpers_train\n",
            "b.py": "def f():\n    from retromae_recipes.c import x\n\n    return x\n",
            "c.py": (
                "from . import a\nimport deepspeed\nfrom retromae_ds.eval.run import evaluate\n"
            ),
            "d.py": 'import importlib\n\nimportlib.import_module("scripts.study")\n',
        },
    )
    found = recipe_violations(recipes)
    assert set(found) == {
        "cycle a -> b -> c",
        "outside a -> tests",
        "outside d -> scripts",
        "owner c imports deepspeed",
    }
    assert found["outside a -> tests"] == [f"{recipes / 'a.py'}:2"]
    _, outer = imports(modules(recipes), "retromae_recipes")
    assert ("c", "retromae_ds.eval.run.evaluate") in {(e.source, e.target) for e in outer}
    inner, outer = imports(modules(RECIPES), "retromae_recipes")
    kinds = {(e.source, e.target) for e in inner}
    assert ("commands", "demo") in kinds  # lazy, inside demo_command
    assert ("demo", "study") in kinds and ("study", "report") in kinds
    assert any(e.source == "study" and e.target.startswith("retromae_ds.") for e in outer)


def test_the_library_names_no_recipe_even_by_name(tmp_path):
    """The library reaches the recipes' ``demo`` only through the ``retromae_ds.commands``
    entry-point group (cli loads ``entry_points(group=COMMANDS)``), a group name and no
    import: a planted library naming a recipe module as a ``module:attribute`` string,
    through ``importlib.import_module``, as ``python -m`` or by ``import`` is caught."""
    lib = _plant(
        tmp_path / "retromae_ds",
        {
            "__init__.py": "",
            "cli.py": (
                "import importlib\n"
                'DEMO = "retromae_recipes.commands:DEMO_ENTRY"\n'
                'GROUP = "retromae_ds.commands"\n'
                "\n\ndef load():\n"
                '    return importlib.import_module("retromae_recipes.demo")\n'
            ),
            "jobs.py": 'import sys\n\nCMD = [sys.executable, "-m", "retromae_recipes.study"]\n',
            "plain.py": "def f():\n    from retromae_recipes.report import report\n",
        },
    )
    found = violations(lib, EVERYTHING)
    assert found == {
        "outside cli -> retromae_recipes": [f"{lib / 'cli.py'}:2", f"{lib / 'cli.py'}:7"],
        "outside jobs -> retromae_recipes": [f"{lib / 'jobs.py'}:3"],
        "outside plain -> retromae_recipes": [f"{lib / 'plain.py'}:2"],
    }
    inner, outer = imports(modules())
    assert not [e for e in outer if e.target.split(".")[0] == "retromae_recipes"]
    assert ("cli", "importlib.metadata.entry_points") in {(e.source, e.target) for e in outer}


PLANTED_DISTRIBUTED = """\
import torch
import torch as th
import torch.distributed as tdist
from torch import distributed
from torch.distributed import all_gather_object as gather

d = torch.distributed


def step(x):
    torch.distributed.barrier()
    th.distributed.all_reduce(x)
    distributed.broadcast(x, 0)
    tdist.get_rank()
    d.all_reduce(x, op=d.ReduceOp.MAX)
    gather([], x)
    getattr(torch, "distributed").barrier()
    dist = x
    dist.all_reduce(x)  # a local name, nothing of torch.distributed
    return torch.nn.functional.relu(x)
"""


def test_the_distributed_check_sees_calls_made_without_importing_it(tmp_path):
    """Every spelling of a ``torch.distributed`` call is found, the alias-free one after a
    plain ``import torch`` included (the import check alone missed it: the real
    ``refresher/stages.py`` makes two such calls); in ``modeling/`` and ``attention/`` each is a
    violation, elsewhere none."""
    assert distributed_uses(ast.parse(PLANTED_DISTRIBUTED)) == [
        (7, "torch.distributed"),
        (11, "torch.distributed.barrier"),
        (12, "torch.distributed.all_reduce"),
        (13, "torch.distributed.broadcast"),
        (14, "torch.distributed.get_rank"),
        (15, "torch.distributed.ReduceOp.MAX"),
        (15, "torch.distributed.all_reduce"),
        (16, "torch.distributed.all_gather_object"),
        (17, "torch.distributed.barrier"),
    ]
    stages = ast.parse((PACKAGE / "refresher" / "stages.py").read_text(encoding="utf-8"))
    assert {"torch.distributed.all_gather_object", "torch.distributed.barrier"} <= {
        name for _, name in distributed_uses(stages)
    }
    barrier = "import torch\n\n\ndef sync():\n    torch.distributed.barrier()\n"
    lib = _plant(
        tmp_path / "retromae_ds",
        {
            "__init__.py": "",
            "modeling/__init__.py": "",
            "modeling/heads.py": barrier,
            "attention/__init__.py": "",
            "attention/flex.py": (
                "import torch as th\n\n\ndef f(x):\n    th.distributed.all_reduce(x)\n"
            ),
            "refresher/__init__.py": "",
            "refresher/stages.py": barrier,
        },
    )
    assert violations(lib, EVERYTHING) == {
        "distributed modeling.heads uses torch.distributed.barrier": [
            f"{lib / 'modeling' / 'heads.py'}:5"
        ],
        "distributed attention.flex uses torch.distributed.all_reduce": [
            f"{lib / 'attention' / 'flex.py'}:5"
        ],
    }


LONGEST_FUNCTION = 80
"""Issue 47: a job reads top to bottom in functions a reader holds at once."""


def long_functions(tree: ast.AST, path: str) -> list[str]:
    return [
        f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    ]


def _long_functions_under(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += long_functions(tree, str(path.relative_to(root.parent)))
    return found


def test_no_function_of_the_library_is_longer_than_80_lines():
    """Every function and method under ``retromae_ds/`` (docstring included) spans at most
    ``LONGEST_FUNCTION`` lines; the check measures a planted long function, so it cannot pass
    by measuring nothing."""
    found = _long_functions_under(PACKAGE)
    assert not found, "functions over 80 lines:\n" + "\n".join(found)
    planted = "def f():\n" + "    x = 1\n" * LONGEST_FUNCTION
    assert long_functions(ast.parse(planted), "planted.py") == ["planted.py:1 f (81 lines)"]


def test_no_function_of_the_recipes_is_longer_than_80_lines(tmp_path):
    """The same rule for ``retromae_recipes/``; a planted recipes folder with one method of 81
    lines (nested in a class) and one of 80 is measured as such."""
    found = _long_functions_under(RECIPES)
    assert not found, "functions over 80 lines:\n" + "\n".join(found)
    body = "        x = 1\n"
    recipes = _plant(
        tmp_path / "retromae_recipes",
        {
            "__init__.py": "",
            "study.py": "class Study:\n    def main(self):\n" + body * LONGEST_FUNCTION,
            "demo.py": "class Demo:\n    def run(self):\n" + body * (LONGEST_FUNCTION - 1),
        },
    )
    assert _long_functions_under(recipes) == ["retromae_recipes/study.py:2 main (81 lines)"]
