"""The README: short, its two commands exactly what a user and CI run, and no planner figure in it.

The configuration reference that used to be the README's key table is docs/configuration.md, generated
from the schema and checked both ways by tests/unit/test_docs.py. The planner's figures live on
docs/planner.md and docs/optimizer.md (bench/readme_figures.py checks every document its ``DOCS`` names)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = "python3 -m venv .venv && . .venv/bin/activate && "
TRAIN = VENV + "pip install -e . && torchrun --nproc_per_node 2 -m nodetrain.train"
TEST = VENV + "pip install -e '.[dev]' && python -m pytest -q -n 2"


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_the_readme_is_a_five_minute_read() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)


def test_the_two_commands_are_unchanged_and_ci_runs_both_in_order() -> None:
    """CI runs the README's command 1 (the default job, a few steps) and then command 2 (the tests) in
    one checkout, as a user does: what the run leaves behind is in the tests' way (issue 32, item 1)."""
    blocks = _bash_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert blocks[:2] == [TRAIN, TEST]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci = [ln for ln in ci if ln and not ln.startswith(("#", "set ", "cd ", ".ci/"))]
    launch = TRAIN.rsplit(" && ", 1)[1]  # torchrun ... -m nodetrain.train
    runs = [k for k, ln in enumerate(ci) if ln.startswith(launch)]
    assert len(runs) == 1 and re.fullmatch(r"train\.steps=\d", ci[runs[0]][len(launch) :].strip()), ci
    assert runs[0] == len(ci) - 2, "the default job runs right before the tests"
    assert " && ".join(ci[: runs[0]] + ci[runs[0] + 1 :]) == TEST, ci


def test_the_readme_quotes_no_planner_figure() -> None:
    """No sentence of bench/readme_figures.py's PROSE (figures in any place) and no planner output
    block after a planner command: the planner's figures live on its own page."""
    figures, text = _figures(), (ROOT / "README.md").read_text(encoding="utf-8")
    shapes = [re.escape(p.text).replace("\\ ", r"\s+") for p in figures.PROSE]
    shapes = [re.sub(r"\\\{\w+\\\}", lambda _: figures._NUM, s) for s in shapes]
    prose = [s for s in shapes if re.search(s, text)]
    after = r"```bash\n((?:(?!```).)*)```\n\s*```text\n"
    blocks = [m[1] for m in re.finditer(after, text, re.S) if figures.readme_commands(m[1])]
    assert len(shapes) > 10 and prose == [] and blocks == []


def _figures():
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import readme_figures

    return readme_figures


def test_every_quoted_planner_figure_is_what_its_shown_command_prints() -> None:
    """Doc truths: each planner figure a document of ``DOCS`` quotes (text blocks after the command, and
    the figures in prose, bench/readme_figures.py) is what its command, shown in the same document,
    prints now. After a planner change: ``python bench/readme_figures.py --write`` and read the diff."""
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
