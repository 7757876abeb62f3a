"""Planner vs a GPU run: predicted and measured step time and phases of every run in a run directory.

    python bench/plan_accuracy.py --run ../shared/gpu-runs/2026-12-04-h200
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
under 2% of the measured step is compared as within 2% of the step: its relative error means nothing).
"""

from __future__ import annotations

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

__all__ = ["OLD_RUNS", "PHASES", "Row", "read_runs", "compare", "report", "main"]

OLD_RUNS = ("optim.on_device=false", "stream.recompute=true")
"""Settings that reproduce what every run before issue 34 did (optimizer on the host, every block
recomputed); later keys of that kind join here."""

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
    def error(self) -> float:
        return self.predicted / self.measured - 1 if self.measured else float("inf")


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
            bound = 0.15 if label == "step" else 0.25
            ok = abs(p - m) <= bound * m or (
                label != "step" and m < 0.02 * step and abs(p - m) <= 0.02 * step
            )
            rows.append(Row(name, label, p, m, ok))
    return rows, problems


def report(run_dir: Path, warmup: int = 2) -> bool:
    """Print the comparison; True when every figure is within its bound and the placements agree."""
    rows, problems = compare(run_dir, warmup)
    print(f"planner vs {run_dir} (medians of steps > {warmup}; step ≤ 15%, phases ≤ 25%)")
    print(f"{'run':<12}{'figure':<10}{'predicted s':>12}{'measured s':>12}{'error':>9}  ok")
    for r in rows:
        verdict = "yes" if r.ok else "NO"
        print(f"{r.run:<12}{r.name:<10}{r.predicted:>12.3f}{r.measured:>12.3f}{r.error:>+9.1%}  {verdict}")
    for p in problems:
        print(f"placement differs: {p}")
    ok = all(r.ok for r in rows) and not problems
    print(f"target {'met' if ok else 'MISSED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    warmup = int(next((a.split("=")[1] for a in args if a.startswith("--warmup=")), "2"))
    dirs = [Path(a) for a in args if not a.startswith("--")]
    return 0 if all([report(d, warmup) for d in dirs]) else 1


if __name__ == "__main__":
    sys.exit(main())
