"""Host syncs per training step of a one-stage engine, at two micro-batch counts; ``gpu_check.sh`` runs it.

    python bench/gpu_syncs.py --out results/             # on a GPU node: ~20 s
    python bench/gpu_syncs.py --out /tmp/r --dry-run     # CPU: the same code, 2 layers, counter figures

For each of two window set-ups (``streamed``: every unit streams, the embedding by rows;
``resident``: ``stream.device_budget=auto``, on CPU the same as streamed) and two micro-batch counts
(``--microbatches`` M and 2M, 1 × ``--seq-len`` tokens each), a one-stage engine (gloo world of one,
fp32) runs a warm-up step, then ``--steps`` steps under ``torch.cuda.set_sync_debug_mode("warn")``
whose warnings are counted per step and per thread (the training thread is ``MainThread``; the
window's copy workers and the optimizer thread have their own names), then one evaluation likewise,
then one step under ``bench/_sync_count.SyncCounter`` (scalar reads and data moves on the training
thread: what the CPU can see of the same control flow). On CPU (``--dry-run``) only the counter runs.

Writes ``<out>/gpu_syncs.json``: per run (``streamed_m4``, ...) the sync counts per step and their
call sites, and at the top ``syncs_per_step`` (median of the training thread's, per run; null on a
dry run), ``scalar_reads_per_step`` and ``data_moves_per_step`` (the counter's), and
``grows_with_microbatches`` / ``passed``: whether the training thread's counts (syncs on CUDA, the
counter's on a dry run) grow from M to 2M micro-batches in any set-up (they should not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import warnings
from collections import Counter
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._engine import base_config, init_single_process, model_config  # noqa: E402
from bench._sync_count import SyncCounter  # noqa: E402
from nodetrain.config.schema import validate  # noqa: E402
from nodetrain.engine.engine import Engine  # noqa: E402
from nodetrain.engine.startup import build_engine  # noqa: E402
from nodetrain.model import HFModel, build_hf_config  # noqa: E402

VOCAB = 4096
SETUPS = {"streamed": 0, "resident": -1}
"""Run name -> ``stream.device_budget``."""


@contextlib.contextmanager
def sync_warnings(cuda: bool):
    """Yields a Counter of (thread name, "file:line") of every CUDA sync warning inside the block."""
    seen: Counter = Counter()
    if not cuda:
        yield seen
        return

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            seen[(threading.current_thread().name, f"{Path(filename).name}:{lineno}")] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _by_thread(seen: Counter) -> dict[str, int]:
    out: Counter = Counter()
    for (thread, _), n in seen.items():
        out[thread] += n
    return dict(out)


def make_engine(args, m: int, device_budget: int, device: torch.device, store_dir: str, run_id: str):
    layers = {"num_hidden_layers": args.layers} if args.layers else {}
    cfg = base_config(
        model_config(args.model, VOCAB, **layers),
        train={"seq_len": args.seq_len, "micro_batch_size": 1, "steps": 10**6, "dtype": "float32"},
        pipeline={"stages": 1, "microbatches": m},
        stream={"device_budget": device_budget},
    )
    cfg.data.vocab_size, cfg.store.dir = VOCAB, store_dir
    validate(cfg, 1)
    model = HFModel(build_hf_config(cfg.model))
    return build_engine(cfg, model, rank=0, world_size=1, local_rank=0, run_id=run_id, device=device)


def measure(eng: Engine, m: int, args, cuda: bool) -> dict:
    """One engine's figures (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (m, 1, args.seq_len + 1), generator=gen)
    x, y = ids[..., :-1].contiguous(), ids[..., 1:].contiguous()
    eng.train_step(0, x, y)  # warm-up: first-step allocations and pinning
    per_step, others, sites = [], [], Counter()
    for step in range(1, 1 + args.steps):
        with sync_warnings(cuda) as seen:
            eng.train_step(step, x, y)
        threads = _by_thread(seen)
        per_step.append(threads.get("MainThread", 0))
        others.append(sum(n for t, n in threads.items() if t != "MainThread"))
        sites.update(seen)
    with sync_warnings(cuda) as seen:
        eng.eval_loss(x, y)
    with SyncCounter() as counter:
        eng.train_step(1 + args.steps, x, y)
    eng.wait_optimizer()
    grouped: dict[str, dict[str, int]] = {}
    for (thread, where), n in sorted(sites.items()):
        grouped.setdefault(thread, {})[where] = n
    return {
        "microbatches": m,
        "resident": [eng.model.units[i].name for i in eng.window.resident],
        "train_syncs_per_step": per_step if cuda else None,
        "other_thread_syncs_per_step": others if cuda else None,
        "eval_syncs": _by_thread(seen).get("MainThread", 0) if cuda else None,
        "sync_sites": grouped,
        "counter": counter.report(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU: the counter's figures only")
    ap.add_argument("--model", default="llama_10m")
    ap.add_argument("--seq-len", type=int, default=0, help="tokens per micro-batch (0: 256; dry run 32)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's 8; dry run 2)")
    ap.add_argument("--microbatches", type=int, default=4, help="M; also run with 2M")
    ap.add_argument("--steps", type=int, default=0, help="steps counted per engine (0: 3; dry run 1)")
    ap.add_argument("--store-dir", help="host store directory (default: /dev/shm)")
    args = ap.parse_args()
    cuda = not args.dry_run
    args.seq_len = args.seq_len or (256 if cuda else 32)
    args.steps = args.steps or (3 if cuda else 1)
    args.layers = args.layers or (0 if cuda else 2)  # the counts follow the control flow, not the depth
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    init_single_process()
    store_dir = tempfile.mkdtemp(prefix="nt-syncs-", dir=args.store_dir or "/dev/shm")
    runs: dict[str, dict] = {}
    try:
        for name, budget in SETUPS.items():
            for m in (args.microbatches, 2 * args.microbatches):
                eng = make_engine(args, m, budget, device, store_dir, f"syncs-{name}-{m}")
                try:
                    runs[f"{name}_m{m}"] = {"device_budget": budget, **measure(eng, m, args, cuda)}
                finally:
                    eng.close()
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)

    def per_run(fn) -> dict:
        return {name: fn(run) for name, run in runs.items()}

    syncs = per_run(lambda r: statistics.median(r["train_syncs_per_step"]) if cuda else None)
    reads = per_run(lambda r: r["counter"]["scalar_reads"])
    moves = per_run(lambda r: r["counter"]["data_moves"])
    m1, m2 = args.microbatches, 2 * args.microbatches
    judged = [syncs] if cuda else [reads, moves]
    grows = any(f[f"{s}_m{m2}"] > f[f"{s}_m{m1}"] for f in judged for s in SETUPS)
    result = {
        "dry_run": args.dry_run,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "syncs_per_step": syncs,
        "scalar_reads_per_step": reads,
        "data_moves_per_step": moves,
        "grows_with_microbatches": grows,
        "passed": not grows,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_syncs.json").write_text(json.dumps(result, indent=2))
    for key in ("syncs_per_step", "scalar_reads_per_step", "data_moves_per_step", "grows_with_microbatches"):
        print(f"{key}: {json.dumps(result[key])}")


if __name__ == "__main__":
    main()
