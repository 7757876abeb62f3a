"""``bench/gpu_check.sh``'s last step: every step's figures from its JSON files into ``<out>/check.json``.

    OUT=<out> DRY_RUN=--dry-run|"" RCS="rc ..." SECS="s ..." python bench/_check_json.py

RCS and SECS give each step's exit status and wall seconds, in ``STEPS`` order. A step passes when it
exited 0 and its own JSON says it passed; an ``OPTIONAL`` step the deadline left no time for has status
-1 and is listed in ``skipped`` instead. Each nodetrain training run gets ``vs_plain`` and, for the
dense model, ``vs_fsdp2_offload``: its tokens/s over the peer's on the same model (bench/gpu_peers.py;
None when the peer did not run or trained another layer count). Prints check.json; exit status 1
unless every step passed. Not a benchmark itself.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

STEPS = ("gpu_tests", "copy_bandwidth", "two_rank", "gpu_syncs", "train", "peers", "train_moe", "resume")
OPTIONAL = ("two_rank", "train_moe", "resume")
"""Steps gpu_check.sh runs only in the time its deadline leaves; exit status ``SKIPPED`` (-1) when it did
not (listed in ``skipped``, not counted against ``passed``)."""
SKIPPED = -1
RUN_KEYS = (
    "tokens_per_s",
    "tflops",
    "mfu",
    "peak_flops_source",
    "h2d_gbps",
    "d2h_gbps",
    "stall_pct",
    "d2h_wait_pct",
    "host_accum_s",
    "d2h_gb_per_step",
    "step_s",
    "num_resident",
    "loss_first_last",
    "startup_s",
    "startup_gbps",
)
COPY_SUFFIXES = ("_gbps", "pinned")
"""bench/copy_bandwidth.py's figures (GB/s) and page-lock flags, whichever it wrote."""
COPY_KEYS = ("device", "both_overlapped", "h2d_mb", "d2h_mb", "repeats", "errors")
"""And what they mean: where, the two directions overlapped, MB per copy, repeats, parts that failed."""
PEER_KEYS = ("tokens_per_s", "mfu", "step_s", "init_s", "max_mem_gb", "layers")


def load(path: Path) -> dict:
    """A JSON file's object; {} when it is missing or unreadable (its step then fails)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _ratio(run: dict, layers: int, peer: dict | None) -> float | None:
    """The run's tokens/s over the peer's, on the same layer count (else None)."""
    if not peer or peer.get("layers") != layers or not peer.get("tokens_per_s"):
        return None
    return run["tokens_per_s"] / peer["tokens_per_s"]


def _training(step: dict, summary: dict, peers: dict, shape: str) -> None:
    """Each run of ``summary`` (gpu_train.py) into ``step``, with its ratios to the peers of ``shape``."""
    layers = summary.get("layers")
    for name, run in summary.get("runs", {}).items():
        figures = {k: run.get(k) for k in RUN_KEYS}
        figures["vs_plain"] = _ratio(run, layers, peers.get(shape, {}).get("plain"))
        if shape == "dense":
            figures["vs_fsdp2_offload"] = _ratio(run, layers, peers.get(shape, {}).get("fsdp2_offload"))
        step[name] = figures
    step["layers"], step["failed"] = layers, summary.get("failed", {})
    step["passed"] = step["passed"] and bool(summary.get("runs")) and not summary.get("failed")


def _gpu_tests(step: dict, out: Path) -> None:
    try:
        suite = ET.parse(out / "gpu_tests.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        step.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    except (OSError, ET.ParseError, IndexError):
        pass


def collect(out: Path, dry_run: bool, rcs: list[int], secs: list[int]) -> dict:
    """check.json's object (module docstring) from the files under ``out``."""
    steps = {n: {"rc": rc, "s": s, "passed": rc == 0} for n, rc, s in zip(STEPS, rcs, secs, strict=True)}
    skipped = [n for n in OPTIONAL if steps[n]["rc"] == SKIPPED]
    _gpu_tests(steps["gpu_tests"], out)
    copies = load(out / "copy_bandwidth.json")
    steps["copy_bandwidth"].update({k: v for k, v in copies.items() if k.endswith(COPY_SUFFIXES)})
    steps["copy_bandwidth"].update({k: copies.get(k) for k in COPY_KEYS})
    steps["copy_bandwidth"]["passed"] &= bool(copies.get("passed"))
    two = load(out / "two_rank" / "two_rank.json")
    steps["two_rank"].update(
        {k: two.get(k) for k in ("max_abs_diff", "tolerance", "backend_1rank", "backend_2rank")}
    )
    steps["two_rank"]["passed"] &= bool(two.get("passed"))
    syncs = load(out / "gpu_syncs.json")
    keys = ("syncs_per_step", "scalar_reads_per_step", "data_moves_per_step", "grows_with_microbatches")
    steps["gpu_syncs"].update({k: syncs.get(k) for k in keys})
    steps["gpu_syncs"]["passed"] &= bool(syncs.get("passed"))
    peers = load(out / "peers" / "peers.json")
    for shape, peer in (("dense", "plain"), ("dense", "fsdp2_offload"), ("moe", "plain")):
        figures = peers.get(shape, {}).get(peer)
        steps["peers"].setdefault(shape, {})[peer] = (
            {k: figures.get(k) for k in PEER_KEYS} if figures else None
        )
        steps["peers"]["passed"] &= figures is not None
    steps["peers"]["skipped"] = peers.get("skipped", {})
    _training(steps["train"], load(out / "summary.json"), peers, "dense")
    _training(steps["train_moe"], load(out / "moe" / "summary.json"), peers, "moe")
    resume = load(out / "resume" / "resume.json")
    keys = ("steps_equal", "checkpoint_equal", "tensors", "nondeterministic_ops", "deterministic_algorithms")
    steps["resume"].update({k: resume.get(k) for k in keys})
    steps["resume"]["passed"] &= bool(resume.get("passed"))
    env = load(out / "env.json")
    return {
        "dry_run": dry_run,
        "gpu": env.get("gpu"),
        "torch": env.get("torch"),
        "total_s": sum(s["s"] for s in steps.values()),
        "steps": steps,
        "skipped": skipped,
        "passed": all(s["passed"] for n, s in steps.items() if n not in skipped),
    }


def main() -> None:
    out = Path(os.environ["OUT"])
    rcs = [int(x) for x in os.environ["RCS"].split()]
    secs = [int(x) for x in os.environ["SECS"].split()]
    check = collect(out, os.environ.get("DRY_RUN") == "--dry-run", rcs, secs)
    (out / "check.json").write_text(json.dumps(check, indent=1))
    print(json.dumps(check, indent=1))
    raise SystemExit(0 if check["passed"] else 1)


if __name__ == "__main__":
    main()
