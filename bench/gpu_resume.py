"""Resume on one GPU: a run saved at step k and resumed equals the uninterrupted run, bit for bit.

    python bench/gpu_resume.py --out results/resume            # on a GPU node (~30 s)
    python bench/gpu_resume.py --out /tmp/r --dry-run          # CPU, the same small model

``bench/gpu_check.sh`` runs it. Two launches of ``torchrun --nproc_per_node 1`` of
``bench/_deterministic_train.py`` (``nodetrain.train`` with PyTorch's deterministic algorithms and
cuBLAS's reproducible workspace) on a small Llama (4 layers, hidden 256: the dry-run shape of
``bench/_gpu_shapes.DENSE``), bf16 compute, the Shakespeare text of ``gpu_train.py``'s dry run:

1. ``full``: STEPS steps, saving a checkpoint at step K and at the end;
2. ``resumed``: ``checkpoint.resume=<full>/checkpoints/step-K``, on to step STEPS.

Equal means: steps K+1…STEPS have the same loss and gradient norm (the floats ``metrics.jsonl``
holds, compared exactly), and the two final checkpoints hold the same tensors (every
``*.safetensors`` tensor: the bf16 export, fp32 master weights and AdamW moments; ``torch.equal``).
No tolerance: the resume state is the fp32 host store itself, and with deterministic kernels a
resumed step runs the same arithmetic as the uninterrupted one. Ops that warned that they have no
deterministic implementation are listed (``nondeterministic_ops``) and would explain a difference.
Writes ``<out>/resume.json`` and removes the checkpoints once compared; exit status 1 unless equal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._gpu_shapes import DENSE  # noqa: E402
from bench._launch import free_port, kill_job, start_job  # noqa: E402

STEPS, K = 6, 3
"""Steps of the uninterrupted run; the step the resumed one starts from."""
WARNING = "does not have a deterministic implementation"


def _launch(name: str, overrides: list[str], out: Path, timeout_s: float) -> list[dict]:
    """One launch of ``_deterministic_train.py``; its step records (``metrics.jsonl`` lines with a loss).

    Raises:
        RuntimeError: it failed or ran past ``timeout_s`` (its output: ``<out>/<name>.log``).
    """
    run_dir = out / f"run_{name}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=1",
        f"--master_port={free_port()}",
    ]
    cmd += [str(ROOT / "bench" / "_deterministic_train.py"), f"hydra.run.dir={run_dir}", *overrides]
    proc = start_job(cmd, ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException as e:  # a timeout, or this process stopped: the rank must not outlive it
        kill_job(proc)
        if isinstance(e, subprocess.TimeoutExpired):
            raise RuntimeError(f"{name}: killed after {timeout_s:.0f} s") from e
        raise
    (out / f"{name}.log").write_text(stdout + stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}; see {out / f'{name}.log'}:\n{stderr[-2000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors files, keyed ``<file stem>/<name>``."""
    return {
        f"{f.stem.split('-')[0]}/{k}": v
        for f in sorted(step_dir.glob("*.safetensors"))
        for k, v in load_file(f).items()
    }


def compare(full: list[dict], resumed: list[dict], full_ckpt: Path, resumed_ckpt: Path) -> dict:
    """Whether the resumed steps and final checkpoint equal the uninterrupted run's (module docstring)."""
    after = [r for r in full if r["step"] > K]
    resumed = [r for r in resumed if r["step"] > K]  # a checkpoint carries its own step's row back
    keys = ("step", "loss", "grad_norm")
    steps_equal = [[r[k] for k in keys] for r in after] == [[r[k] for k in keys] for r in resumed]
    a, b = _tensors(full_ckpt), _tensors(resumed_ckpt)
    differ = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
    return {
        "steps_equal": steps_equal,
        "losses_full": [r["loss"] for r in after],
        "losses_resumed": [r["loss"] for r in resumed],
        "grad_norms_full": [r["grad_norm"] for r in after],
        "grad_norms_resumed": [r["grad_norm"] for r in resumed],
        "tensors": len(a),
        "tensors_differ": differ[:20],
        "checkpoint_equal": bool(a) and sorted(a) == sorted(b) and not differ,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU")
    ap.add_argument("--timeout-s", type=float, default=90, help="per launch")
    args = ap.parse_args()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.out / "corpus.txt"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    corpus.write_text("\n".join(p.read_text(encoding="utf-8") for p in pages), encoding="utf-8")
    common = [
        *DENSE.overrides(DENSE.dry_run_layers, dry_run=True),
        f"train.steps={STEPS}",
        "train.seq_len=128",  # the small model's max_position_embeddings
        "train.micro_batch_size=2",
        "pipeline.microbatches=2",
        "train.eval_every=0",
        "train.dtype=bfloat16",
        "logging.wandb=false",
        "logging.plots=false",  # compared: the steps and checkpoints, not the plots
        f"data.source={corpus}",
        "data.vocab_size=300",
        f"data.dir={args.out / 'data'}",
        "optim.warmup_steps=2",
        f"checkpoint.every={K}",
        "checkpoint.export_dtype=bfloat16",
    ]
    full = _launch("full", common, args.out, args.timeout_s)
    step_k = args.out / "run_full" / "checkpoints" / f"step-{K}"
    resumed = _launch("resumed", [*common, f"checkpoint.resume={step_k}"], args.out, args.timeout_s)
    result = compare(
        full,
        resumed,
        args.out / "run_full" / "checkpoints" / f"step-{STEPS}",
        args.out / "run_resumed" / "checkpoints" / f"step-{STEPS}",
    )
    for name in ("full", "resumed"):  # compared: the results keep the figures, not ~50 MB per checkpoint
        shutil.rmtree(args.out / f"run_{name}" / "checkpoints")
    logs = [(args.out / f"{n}.log").read_text() for n in ("full", "resumed")]
    warned = {line.strip()[:200] for log in logs for line in log.splitlines() if WARNING in line}
    result.update(
        dry_run=args.dry_run,
        steps=STEPS,
        resumed_from=K,
        deterministic_algorithms=True,
        nondeterministic_ops=sorted(warned),
        passed=result["steps_equal"] and result["checkpoint_equal"],
        wall_s=time.monotonic() - t0,
    )
    (args.out / "resume.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("passed", "steps_equal", "checkpoint_equal", "tensors")}))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
