"""The package's layout (issue 12): no import circles, and lower floors never import higher ones.

Imports are read with ``ast`` from every module of ``nodetrain/`` (nothing is imported), including
imports inside functions; imports under ``if TYPE_CHECKING:`` never run and are left out. Importing
``a.b.c`` also runs ``a.b``'s ``__init__``, so each import adds an edge to the parent packages too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nodetrain"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("nodetrain.config", "nodetrain.store"),  # bottom: the schema and the host store
    ("nodetrain.model",),  # HF adapters
    ("nodetrain.cost",),  # pure arithmetic: bytes, FLOPs, seconds
    ("nodetrain.core",),  # pure decisions: schedule, the step's rule, placement, update mode, resolve
    ("nodetrain.data", "nodetrain.optim"),  # batches; the CPU optimizer on the store
    ("nodetrain.checkpoint",),  # save, resume, HF in and out
    ("nodetrain.run",),  # metrics, breakdown, plots, output dirs, jobs, faults
    ("nodetrain.engine", "nodetrain.plan"),  # one rank's step; the planner (never each other)
    ("nodetrain.train", "nodetrain.plots"),  # top: the entry points
)
"""Floors from the bottom; a module may import its own floor and those below. Longest prefix wins."""

APART = (("nodetrain.engine", "nodetrain.plan"),)
"""Packages on one floor that never import each other (both stand on ``core`` and ``cost``)."""


def module_name(path: Path, root: Path) -> str:
    """``nodetrain/engine/stage.py`` → ``nodetrain.engine.stage``; a package's ``__init__`` → the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _targets(node: ast.AST, modules: set[str]) -> set[str]:
    """The nodetrain modules one import statement runs (the named module, else its package)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == "nodetrain"}
    if (
        isinstance(node, ast.ImportFrom)
        and node.level == 0
        and (node.module or "").split(".")[0] == "nodetrain"
    ):
        named = {f"{node.module}.{a.name}" for a in node.names} & modules
        return named | {node.module}
    return set()


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the nodetrain modules it imports (and their parent packages), read with ``ast``."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        deps = set()
        for node in ast.walk(tree):
            if id(node) not in skip:
                for target in _targets(node, modules):
                    parts = target.split(".")
                    deps |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & modules
        graph[name] = deps - {name} - {p for p in modules if name.startswith(p + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, else None (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def floor_of(module: str) -> int:
    """Index in :data:`FLOORS` of the longest prefix naming ``module``.

    Raises:
        KeyError: ``module`` is on no floor (a new folder or top-level module: add it to FLOORS).
    """
    best = max(
        (
            (len(p), i)
            for i, names in enumerate(FLOORS)
            for p in names
            if module == p or module.startswith(p + ".")
        ),
        default=None,
    )
    if best is None:
        raise KeyError(f"{module}: on no floor of tests/unit/test_layout.py FLOORS; add it there")
    return best[1]


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """Every ``a -> b`` between two packages of :data:`APART`."""
    return [
        f"{a} -> {b}"
        for x, y in APART
        for a, deps in sorted(graph.items())
        for b in sorted(deps)
        if (a.startswith(x + ".") and (b == y or b.startswith(y + ".")))
        or (a.startswith(y + ".") and (b == x or b.startswith(x + ".")))
    ]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every ``a -> b`` where ``b`` sits on a higher floor than ``a``. Exempt: the package root, and a
    package whose ``__init__`` imports nothing (it runs a docstring: ``plan`` for ``plan.costs``)."""
    empty = {b for b, deps in graph.items() if not deps and any(m.startswith(b + ".") for m in graph)}
    return [
        f"{a} (floor {floor_of(a)}) -> {b} (floor {floor_of(b)})"
        for a, deps in sorted(graph.items())
        if a != "nodetrain"
        for b in sorted(deps)
        if b not in empty and floor_of(b) > floor_of(a)
    ]


def test_nodetrain_has_no_import_circle() -> None:
    assert find_cycle(import_graph(ROOT)) is None


