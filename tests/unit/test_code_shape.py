"""Small plain code (STYLE.md, issue 20): no function over 60 lines, no file over 500, in ``nodetrain/``.

Read with ``ast`` (nothing is imported). A function's length runs from its ``def`` line to its last
line, docstring and nested functions included (decorators are not counted); a file's is its line count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "nodetrain"

MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``path:qualified name`` -> lines, of every function or method under ``root`` over ``limit``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        stack = [(node, "") for node in tree.body]
        while stack:
            node, prefix = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{node.name}"
                lines = node.end_lineno - node.lineno + 1
                if not isinstance(node, ast.ClassDef) and lines > limit:
                    found[f"{path.relative_to(root)}:{name}"] = lines
                stack += [(child, f"{name}.") for child in ast.iter_child_nodes(node)]
            else:
                stack += [(child, prefix) for child in ast.iter_child_nodes(node)]
    return found


def long_files(root: Path, limit: int = MAX_FILE_LINES) -> dict[str, int]:
    """Path (relative to ``root``) -> lines, of every ``.py`` file under ``root`` over ``limit``."""
    counts = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}
    return {path: n for path, n in counts.items() if n > limit}


def test_no_function_over_60_lines() -> None:
    assert long_functions(ROOT) == {}


def test_no_file_over_500_lines() -> None:
    assert long_files(ROOT) == {}


def _function(name: str, lines: int, indent: str = "") -> str:
    """A function of exactly ``lines`` lines: its ``def``, a docstring, assignments, a return."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 3))
    return f'{indent}def {name}():\n{indent}    """doc"""\n{body}{indent}    return 0\n'


def test_the_checks_see_a_planted_61_line_function_and_501_line_file(tmp_path: Path) -> None:
    """The mutant: a 61-line function (also as a method) is found, a 60-line one is not; likewise a
    501-line file and a 500-line one."""
    (tmp_path / "pkg").mkdir()
    method = _function("long_method", 61, "    ")
    (tmp_path / "pkg" / "a.py").write_text(
        _function("ok", 60) + _function("long", 61) + "class C:\n" + method
    )
    assert long_functions(tmp_path) == {"pkg/a.py:long": 61, "pkg/a.py:C.long_method": 61}
    (tmp_path / "pkg" / "b.py").write_text("x = 1\n" * 500)
    assert long_files(tmp_path) == {}
    (tmp_path / "pkg" / "b.py").write_text("x = 1\n" * 501)
    assert long_files(tmp_path) == {"pkg/b.py": 501}


def test_no_formatter_opt_out_packs_code() -> None:
    """Size limits are met by seams, not by packing lines past the formatter (issue 30)."""
    found = [
        f"{p.relative_to(ROOT.parent)}:{n}"
        for folder in ("nodetrain", "tests", "bench")
        for p in sorted((ROOT.parent / folder).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: " + "skip" in line
    ]
    assert found == []
