"""The README's configuration table matches the schema (nodetrain/config/schema.py) both ways: every key it
names exists, and every key a user may set is in it (test-only knobs and the fields a group's YAML
sets, such as ``model.hf``, are covered by their group's row)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from nodetrain.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]
GROUP_SET = {"model.name", "model.arch", "model.hf", "data.name"}
"""Fields the group's YAML sets (``model=llama_10m`` ...), documented by the group's row."""


def _schema(obj=None, prefix: str = "") -> dict[str, object]:
    """Dotted key -> default of every leaf of the schema; groups are keys too (value: the dataclass)."""
    obj = obj if obj is not None else Config()
    out = {}
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        out[key] = value
        if dataclasses.is_dataclass(value):
            out.update(_schema(value, f"{key}."))
    return out


def _table_keys() -> list[str]:
    """Keys of the first column of the table under "## Configuration"; ``.entity`` after
    ``logging.project`` means ``logging.entity``."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) > 20, "the configuration table was not found"
    keys = []
    for row in rows:
        prefix = ""
        for token in re.findall(r"`([^`]+)`", row.split("|")[1]):
            key = prefix + token[1:] if token.startswith(".") else token
            prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
            keys.append(key)
    return keys


def _user_keys(schema: dict[str, object]) -> set[str]:
    keys = set()
    for key, value in schema.items():
        if dataclasses.is_dataclass(value) and key not in ("model", "hardware"):
            continue  # a sub-config, not a key; model and hardware are groups chosen by name
        if key.startswith(("test.", "hardware.")) or key.rsplit(".", 1)[-1].startswith("test_"):
            continue  # test-only knobs; hardware.* are the profile's numbers (conf/hardware/)
        if key not in GROUP_SET:
            keys.add(key)
    return keys


def test_every_key_in_the_readme_table_is_in_the_schema() -> None:
    schema = _schema()
    unknown = [k for k in _table_keys() if k not in schema]
    assert unknown == [], f"README config table names keys the schema lacks: {unknown}"


def test_every_user_key_of_the_schema_is_in_the_readme_table() -> None:
    missing = sorted(_user_keys(_schema()) - set(_table_keys()))
    assert missing == [], f"README config table lacks: {missing}"


def _figures():
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import readme_figures

    return readme_figures


def test_every_quoted_planner_figure_is_what_its_shown_command_prints() -> None:
    """README truths: each planner figure README.md and docs/planner.md quote (text blocks after the
    command, and the figures in prose, bench/readme_figures.py) is what its command, shown in the same
    document, prints now. After a planner change: ``python bench/readme_figures.py --write`` and read
    the diff."""
    figures = _figures()
    total = 0
    for doc, path in figures.DOCS.items():
        found, problems = figures.findings(path.read_text(), doc)
        assert not problems, problems
        stale = [f"{doc} {f.where}: {f.now!r}, planner {f.want!r}" for f in found if f.now != f.want]
        assert not stale, "stale planner figures; run python bench/readme_figures.py --write:\n" + "\n".join(
            stale
        )
        total += len(found)
    assert total > 40


def test_a_stale_planner_figure_is_found_and_rewritten(tmp_path, monkeypatch) -> None:
    """The check is not vacuous: an old figure in a text block and one in prose are both reported,
    and --write puts the planner's figures back."""
    figures = _figures()
    text = figures.PLANNER_DOC.read_text()
    tps = figures._find(figures._TPS, figures.plan_output(figures._70B_BUDGET))
    old = text.replace(f"throughput: {tps} tokens/s", "throughput: 7,049 tokens/s", 1)
    old = old.replace(
        f"host accumulation-bound: {figures._find(figures._TPS, figures.plan_output(figures._70B_1T))}",
        "host accumulation-bound: 457",
        1,
    )
    assert old.count("7,049") == 1 + text.count("7,049") and "accumulation-bound: 457 " in old
    stale = {(f.now, f.want) for f in figures.findings(old, "docs/planner.md")[0] if f.now != f.want}
    assert any("7,049" in now and tps in want for now, want in stale), stale
    assert ("457", figures._find(figures._TPS, figures.plan_output(figures._70B_1T))) in stale
    readme = tmp_path / "planner.md"
    readme.write_text(old)
    monkeypatch.setattr(figures, "DOCS", {"docs/planner.md": readme})
    assert figures.main(["--write"]) == 0
    assert readme.read_text() == text