def test_lower_floors_never_import_higher_ones() -> None:
    assert upward_imports(import_graph(ROOT)) == []


def test_engine_and_planner_never_import_each_other() -> None:
    assert crossings(import_graph(ROOT)) == []


def test_every_module_is_on_a_floor() -> None:
    for module in import_graph(ROOT):
        if module != "nodetrain":
            floor_of(module)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / "nodetrain" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "nodetrain" / rel).write_text(text)
    return tmp_path / "nodetrain"


def test_a_planted_circle_and_an_upward_import_are_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "store.py": "from nodetrain.engine.stage import run\n",  # bottom imports the engine
            "engine/__init__.py": "",
            "engine/stage.py": "def run():\n    from nodetrain.engine import window\n",
            "engine/window.py": "import nodetrain.engine.stage\n",
            "config/__init__.py": "import typing\nif typing.TYPE_CHECKING:\n    import nodetrain.store\n",
        },
    )
    graph = import_graph(root)
    assert graph["nodetrain.config"] == set()  # TYPE_CHECKING imports never run
    assert find_cycle(graph) == [
        "nodetrain.engine.stage",
        "nodetrain.engine.window",
        "nodetrain.engine.stage",
    ]
    assert upward_imports(graph) == [
        "nodetrain.store (floor 0) -> nodetrain.engine.stage (floor 7)",
    ]


def test_a_planted_engine_planner_import_is_found(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/window.py": "from nodetrain.plan.planner import make_plan\n",
            "plan/__init__.py": "",
            "plan/planner.py": "def make_plan():\n    pass\n",
        },
    )
    assert crossings(import_graph(root)) == [
        "nodetrain.engine.window -> nodetrain.plan",
        "nodetrain.engine.window -> nodetrain.plan.planner",
    ]


def test_a_module_on_no_floor_is_named() -> None:
    with pytest.raises(KeyError, match=r"nodetrain\.newthing: on no floor"):
        floor_of("nodetrain.newthing")


def test_every_package_is_a_package_and_ships() -> None:
    """Every folder of ``nodetrain/`` with modules has an ``__init__`` and is listed in pyproject.toml's
    packages (a regular ``pip install .`` would leave it out otherwise: the editable install hides it)."""
    import tomllib

    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    folders = {p.parent for p in ROOT.rglob("*.py")}
    assert [str(f) for f in folders if not (f / "__init__.py").exists()] == []
    names = {module_name(f / "__init__.py", ROOT) for f in folders}
    assert names - listed == set()


PRODUCT = re.compile(
    r"\b\w*grad_accum\w*\s*\*\s*[\w.]*microbatches\b|\b[\w.]*microbatches\w*\s*\*\s*[\w.]*grad_accum\b"
)
"""The product G·M of rounds per step and micro-batches per round, spelled in code."""


def microbatch_products(root: Path) -> list[str]:
    """``path:line`` of every line of code (comments and docstrings aside) that takes G·M."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                text = ast.get_source_segment("\n".join(lines), node) or ""
                if PRODUCT.search(text) and not isinstance(node.left, ast.BinOp):
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_microbatches_per_step_is_computed_in_one_place() -> None:
    """Issue 30: G·M is ``config.batch.microbatches_per_step``; everything else calls it."""
    assert microbatch_products(ROOT) == ["config/batch.py:" + str(_line_of("def microbatches_per_step") + 3)]


def _line_of(text: str) -> int:
    lines = (ROOT / "config" / "batch.py").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.startswith(text))


def test_a_second_copy_of_the_product_is_found(tmp_path: Path) -> None:
    a = "def f(cfg):\n    return cfg.train.grad_accum * cfg.pipeline.microbatches\n"
    (tmp_path / "a.py").write_text(a)
    b = "n = batch.microbatches * batch.grad_accum * 2\nm = grad_accum + microbatches\n"
    (tmp_path / "b.py").write_text(b)
    assert microbatch_products(tmp_path) == ["a.py:2", "b.py:1"]
