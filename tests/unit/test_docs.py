"""The documentation stays true to the code: the configuration page is the schema (both ways), every
metrics field it names is one the code writes, every "invariant N" cited resolves to docs/design.md,
no docstring or comment names a module that does not exist, and every relative link and anchor in
README.md, docs/ and bench/RESULTS.md resolves. All static: no process is started."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import io
import itertools
import re
import tokenize
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from nodetrain.config import reference
from nodetrain.config.schema import Config
from nodetrain.run.breakdown import PHASES

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *sorted(DOCS.glob("*.md"))]
PENDING = {"planner.md", "tier.md", "activation_offload.md"}
"""docs/ pages other parts of issues 22 and 23 write; a link to one is checked once it exists."""


# --- configuration.md -------------------------------------------------------------------------


def _schema_keys(obj=None, prefix: str = "") -> set[str]:
    """Dotted key of every leaf of the schema (a dataclass field that is not itself a dataclass)."""
    obj = Config() if obj is None else obj
    keys = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys |= _schema_keys(value, f"{prefix}{f.name}.")
        else:
            keys.add(f"{prefix}{f.name}")
    return keys


def _page_keys(text: str) -> list[str]:
    """The first-column keys of the page's key tables (not the group table)."""
    return re.findall(r"^\| `([\w.]+)` \| `[^`]*` \| `", text, re.M)


def test_configuration_page_is_what_the_schema_generates() -> None:
    text = reference.DOC.read_text(encoding="utf-8")
    fix = "python -m nodetrain.config.reference --write"
    assert text == reference.render(), f"docs/configuration.md is stale: {fix}"


def test_configuration_page_names_every_schema_key_once_and_no_other() -> None:
    keys = _page_keys(reference.DOC.read_text(encoding="utf-8"))
    schema = _schema_keys()
    assert len(schema) > 100
    assert sorted(schema - set(keys)) == [], "keys of the schema missing from docs/configuration.md"
    assert sorted(set(keys) - schema) == [], "docs/configuration.md names keys the schema lacks"
    assert len(keys) == len(set(keys)), "a key is listed twice"


def test_every_user_field_of_the_schema_has_a_docstring() -> None:
    undocumented = [f.key for _, _, leaves in reference.fields() for f in leaves if not f.doc]
    assert undocumented == []


# --- metrics.md -------------------------------------------------------------------------------


def documented_metrics() -> tuple[set[str], set[str]]:
    """(step fields, per-stage fields) of docs/metrics.md's two tables."""
    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    step = text.split("## Step fields", 1)[1].split("\n## ", 1)[0]
    stage = text.split("## Per-stage fields", 1)[1].split("\n## ", 1)[0]

    def names(section: str) -> set[str]:
        cells = re.findall(r"^\| ((?:`[\w/<>]+`(?:, )?)+) \|", section, re.M)
        return {n for cell in cells for n in re.findall(r"`([\w/<>]+)`", cell)}

    return names(step), names(stage)


def undocumented_metrics(keys) -> list[str]:
    """The keys of written ``metrics.jsonl`` records that docs/metrics.md does not document."""
    step, stage = documented_metrics()
    missing = set()
    for key in keys:
        if m := re.fullmatch(r"stage\d+/(\w+)", key):
            ok = m[1] in stage
        elif m := re.fullmatch(r"replica\d+/(\w+)", key):
            ok = m[1] == "step_s"
        else:
            ok = key in step
        if not ok:
            missing.add(key)
    return sorted(missing)


