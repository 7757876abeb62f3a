"""Training benchmark on one GPU; ``bench/gpu_check.sh`` runs it, writing JSON to ``--out``.

    python bench/gpu_train.py --out results/               # on a GPU node (one H200: Llama-3.2-3B)
    python bench/gpu_train.py --out results/moe --shape moe   # Qwen3-30B-A3B's shape, 2 layers
    python bench/gpu_train.py --out /tmp/r --dry-run       # CPU: a tiny shape, 3 steps, one run

Trains a model of ``bench/_gpu_shapes.py`` (its host store, ~18.5 bytes per parameter, goes to the
roomier of /dev/shm and $TMPDIR, and the model is shortened layer by layer if neither, or the free
memory, holds it) with ``torchrun --nproc_per_node 1 -m nodetrain.train`` on the Shakespeare text,
bf16, seq 4096, 4 micro-batches of 2, at the shape's constant learning rate (1e-5, no warm-up: the
loss goes down from the first step), for a few steps. ``dense`` (Llama-3.2-3B): first with every
unit streaming (``stream.device_budget=0``) in one wave of the step's micro-batches
(``pipeline.wave``), then, if time is left, with the automatic residency, then streamed at 16
micro-batches in one wave (issue 31's MFU bar); ``moe``: one run with the automatic residency. From
each run's ``metrics.jsonl`` it writes ``<out>/<run>.json``: median step time, TFLOP/s, MFU (on
active parameters, against the datasheet peak of the hardware profile naming the GPU, e.g. 989.4
TFLOP/s dense bf16 for an H200, or ``--peak-flops``; the source is ``peak_flops_source``), H2D/D2H
GB/s, stall %, d2h_wait %, host-accumulation seconds per step (the D2H worker's busy time), D2H and
host-accumulation GB per step, the losses (a run whose last loss is not below its first fails), the
start-up (``startup_s``: building the engine, i.e. populating the host store, initialising the
weights and page-locking the transfer copies; ``startup_gbps``: store bytes per second of it), and
the last step's whole breakdown, and ``<out>/summary.json`` with all runs (and ``failed``: the runs
that did not finish or whose loss did not go down, with why).

No run writes a checkpoint (``checkpoint.enable=false``): the 3B model's final checkpoint is ~45 GB,
which a 64 GiB disk may not hold next to the results. ``--checkpoint`` saves the streamed run's
final checkpoint (its save time is in its last step's ``ckpt_stall_s``), after checking up front
that the free space of ``--out`` holds it (less the host store's size when the store lives on the
same filesystem); otherwise it refuses before any launch, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._gpu_shapes import DENSE, SHAPES, GpuShape, fit_layers  # noqa: E402
from bench._launch import kill_job, start_job, train_cmd  # noqa: E402
from nodetrain.run.breakdown import PHASES  # noqa: E402


def checkpoint_nbytes(layers: int, dry_run: bool, shape: GpuShape = DENSE) -> int:
    """Bytes of one checkpoint of the benchmark model (bf16 export + fp32 master and AdamW moments)."""
    from nodetrain.run.outputs import checkpoint_bytes

    return checkpoint_bytes(shape.hf_model(layers, dry_run), "bfloat16")


def checkpoint_refusal(out: Path, store_dir: str, store_nbytes: int, ckpt_nbytes: int) -> str | None:
    """Why the streamed run's final checkpoint cannot be written under ``out`` (None: it can).

    The checkpoint goes to ``<out>/run_streamed/checkpoints``; it needs ``ckpt_nbytes`` of the free
    space of ``out``'s filesystem, of which the host store takes ``store_nbytes`` first when
    ``store_dir`` is on the same filesystem (the store does not exist yet when this is asked).
    """
    free = shutil.disk_usage(out).free
    shared = os.stat(out).st_dev == os.stat(store_dir).st_dev
    room = free - (store_nbytes if shared else 0)
    if ckpt_nbytes <= room:
        return None
    store = (
        f", less the host store's {store_nbytes / 1e9:.1f} GB in {store_dir} on the same filesystem"
        if shared
        else ""
    )
    return (
        f"--checkpoint: the final checkpoint needs {ckpt_nbytes / 1e9:.1f} GB but {out} has "
        f"{free / 1e9:.1f} GB free{store}; free space there, point --out at a larger filesystem, or run "
        "without --checkpoint"
    )


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def train(name: str, overrides: list[str], out: Path, timeout_s: float, nproc: int = 1) -> list[dict]:
    """One ``torchrun --nproc_per_node <nproc> -m nodetrain.train`` launch; its step records.

    The launch runs in a session of its own: past ``timeout_s``, or when this process gets SIGTERM
    (gpu_check.sh's ``timeout``) or Ctrl-C, the whole job (torchrun and every rank, which hold the GPU
    and the host store) is killed, not only torchrun.

    Raises:
        RuntimeError: the launch failed or ran past ``timeout_s`` (its output is in ``<out>/<name>.log``).
    """
    run_dir = out / f"run_{name}"
    cmd = train_cmd(nproc, run_dir, *overrides)
    proc = start_job(cmd, ROOT, stderr=subprocess.STDOUT)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        output, _ = proc.communicate(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        kill_job(proc)
        output, _ = proc.communicate()
        (out / f"{name}.log").write_text(output)
        raise RuntimeError(f"{name}: killed after {timeout_s:.0f} s; see {out / f'{name}.log'}") from None
    except BaseException:  # SIGTERM or Ctrl-C: the job must not outlive this process
        kill_job(proc)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    (out / f"{name}.log").write_text(output)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}; see {out / f'{name}.log'}:\n{output[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def startup(log: Path) -> float | None:
    """Seconds rank 0 spent building its engine, from its log's timestamps: from the first line of
    ``build_engine`` (its threads bound) to the engine's layout line, i.e. measuring the machine,
    populating the host store, initialising the weights and page-locking the transfer copies. None
    when either line is missing."""
    marks = {}
    for line in log.read_text(errors="replace").splitlines():
        key = "start" if "host threads of this rank" in line else "end" if "(replica " in line else None
        if key and key not in marks:
            stamp = line[1 : line.index("]")]  # [2026-12-04 17:48:05,258][rank0]...
            marks[key] = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
    if len(marks) < 2:
        return None
    return (marks["end"] - marks["start"]).total_seconds()


def summarise(records: list[dict], skip: int) -> dict:
    """Medians over the steps after the first ``skip`` (warm-up), and the last step's breakdown."""
    steady = records[skip:] or records[-1:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    return {
        "steps_measured": len(steady),
        "step_s": med("step_s"),
        "tokens_per_s": med("tokens_per_s"),
        "tflops": med("tflops"),
        "mfu": med("mfu"),
        "h2d_gbps": med("h2d_gbps"),
        "d2h_gbps": med("d2h_gbps"),
        "stall_pct": 100 * med("stall_s") / med("step_s"),
        "d2h_wait_pct": 100 * med("d2h_wait_s") / med("step_s"),
        # the D2H worker's busy seconds per step (waiting for its staging copy, then adding the
        # gradient into the host store: the host accumulation), summed over ranks
        "host_accum_s": med("d2h_busy_s"),
        "d2h_gb_per_step": med("d2h_bytes") / 1e9,
        "accum_host_gb_per_step": statistics.median(r.get("accum_host_bytes", 0) for r in steady) / 1e9,
        "shares_pct": {k: 100 * med(f"{k}_s") / med("step_s") for k in PHASES},
        "peak_flops_source": records[-1].get("peak_flops_source"),
        "num_resident": records[-1].get("num_resident"),
        "losses": [r["loss"] for r in records],
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
        "loss_decreased": records[-1]["loss"] < records[0]["loss"],
        "last_step": records[-1],
    }


def _common(shape: GpuShape, layers: int, args, store_dir: str) -> list[str]:
    """The overrides every run of ``shape`` shares: model, batch, steps, dtype, data, store, lr."""
    seq, mb, m = shape.batch(args.dry_run)
    lr = shape.train_lr(args.dry_run)
    common = [
        *shape.overrides(layers, args.dry_run),
        f"train.steps={args.steps}",
        f"train.seq_len={seq}",
        f"train.micro_batch_size={mb}",
        f"pipeline.microbatches={m}",
        "train.eval_every=0",
        "train.dtype=bfloat16",
        "logging.wandb=false",
        f"data.dir={args.out / 'data'}",
        f"store.dir={store_dir}",
        f"optim.lr={lr}",
        f"optim.min_lr={lr}",
        "optim.warmup_steps=0",
    ]
    if args.dry_run:  # a small real text (this repo's README and docs/) tokenizes in seconds
        corpus = args.out / "corpus.txt"
        pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # ~110 KB of text
        corpus.write_text("\n".join(p.read_text(encoding="utf-8") for p in pages), encoding="utf-8")
        common += [f"data.source={corpus}", "data.vocab_size=300"]
    elif args.peak_flops:
        common += [f"train.peak_flops={args.peak_flops}"]
    return common


def _runs(shape: GpuShape, checkpoint: bool, m: int) -> list[tuple[str, list[str], float]]:
    """(name, overrides, seconds it needs at least) of each run of ``shape``, in order: ``dense``
    streams every unit in one wave of its ``m`` micro-batches (``pipeline.wave``, issue 31), then the
    automatic residency, then, if time is left, the streamed run at 16 micro-batches in one wave."""
    if shape.name == "moe":
        return [("moe", ["checkpoint.enable=false"], 0)]
    save = ["checkpoint.enable=true", "checkpoint.every=0"] if checkpoint else ["checkpoint.enable=false"]
    off = ["checkpoint.enable=false"]
    # the H200 run's automatic-residency launch (6 steps) took ~90 s: 35 s start-up, 3.5 s steps;
    # at 16 micro-batches a step is ~9 s (bench: the planner's streamed 3B at M=16)
    return [
        ("streamed", ["stream.device_budget=0", f"pipeline.wave={m}", *save], 0),
        ("auto_residency", off, 80),
        (
            "streamed_m16",
            ["stream.device_budget=0", "pipeline.microbatches=16", "pipeline.wave=16", *off],
            100,
        ),
    ]


def _with(common: list[str], extra: list[str]) -> list[str]:
    """``common`` with ``extra`` appended, less the common overrides whose key ``extra`` sets (Hydra
    refuses a key given twice)."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in common if o.split("=", 1)[0] not in keys] + extra


def _run_all(shape, common, args, t_start: float, summary: dict) -> None:
    """Each run of ``shape`` (the dry run: the first only) while ``--budget-s`` lasts, into ``summary``."""
    runs = _runs(shape, args.checkpoint, shape.batch(args.dry_run)[2])
    for name, extra, need_s in runs[:1] if args.dry_run else runs:
        left = args.budget_s - (time.monotonic() - t_start)
        if left < need_s:
            print(f"{name}: skipped, {left:.0f} s left")
            continue
        try:
            records = train(name, _with(common, extra), args.out, timeout_s=left)
        except RuntimeError as e:  # the other run still gets its time; the summary says what failed
            print(e, file=sys.stderr, flush=True)
            summary["failed"][name] = str(e)[-2000:]
            continue
        result = summarise(records, skip=1 if args.dry_run else 2)
        seconds = startup(args.out / f"run_{name}" / "rank0.log")
        result["startup_s"] = seconds
        result["startup_gbps"] = summary["store_bytes"] / seconds / 1e9 if seconds else None
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
        summary["runs"][name] = {k: v for k, v in result.items() if k != "last_step"}
        if not result["loss_decreased"]:
            summary["failed"][name] = f"the loss did not go down: {result['losses']}"
        print(f"{name}: " + json.dumps(summary["runs"][name]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="dense", help="bench/_gpu_shapes.py")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny shape, 3 steps, one run")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--budget-s", type=float, default=330, help="wall seconds for all runs")
    ap.add_argument("--peak-flops", type=float, default=0.0, help="0: the GPU's datasheet (conf/hardware)")
    ap.add_argument(
        "--store-dir", action="append", help="candidate store directories (default /dev/shm, $TMPDIR)"
    )
    ap.add_argument(
        "--checkpoint",
        action="store_true",
        help="save the streamed run's final checkpoint (disk checked first)",
    )
    args = ap.parse_args()
    t_start = time.monotonic()
    shape = SHAPES[args.shape]
    args.out.mkdir(parents=True, exist_ok=True)
    args.steps = 3 if args.dry_run else args.steps
    dirs = args.store_dir or ["/dev/shm", tempfile.gettempdir()]
    layers, nbytes, room, store_dir = fit_layers(shape, dirs, args.dry_run)
    where = f"{store_dir} ({room / 1e9:.1f} GB room)"
    print(f"model: {shape.model}, {layers} layers, host store {nbytes / 1e9:.1f} GB in {where}")
    if args.checkpoint:
        refusal = checkpoint_refusal(
            args.out, store_dir, nbytes, checkpoint_nbytes(layers, args.dry_run, shape)
        )
        if refusal:
            print(refusal, file=sys.stderr)
            sys.exit(2)
    seq, mb, m = shape.batch(args.dry_run)
    summary = {
        "model": shape.model,
        "shape": shape.name,
        "dry_run": args.dry_run,
        "layers": layers,
        "store_bytes": nbytes,
        "store_dir": store_dir,
        "tokens_per_step": seq * mb * m,
        "lr": shape.train_lr(args.dry_run),
        "peak_flops": args.peak_flops or None,
        "runs": {},
        "failed": {},
    }
    _run_all(shape, _common(shape, layers, args, store_dir), args, t_start, summary)
    summary["wall_s"] = time.monotonic() - t_start
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    sys.exit(1 if summary["failed"] else 0)


if __name__ == "__main__":
    main()
