"""Two pipeline stages on one GPU against one stage: P2P and collectives on a real device.

    python bench/gpu_two_rank.py --out results/             # on the GPU machine (bench/gpu_check.sh)
    python bench/gpu_two_rank.py --out /tmp/r --dry-run     # CPU: the same two launches on gloo

Trains a tiny Llama (hidden 64, 2 layers; this repo's README and docs/ as the corpus) in fp32 with 1F1B,
4 micro-batches, for 5 steps, twice from the same seed and data: ``torchrun --nproc_per_node 1``
(the default backend: NCCL on a GPU, so the step's all-reduce runs on the device) and
``torchrun --nproc_per_node 2 dist.backend=gloo``: two stages sharing the one GPU. NCCL refuses
two ranks on one device ("Duplicate GPU detected"), so this launch moves its activations,
gradients and all-reduces through host memory with gloo, using the same paired
``batch_isend_irecv`` groups as NCCL would (pipeline.p2p_groups). The losses must agree to 1e-5
(fp32; the sums over micro-batches and stages differ only in order). Writes
``<out>/two_rank.json`` (both loss lists, the largest difference, the backends) and exits 1 when
they differ or a launch fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gpu_train import train  # one torchrun launch of nodetrain.train (bench/gpu_train.py)

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
TINY = [
    "model.hf.hidden_size=64",
    "model.hf.num_hidden_layers=2",
    "model.hf.num_attention_heads=4",
    "model.hf.num_key_value_heads=2",
    "model.hf.intermediate_size=128",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "pipeline.microbatches=4",
    "pipeline.schedule=1f1b",
    "train.dtype=float32",
    "train.steps=5",
    "train.eval_every=0",
    "logging.wandb=false",
    "logging.plots=false",  # nothing here reads them (a second of matplotlib per launch)
    "checkpoint.enable=false",  # nothing here reads one
    "data.vocab_size=300",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU: both launches on gloo")
    ap.add_argument("--timeout-s", type=float, default=150, help="per launch")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.out / "corpus.txt"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # ~110 KB of text
    corpus.write_text("\n".join(p.read_text(encoding="utf-8") for p in pages), encoding="utf-8")
    store_dir = tempfile.mkdtemp(prefix="nt-two-rank-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    common = [*TINY, f"data.source={corpus}", f"data.dir={args.out / 'data'}", f"store.dir={store_dir}"]
    t0 = time.monotonic()
    result = {"dry_run": args.dry_run, "tolerance": TOLERANCE, "schedule": "1f1b", "dtype": "float32"}
    result["backend_1rank"] = "gloo (CPU)" if args.dry_run else "default (nccl on a GPU)"
    result["backend_2rank"] = "gloo (two ranks share one GPU: NCCL refuses duplicate devices)"
    one, two = [], []
    try:
        one = [r["loss"] for r in train("one_rank", common, args.out, args.timeout_s)]
        two = [
            r["loss"]
            for r in train("two_rank", [*common, "dist.backend=gloo"], args.out, args.timeout_s, nproc=2)
        ]
    except RuntimeError as e:  # a launch failed: two_rank.json says which and why
        print(e, file=sys.stderr, flush=True)
        result["error"] = str(e)[-2000:]
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    pairs = zip(one, two, strict=True) if len(one) == len(two) else ()
    diff = max((abs(a - b) for a, b in pairs), default=float("inf"))
    result.update(losses_1rank=one, losses_2rank=two, max_abs_diff=diff, wall_s=time.monotonic() - t0)
    result["passed"] = len(one) == len(two) == 5 and diff <= TOLERANCE
    (args.out / "two_rank.json").write_text(json.dumps(result, indent=2))
    print(
        f"two ranks vs one: max |Δloss| {diff:.3g} over {len(one)} steps (≤ {TOLERANCE}: {result['passed']})"
    )
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
