"""Planner vs a GPU run: predicted and measured step time and phases of every run in a run directory.

    python bench/plan_accuracy.py --run tests/data/gpu-runs/2026-12-04-h200
    python bench/plan_gpu_runs.py tests/data/gpu-runs/2026-12-04-h200   # the same, this module alone

A run directory holds, per run NAME, ``NAME_metrics.jsonl`` (one row per step: ``step_s`` and the
breakdown's phases, ``run/breakdown.py``) and ``NAME_rank0.log`` (the start-up lines), and a
``runs.json`` with the planner's overrides: ``overrides`` for every run, ``runs`` NAME → its own
(the shared runs' come from their README's planner command). The log adds the thread counts the run
used (``stream.accum_threads``, ``optim.threads``) and its resident blocks, which are checked against
the plan's. Runs older than the kept-activation and optimizer-on-device placements are planned with
their behaviour-preserving settings (:data:`OLD_RUNS`), so an old run stays checkable.

Measured: the median of the steps after ``--warmup`` (default 2: the first steps compile, allocate
and, at a high learning rate, clip). Predicted: ``nodetrain.plan.planner.make_plan``'s
:class:`~nodetrain.cost.step_time.StepTime`: ``compute_s``, ``stall_s``, ``d2h_wait_s``,
``optim_wait_s`` (the engine's ``optim``: waits for pending updates), ``bubble_s`` and ``step_s``.
Acceptance (issue 33): the step within 15% of the measured median, each phase within 25% (a phase
under 2% of the measured step is compared as within 2% of the step: its relative error means nothing;
a figure measured under 5 ms, :data:`FLOOR_S`, shows the absolute difference in place of the error).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from nodetrain.config.registry import register_configs, to_typed  # noqa: E402
from nodetrain.plan.planner import make_plan  # noqa: E402

__all__ = ["FLOOR_S", "OLD_RUNS", "PHASES", "Row", "read_runs", "compare", "report", "main"]

FLOOR_S = 0.005
"""A measured figure under this many seconds (a bubble of 0) has no meaningful relative error: its
row shows the absolute difference and is judged by it."""

OLD_RUNS = ("optim.on_device=false", "stream.recompute=true", "stream.accum_help=false")
"""Settings that reproduce what every run before issue 34 did (optimizer on the host, every block
recomputed) and before issue 31's part 4 (the D2H worker's adds without the idle optimizer thread's
help); later keys of that kind join here."""

PHASES = (
    ("compute", "compute_s", "compute_s"),
    ("stall", "stall_s", "stall_s"),
    ("d2h_wait", "d2h_wait_s", "d2h_wait_s"),
    ("optim", "optim_s", "optim_wait_s"),
    ("bubble", "bubble_s", "bubble_s"),
    ("step", "step_s", "step_s"),
)
"""(name, the metrics.jsonl field, the StepTime field) of each compared figure."""

_THREADS = re.compile(r"stream\.accum_threads=(\d+).*optim\.threads=(\d+)")
_RESIDENT = re.compile(r"stage (\d+): device budget [\d.]+ MB, (\d+) of (\d+) blocks resident")


@dataclass(frozen=True)
class Row:
    """One figure of one run: predicted and measured seconds, and whether it is within its bound."""

    run: str
    name: str
    predicted: float
    measured: float
    ok: bool

    @property
    def error(self) -> float | None:
        """predicted / measured − 1; None when the measured figure is under :data:`FLOOR_S`."""
        return self.predicted / self.measured - 1 if self.measured >= FLOOR_S else None

    @property
    def shown_error(self) -> str:
        """The relative error, or the absolute difference in seconds under :data:`FLOOR_S`."""
        e = self.error
        if e is not None:
            return f"{e:+.1%}"
        diff = self.predicted - self.measured
        return f"{diff:+.3f} s" if round(diff, 3) else "0.000 s"


def _log_overrides(log: Path) -> tuple[list[str], dict[int, int]]:
    """(thread overrides, stage → resident blocks) from a run's start-up log."""
    text = log.read_text() if log.exists() else ""
    threads = _THREADS.search(text)
    out = [f"stream.accum_threads={threads[1]}", f"optim.threads={threads[2]}"] if threads else []
    return out, {int(m[1]): int(m[2]) for m in _RESIDENT.finditer(text)}


