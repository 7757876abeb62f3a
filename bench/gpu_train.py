"""Streamed training benchmark on one GPU; ``bench/gpu_check.sh`` runs it, writing JSON to ``--out``.

    python bench/gpu_train.py --out results/            # on a GPU node (one H200: Llama-3.2-3B)
    python bench/gpu_train.py --out /tmp/r --dry-run    # CPU: a tiny shape, 2 steps, streamed only

Trains ``conf/model/llama3_2_3b.yaml`` (3.2B parameters; its host store, ~18 bytes per
parameter, fits the default /dev/shm of a 128 GiB node; the store goes to the roomier of /dev/shm
and $TMPDIR, and the model is shortened layer by layer if neither, or the free memory, holds it)
with ``torchrun --nproc_per_node 1 -m nodetrain.train`` on the Shakespeare text, bf16, seq 4096,
for a few steps: first with every unit streaming (``stream.device_budget=0``), then, if time is
left, with the automatic residency. From each run's ``metrics.jsonl`` it writes
``<out>/<run>.json``: median step time, TFLOP/s, MFU (against the datasheet peak of the hardware
profile naming the GPU, e.g. 989.4 TFLOP/s dense bf16 for an H200, or ``--peak-flops``; the
source is ``peak_flops_source``), H2D/D2H GB/s, stall %, d2h_wait %, host-accumulation seconds
per step (the D2H worker's busy time), D2H and host-accumulation GB per step, and the last step's
whole breakdown, and
``<out>/summary.json`` with all runs (and ``failed``: the runs that did not finish, with why).

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._launch import train_cmd  # noqa: E402
from nodetrain.run.breakdown import PHASES  # noqa: E402

DRY_RUN_HF = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 128,
}
"""The dry run's shape (the layer count comes from ``fit_layers``)."""


def _model(layers: int, dry_run: bool):
    """The benchmark model with ``layers`` decoder layers (templates on the meta device, no memory)."""
    from nodetrain.model import HFModel, build_hf_config

    return HFModel(build_hf_config(_model_cfg(layers, dry_run)))


def store_bytes(layers: int, dry_run: bool) -> int:
    """Host store bytes of the benchmark model with ``layers`` decoder layers."""
    import torch

    from nodetrain.store import StoreLayout

    model = _model(layers, dry_run)
    units = tuple(u.numel for u in model.units)
    return StoreLayout(units, torch.bfloat16, tied_units=(0,) if model.tied else ()).nbytes


def checkpoint_nbytes(layers: int, dry_run: bool) -> int:
    """Bytes of one checkpoint of the benchmark model (bf16 export + fp32 master and AdamW moments)."""
    from nodetrain.run.outputs import checkpoint_bytes

    return checkpoint_bytes(_model(layers, dry_run), "bfloat16")


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