def _string_constants() -> set[str]:
    """Every string literal of nodetrain/ (f-strings' literal parts too)."""
    out = set()
    for path in (ROOT / "nodetrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


def test_every_documented_metrics_field_is_one_the_code_writes() -> None:
    """The other direction, every written field documented, is checked on a real run's
    metrics.jsonl in tests/e2e/test_train_cli.py (:func:`undocumented_metrics`)."""
    step, stage = documented_metrics()
    assert len(step) > 30 and len(stage) > 20
    written = _string_constants() | {f"{p}_s" for p in PHASES}
    assert sorted((step | stage) - written) == []


def test_a_stage_or_step_key_the_page_lacks_is_reported() -> None:
    assert undocumented_metrics(["loss", "stage1/window_bytes", "replica1/step_s"]) == []
    assert undocumented_metrics(["stage1/lossy", "made_up_s", "replica0/mfu"]) == [
        "made_up_s",
        "replica0/mfu",
        "stage1/lossy",
    ]


# --- invariants -------------------------------------------------------------------------------

_CITATION = re.compile(r"\binvariants? (\d+(?:(?:, | and | or |-)\d+)*)", re.I)


def _invariants() -> set[int]:
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    section = text.split("\n## Invariants\n", 1)[1].split("\n## ", 1)[0]
    return {int(n) for n in re.findall(r"^(\d+)\. \*\*", section, re.M)}


def _cited_files() -> list[Path]:
    files = [p for d in ("nodetrain", "tests", "bench", "launch") for p in (ROOT / d).rglob("*.py")]
    return [*files, *(ROOT / "bench").glob("*.sh"), *PAGES]


def test_every_cited_invariant_is_a_numbered_invariant_of_docs_design() -> None:
    numbers = _invariants()
    assert numbers == set(range(1, 11)), numbers
    bad, seen = [], 0
    for path in _cited_files():
        for m in _CITATION.finditer(path.read_text(encoding="utf-8")):
            for n in map(int, re.findall(r"\d+", m[1])):
                seen += 1
                if n not in numbers:
                    bad.append(f"{path.relative_to(ROOT)}: {m[0]!r}")
    assert seen > 15 and bad == []


def test_no_text_says_the_design_lives_outside_the_repository() -> None:
    stale = re.compile(r"outside (this|the) repository|shared/(?:DESIGN)|workspace's `?shared/", re.I)
    hits = [str(p.relative_to(ROOT)) for p in _cited_files() if stale.search(p.read_text(encoding="utf-8"))]
    assert hits == []


# --- module paths in docstrings and comments --------------------------------------------------

_PATH = re.compile(r"(?<![\w/.<*-])((?:[\w-]+/)*[A-Za-z_]\w*\.py)\b")
_PAGE = re.compile(r"(?<![\w/.-])(docs/[\w-]+\.md|bench/RESULTS\.md)")
_PY_NAMES = {p.name for d in ("nodetrain", "bench", "tests", "launch") for p in (ROOT / d).rglob("*.py")}


def _external(ref: str) -> bool | None:
    """True/False when ``ref`` starts with an installed package other than nodetrain (does the file
    exist there?); None when it does not."""
    top = ref.split("/", 1)[0]
    if "/" not in ref or top in ("nodetrain", "bench", "tests", "launch", "conf", "docs"):
        return None
    spec = importlib.util.find_spec(top) if top.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        return None
    return any((Path(loc) / ref.split("/", 1)[1]).is_file() for loc in spec.submodule_search_locations)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _resolves(ref: str, where: Path) -> bool:
    """The checkout's own files first: a folder a run leaves in the working directory (``data/``,
    ``runs/``) is an importable namespace package, not the package a reference means."""
    if "/" not in ref:
        return ref in _PY_NAMES or bool(_external(ref))
    bases = (ROOT, ROOT / "nodetrain", where.parent, where.parent.parent)
    return any((base / ref).is_file() for base in bases) or bool(_external(ref))


def _page_exists(ref: str) -> bool:
    return (ROOT / ref).is_file() or Path(ref).name in PENDING


def _prose(path: Path):
    """(line, text) of every string and comment of a Python file."""
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)):
            yield tok.start[0], tok.string


def missing_modules(paths) -> list[str]:
    """``file:line: ref`` for each module path (or docs/ page) named in the strings/comments (``.py``)
    or code spans (``.md``) of ``paths`` that does not exist."""
    bad = []
    for path in paths:
        if path.suffix == ".py":
            chunks = _prose(path)
        else:
            text = path.read_text(encoding="utf-8")
            chunks = ((text[: m.start()].count("\n") + 1, m[1]) for m in re.finditer(r"`([^`\n]+)`", text))
        for line, chunk in chunks:
            refs = [m[1] for m in _PATH.finditer(chunk) if not _resolves(m[1], path)]
            refs += [m[1] for m in _PAGE.finditer(chunk) if not _page_exists(m[1])]
            bad += [f"{_rel(path)}:{line}: {ref}" for ref in refs]
    return bad