def read_runs(run_dir: Path, warmup: int = 2) -> dict[str, dict]:
    """NAME → {"overrides", "resident" (stage → blocks, from the log), "measured" (field → median)}."""
    spec = json.loads((run_dir / "runs.json").read_text())
    out = {}
    for name, extra in spec["runs"].items():
        rows = [json.loads(x) for x in (run_dir / f"{name}_metrics.jsonl").read_text().splitlines() if x]
        rows = [r for r in rows if r["step"] > warmup]
        threads, resident = _log_overrides(run_dir / f"{name}_rank0.log")
        measured = {f: statistics.median(r[f] for r in rows) for _, f, _ in PHASES}
        overrides = [*spec["overrides"], *OLD_RUNS, *threads, *extra]
        out[name] = {"overrides": overrides, "resident": resident, "measured": measured}
    return out


def _plan(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return make_plan(to_typed(compose("config", overrides=overrides)))


def compare(run_dir: Path, warmup: int = 2) -> tuple[list[Row], list[str]]:
    """(every run's rows, problems: a plan whose resident blocks differ from the run's)."""
    rows, problems = [], []
    for name, run in read_runs(run_dir, warmup).items():
        plan = _plan(run["overrides"])
        for stage, count in run["resident"].items():
            if len(plan.resident[stage]) != count:
                problems.append(
                    f"{name}: stage {stage} planned {len(plan.resident[stage])} resident, ran {count}"
                )
        step = run["measured"]["step_s"]
        for label, field, attr in PHASES:
            p, m = getattr(plan.time, attr), run["measured"][field]
            rows.append(Row(name, label, p, m, _within(label, p, m, step)))
    return rows, problems


def _within(label: str, predicted: float, measured: float, step: float) -> bool:
    """The step within 15% of the measured one, a phase within 25%; a phase under 2% of the step
    within 2% of the step, and any figure under :data:`FLOOR_S` within that floor (absolute)."""
    diff = abs(predicted - measured)
    if measured < FLOOR_S:
        return diff <= max(FLOOR_S, 0.02 * step if label != "step" else 0.0)
    bound = 0.15 if label == "step" else 0.25
    return diff <= bound * measured or (label != "step" and measured < 0.02 * step and diff <= 0.02 * step)


def report(run_dir: Path, warmup: int = 2) -> bool:
    """Print the comparison; True when every figure is within its bound and the placements agree."""
    rows, problems = compare(run_dir, warmup)
    print(f"planner vs {run_dir} (medians of steps > {warmup}; step ≤ 15%, phases ≤ 25%)")
    print(f"{'run':<12}{'figure':<10}{'predicted s':>12}{'measured s':>12}{'error':>9}  ok")
    for r in rows:
        verdict = "yes" if r.ok else "NO"
        print(f"{r.run:<12}{r.name:<10}{r.predicted:>12.3f}{r.measured:>12.3f}{r.shown_error:>9}  {verdict}")
    for p in problems:
        print(f"placement differs: {p}")
    ok = all(r.ok for r in rows) and not problems
    print(f"target {'met' if ok else 'MISSED'}")
    return ok


def _missing(run_dir: Path) -> str | None:
    """Why ``run_dir`` is not a run directory, or None when it holds what :func:`read_runs` reads."""
    what = "runs.json (the planner's overrides), NAME_metrics.jsonl and NAME_rank0.log per run"
    if not run_dir.is_dir():
        why = "not a directory" if run_dir.exists() else "no such directory"
        return f"run directory {run_dir}: {why}; give one that holds {what}"
    if not (run_dir / "runs.json").is_file():
        return f"run directory {run_dir}: no runs.json; a run directory holds {what}"
    try:
        names = json.loads((run_dir / "runs.json").read_text())["runs"]
    except (ValueError, KeyError, TypeError) as e:
        need = '"overrides" (a list) and "runs" (NAME → its overrides)'
        return f"{run_dir / 'runs.json'}: unreadable ({e!r}); it needs {need}"
    gone = [f"{n}_metrics.jsonl" for n in names if not (run_dir / f"{n}_metrics.jsonl").is_file()]
    if gone:
        return f"run directory {run_dir}: runs.json names runs without their {', '.join(gone)}; add them"
    return None


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Compare every run directory given; 0 when all are within bounds, 1 when not, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Planner vs GPU runs: predicted and measured step time and phases."
    )
    where = "a run directory (runs.json, NAME_metrics.jsonl)"
    parser.add_argument("run_dir", nargs="+", type=Path, help=where)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (default 2)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    problems = [p for p in map(_missing, args.run_dir) if p]
    for p in problems:
        print(f"{parser.prog}: error: {p}", file=sys.stderr)
    if problems:
        return 2
    return 0 if all([report(d, args.warmup) for d in args.run_dir]) else 1


if __name__ == "__main__":
    sys.exit(main())
