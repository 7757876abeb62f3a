"""nodetrain's peers on the same GPU, model and batch; gpu_check.sh runs it (``<out>/peers.json``).

    python bench/gpu_peers.py --out results/            # on a GPU node (one H200: about 90 s)
    python bench/gpu_peers.py --out /tmp/r --dry-run    # CPU: the tiny shapes, 3 steps each

Each peer trains the models of ``bench/_gpu_shapes.py`` (the ones ``bench/gpu_train.py`` trains with
nodetrain: same layers, sequence length, micro-batch size and micro-batches per step) on random
tokens, with transformers' own model (``AutoModelForCausalLM.from_config``: sdpa attention, its
default experts kernel) and ``labels=input_ids`` (transformers' shifted, fp32 loss):

- ``plain`` (dense and MoE): everything on the device, bf16 parameters, ``AdamW(fused=True)``;
- ``fsdp2_offload`` (dense): FSDP2 ``fully_shard`` per decoder layer and at the root, world size 1,
  ``CPUOffloadPolicy(pin_memory=True)`` (fp32 master weights and AdamW on the host,
  ``AdamW(foreach=True)``), ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, gradient
  sync on the step's last micro-batch only. In the dry run on a gloo CPU mesh, without pinning (no
  CUDA to page-lock with).

Per peer: median step seconds after the first step, tokens/s, TFLOP/s and MFU (nodetrain's FLOPs per
token, against the datasheet peak of the ``conf/hardware`` profile naming the GPU, or a measured
matmul on a CPU), the losses, peak device memory while training, set-up and wall seconds. ``peers.json`` is
rewritten after each peer, so a peer cut off by ``--budget-s`` (or the caller's timeout) leaves the
others; one skipped for time is listed under ``skipped`` with why.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._gpu_shapes import DENSE, MOE, GpuShape, fit_layers  # noqa: E402
from nodetrain.run.breakdown import hardware_profiles, measured_peak_flops, select_peak_flops  # noqa: E402

PEERS = (("dense", "plain", 4, 15), ("moe", "plain", 4, 15), ("dense", "fsdp2_offload", 3, 60))
"""(shape, peer, steps on the GPU, seconds it needs at least on an H200), cheapest first: the H200
run's FSDP2 offload took 20 s to set up and 18.5 s for its first step, then 8.2 s per step."""
DRY_RUN_STEPS = 3


def _peak(device: torch.device) -> tuple[float, str]:
    """MFU's denominator as nodetrain picks it (``select_peak_flops`` without ``train.peak_flops``)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak, source = select_peak_flops(0.0, name, None, hardware_profiles())
    if peak is None:
        peak = measured_peak_flops(str(device), torch.bfloat16, torch.get_num_threads())
    return peak, source


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_model(shape: GpuShape, layers: int, dry_run: bool, dtype: torch.dtype, device):
    """transformers' own model of ``shape``, randomly initialised in ``dtype`` on ``device``."""
    import transformers

    from nodetrain.model import build_hf_config

    config = build_hf_config(shape.model_cfg(layers, dry_run))
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _train(model, opt, batches: torch.Tensor, device: torch.device, last_only=None) -> tuple[list, list]:
    """Steps of ``batches`` ([steps, M, B, T] int64 on ``device``): per micro-batch a forward with
    ``labels`` and a backward of loss / M, then ``opt.step()``. ``last_only(bool)`` is told before each
    micro-batch whether it is the step's last (FSDP2's gradient sync). Returns step seconds and losses."""
    times, losses = [], []
    if device.type == "cuda":  # the training's peak, not the set-up's
        torch.cuda.reset_peak_memory_stats(device)
    for step_batches in batches:
        _sync(device)
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for i, ids in enumerate(step_batches):  # ids: [B, T]
            if last_only is not None:
                last_only(i == len(step_batches) - 1)
            loss = model(input_ids=ids, labels=ids).loss / len(step_batches)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))  # syncs: the step's time includes all its work
        times.append(time.perf_counter() - t0)
    return times, losses