def test_no_docstring_or_comment_names_a_missing_module() -> None:
    assert missing_modules(sorted((ROOT / "nodetrain").rglob("*.py"))) == []


def test_no_page_names_a_missing_module() -> None:
    assert missing_modules(PAGES) == []


def test_a_renamed_module_is_reported(tmp_path) -> None:
    probe = tmp_path / "probe.py"
    text = '"""Reads stream.py; see nodetrain/engine/stream.py and engine/device/window.py."""\n'
    text += "# optim.py, docs/x.md\n"
    probe.write_text(text)
    assert missing_modules([probe]) == [
        "probe.py:1: stream.py",
        "probe.py:1: nodetrain/engine/stream.py",
        "probe.py:2: optim.py",
        "probe.py:2: docs/x.md",
    ]


def test_a_folder_a_run_leaves_in_the_working_directory_hides_no_module(tmp_path, monkeypatch) -> None:
    """README command 1 then command 2 in one checkout: a ``data/`` folder in the working directory
    (on ``sys.path``, an importable namespace package ``data``) must not make ``data/checks.py``
    (nodetrain/data/checks.py) look missing; a reference to no file at all is still reported."""
    (tmp_path / "data").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert importlib.util.find_spec("data").submodule_search_locations  # the trap is set
    probe = tmp_path / "probe.py"
    probe.write_text('"""See data/checks.py and data/sft.py; not data/nowhere.py."""\n')
    assert missing_modules([probe]) == ["probe.py:1: data/nowhere.py"]


# --- links ------------------------------------------------------------------------------------

_MD = MarkdownIt("commonmark").enable("table")


def _slug(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens, -N for repeats."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    return slug if n == 0 else f"{slug}-{n}"


def anchors(path: Path) -> set[str]:
    tokens, seen, out = _MD.parse(path.read_text(encoding="utf-8")), {}, set()
    for prev, tok in itertools.pairwise(tokens):
        if prev.type == "heading_open" and tok.type == "inline":
            text = "".join(c.content for c in tok.children if c.type in ("text", "code_inline"))
            out.add(_slug(text, seen))
    out |= set(re.findall(r'<a id="([\w-]+)"></a>', path.read_text(encoding="utf-8")))
    return out


def links(path: Path) -> list[str]:
    """Every link and image target of a Markdown page."""
    found = []
    for tok in _MD.parse(path.read_text(encoding="utf-8")):
        for child in tok.children or []:
            if child.type == "link_open":
                found.append(child.attrs["href"])
            elif child.type == "image":
                found.append(child.attrs["src"])
    return found


def broken_links(paths) -> list[str]:
    bad = []
    for path in paths:
        for href in links(path):
            if re.match(r"[a-z]+:", href):
                continue  # http(s), mailto: not checked offline
            target, _, anchor = href.partition("#")
            file = (path.parent / target).resolve() if target else path
            if not file.exists():
                if file.name not in PENDING or file.parent != DOCS:
                    bad.append(f"{_rel(path)}: {href} (no such file)")
                continue
            if anchor and file.suffix == ".md" and anchor not in anchors(file):
                bad.append(f"{_rel(path)}: {href} (no such anchor)")
    return bad


def test_every_relative_link_and_anchor_resolves() -> None:
    assert sum(len(links(p)) for p in PAGES) > 60
    assert broken_links(PAGES) == []


def test_a_broken_anchor_and_a_missing_page_are_reported(tmp_path) -> None:
    page = tmp_path / "probe.md"
    page.write_text("# Probe\n\n## Two words\n\n[ok](#two-words) [bad](#three-words) [gone](nowhere.md)\n")
    want = ["probe.md: #three-words (no such anchor)", "probe.md: nowhere.md (no such file)"]
    assert broken_links([page]) == want


def test_mkdocs_nav_lists_every_docs_page() -> None:
    nav = set(re.findall(r":\s*([\w.]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages <= nav, sorted(pages - nav)
    assert nav <= pages | PENDING, sorted(nav - pages - PENDING)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_docs_index_links_every_page(page: str) -> None:
    targets = {Path(h.partition("#")[0]).name for h in links(ROOT / page)}
    assert {p.name for p in DOCS.glob("*.md")} - {"index.md"} <= targets | {Path(page).name}