def _model_cfg(layers: int, dry_run: bool):
    from omegaconf import OmegaConf

    from nodetrain.config.schema import ModelConfig

    yaml = OmegaConf.load(ROOT / "conf" / "model" / "llama3_2_3b.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml))
    cfg.hf["num_hidden_layers"] = layers
    if dry_run:
        cfg.hf.update(DRY_RUN_HF)
    return cfg


def fit_layers(store_dirs: list[str], dry_run: bool) -> tuple[int, int, int, str]:
    """(layers, store bytes, room, directory): the most layers (≤ 28) whose store fits 90% of the
    available memory and the free space of the roomiest of ``store_dirs`` (a container's /dev/shm
    may be small; a disk-backed directory then holds the store in the page cache)."""
    import psutil

    free = {d: shutil.disk_usage(d).free for d in store_dirs if os.path.isdir(d)}
    store_dir = max(free, key=free.get)
    room = min(free[store_dir], int(0.9 * psutil.virtual_memory().available))
    layers = 4 if dry_run else 28
    while layers > 1 and store_bytes(layers, dry_run) > room:
        layers -= 1
    return layers, store_bytes(layers, dry_run), room, store_dir


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
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep /tmp/site
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=path)
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        output, _ = proc.communicate(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        (out / f"{name}.log").write_text(output)
        raise RuntimeError(f"{name}: killed after {timeout_s:.0f} s; see {out / f'{name}.log'}") from None
    except BaseException:  # SIGTERM or Ctrl-C: the job must not outlive this process
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    (out / f"{name}.log").write_text(output)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}; see {out / f'{name}.log'}:\n{output[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


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
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
        "last_step": records[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny shape, 2 steps, one run")
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
    args.out.mkdir(parents=True, exist_ok=True)
    dirs = args.store_dir or ["/dev/shm", tempfile.gettempdir()]
    layers, nbytes, room, store_dir = fit_layers(dirs, args.dry_run)
    where = f"{store_dir} ({room / 1e9:.1f} GB room)"
    print(f"model: llama3_2_3b, {layers} layers, host store {nbytes / 1e9:.1f} GB in {where}")
    if args.checkpoint:
        refusal = checkpoint_refusal(args.out, store_dir, nbytes, checkpoint_nbytes(layers, args.dry_run))
        if refusal:
            print(refusal, file=sys.stderr)
            sys.exit(2)
    steps = 2 if args.dry_run else args.steps
    seq, mb, m = (64, 2, 2) if args.dry_run else (4096, 2, 4)
    data_dir = args.out / "data"
    common = [
        "model=llama3_2_3b",
        f"model.hf.num_hidden_layers={layers}",
        f"train.steps={steps}",
        f"train.seq_len={seq}",
        f"train.micro_batch_size={mb}",
        f"pipeline.microbatches={m}",
        "train.eval_every=0",
        "train.dtype=bfloat16",
        "logging.wandb=false",
        f"data.dir={data_dir}",
        f"store.dir={store_dir}",
        "optim.warmup_steps=2",
    ]
    if args.dry_run:  # a small real text (this repo's README and docs/) tokenizes in seconds
        corpus = args.out / "corpus.txt"
        pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # ~110 KB of text
        corpus.write_text("\n".join(p.read_text(encoding="utf-8") for p in pages), encoding="utf-8")
        common += [f"model.hf.{k}={v}" for k, v in DRY_RUN_HF.items()]
        common += [f"data.source={corpus}", "data.vocab_size=300"]
    elif args.peak_flops:
        common += [f"train.peak_flops={args.peak_flops}"]
    summary = {
        "model": "llama3_2_3b",
        "dry_run": args.dry_run,
        "layers": layers,
        "store_bytes": nbytes,
        "store_dir": store_dir,
        "tokens_per_step": seq * mb * m,
        "peak_flops": args.peak_flops or None,
        "runs": {},
        "failed": {},
    }
    save = (
        ["checkpoint.enable=true", "checkpoint.every=0"] if args.checkpoint else ["checkpoint.enable=false"]
    )
    runs = [
        ("streamed", ["stream.device_budget=0", *save], 0),
        ("auto_residency", ["checkpoint.enable=false"], 150),
    ]
    for name, extra, need_s in runs[:1] if args.dry_run else runs:
        left = args.budget_s - (time.monotonic() - t_start)
        if left < need_s:
            print(f"{name}: skipped, {left:.0f} s left")
            continue
        try:
            records = train(name, common + extra, args.out, timeout_s=left)
        except RuntimeError as e:  # the other run still gets its time; the summary says what failed
            print(e, file=sys.stderr, flush=True)
            summary["failed"][name] = str(e)[-2000:]
            continue
        result = summarise(records, skip=1 if args.dry_run else 2)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
        summary["runs"][name] = {k: v for k, v in result.items() if k != "last_step"}
        print(f"{name}: " + json.dumps(summary["runs"][name]), flush=True)
    summary["wall_s"] = time.monotonic() - t_start
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    sys.exit(1 if summary["failed"] else 0)


if __name__ == "__main__":
    main()