def run_plain(shape: GpuShape, layers: int, batches, device, dry_run: bool) -> tuple[list, list, float]:
    """Everything on ``device``: bf16 parameters, fused AdamW. Returns step seconds, losses, set-up s."""
    t0 = time.perf_counter()
    model = _hf_model(shape, layers, dry_run, torch.bfloat16, device)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.train_lr(dry_run), weight_decay=0.1, fused=True)
    init_s = time.perf_counter() - t0
    times, losses = _train(model, opt, batches, device)
    return times, losses, init_s


def run_fsdp2_offload(
    shape: GpuShape, layers: int, batches, device, dry_run: bool
) -> tuple[list, list, float]:
    """FSDP2 with CPU offload (module docstring), world size 1. Returns step seconds, losses, set-up s."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    # initialised on the device (seconds for 3B, where a CPU init takes ~15 s); fully_shard moves
    # each fp32 shard to (page-locked) host memory, where the offload policy keeps it
    model = _hf_model(shape, layers, dry_run, torch.float32, device)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=cuda)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.train_lr(dry_run), weight_decay=0.1, foreach=True)
    init_s = time.perf_counter() - t0
    times, losses = _train(model, opt, batches, device, model.set_requires_gradient_sync)
    return times, losses, init_s


RUNNERS = {"plain": run_plain, "fsdp2_offload": run_fsdp2_offload}


def measure(shape: GpuShape, peer: str, steps: int, layers: int, device, dry_run: bool, peak) -> dict:
    """One peer's figures (module docstring) over ``steps`` steps of random tokens."""
    seq, mb, m = shape.batch(dry_run)
    vocab = shape.hf_model(layers, dry_run).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(0, vocab, (steps, m, mb, seq), generator=gen).to(device)
    t0 = time.perf_counter()
    times, losses, init_s = RUNNERS[peer](shape, layers, batches, device, dry_run)
    step_s = statistics.median(times[1:] or times)
    tokens = seq * mb * m
    flops = shape.flops_per_token(layers, dry_run) * tokens / step_s
    return {
        "peer": peer,
        "model": shape.model,
        "layers": layers,
        "step_s": step_s,
        "steps": times,
        "losses": losses,
        "init_s": init_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "tflops": flops / 1e12,
        "mfu": flops / peak[0],
        "peak_flops_source": peak[1],
        "max_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "wall_s": time.perf_counter() - t0,
    }


def _init_world(device: torch.device) -> None:
    """A world of one in this process (FSDP2 needs a process group): NCCL on a GPU, gloo on a CPU."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, the tiny shapes, 3 steps each")
    ap.add_argument("--budget-s", type=float, default=150, help="wall seconds for all peers")
    ap.add_argument(
        "--store-dir", action="append", help="candidate store directories (default /dev/shm, $TMPDIR)"
    )
    args = ap.parse_args()
    t_start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dirs = args.store_dir or ["/dev/shm", tempfile.gettempdir()]
    layers = {s.name: fit_layers(s, dirs, args.dry_run)[0] for s in (DENSE, MOE)}
    peak = _peak(device)
    _init_world(device)
    result = {"dry_run": args.dry_run, "device": str(device), "layers": layers, "skipped": {}}
    try:
        for shape_name, peer, steps, need_s in PEERS:
            shape = DENSE if shape_name == "dense" else MOE
            left = args.budget_s - (time.monotonic() - t_start)
            if not args.dry_run and left < need_s:
                result["skipped"][f"{shape_name}.{peer}"] = f"{left:.0f} s left of --budget-s, needs {need_s}"
                continue
            steps = DRY_RUN_STEPS if args.dry_run else steps
            figures = measure(shape, peer, steps, layers[shape_name], device, args.dry_run, peak)
            result.setdefault(shape_name, {})[peer] = figures
            line = {k: figures[k] for k in ("tokens_per_s", "mfu", "step_s", "init_s", "max_mem_gb")}
            print(f"{shape_name}.{peer}: " + json.dumps(line), flush=True)
            (args.out / "peers.json").write_text(json.dumps(result, indent=1))
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    result["wall_s"] = time.monotonic() - t_start
    (args.out / "peers.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
