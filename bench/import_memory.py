"""Peak memory of ``model.init_from``: importing a model whose host store is > 1/3 of free RAM.

Not a test (it writes ~1 GB and maps a multi-GB store): run by hand and read the table.

    python bench/import_memory.py                    # 2 ranks, bf16 shards (dtype conversion path)
    python bench/import_memory.py --dtype float32    # fp32 shards (read straight into the store)
    python bench/import_memory.py --reader safe_open # the same import through safetensors.safe_open

The parent writes a Llama-shaped HF directory (hidden 1024, vocab 32000, as many layers as make the
host store exceed ``--fraction`` of the available RAM) shard by shard — random tensors, one at a
time, ``safetensors.torch.save_file`` — so it never holds the model either. Then ``torchrun`` starts
``--ranks`` ranks that build the real ``Engine`` with the import as ``init_from``; a sampler thread
in each rank reads ``/proc/self/status`` every 2 ms. Reported per rank: the store's bytes the rank
fills (shared memory, counted once per node: ``RssShmem``), and the peak rise of its private
memory (``RssAnon + RssFile``, i.e. RSS without the shared store) during the import, against the
bound "largest unit (fp32) + fixed overhead". Memory is checked first; the shape is scaled down
(with a note) so that the store stays under 45 % of the available RAM and of /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nodetrain.config.schema import Config, ModelConfig  # noqa: E402
from nodetrain.model import HFModel, build_hf_config  # noqa: E402
from nodetrain.store import StoreLayout  # noqa: E402

SHAPE = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
FIXED_OVERHEAD_BYTES = 64 << 20
"""Allowed private growth on top of one unit: the 32 MiB conversion buffer, allocator slack, headers."""
SHARD_BYTES = 400 << 20
"""Shard size of the written directory: several units per file, as real HF checkpoints have."""


def _model(layers: int) -> HFModel:
    return HFModel(build_hf_config(ModelConfig(name="bench", hf={**SHAPE, "num_hidden_layers": layers})))


def _store_bytes(model: HFModel) -> int:
    return StoreLayout(tuple(u.numel for u in model.units), torch.bfloat16).nbytes


def _choose_layers(fraction: float) -> tuple[int, str]:
    avail = psutil.virtual_memory().available
    shm_free = shutil.disk_usage("/dev/shm").free
    per_layer = _store_bytes(_model(2)) - _store_bytes(_model(1))
    base = _store_bytes(_model(1)) - per_layer
    want = int((fraction * avail - base) / per_layer) + 1
    cap = int((0.45 * min(avail, shm_free) - base) / per_layer)
    note = ""
    if want > cap:
        note = f"NOTE: scaled down from {want} to {cap} layers to keep the store under 45% of free RAM / shm"
    return max(1, min(want, cap)), note


def _write_dir(model: HFModel, out: Path, dtype: torch.dtype) -> None:
    out.mkdir(parents=True)
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    cfg.to_json_file(out / "config.json")
    gen = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    params = [p for u in model.units for p in u.params]
    for p in params:
        current[p.hf_name] = (torch.randn(p.shape, generator=gen) * 0.02).to(dtype)
        size += current[p.hf_name].numel() * dtype.itemsize
        if size >= SHARD_BYTES or p is params[-1]:
            name = f"part-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(out / name), metadata={"format": "pt"})
            shards.append((name, list(current)))
            current, size = {}, 0
    n = len(shards)
    weight_map = {}
    for i, (name, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {
        "metadata": {"total_size": sum(p.numel * dtype.itemsize for p in params)},
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


# ----------------------------------------------------------------------------- rank side


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


class _Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak_private, self.peak_shmem, self.stop = 0, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            s = _status()
            self.peak_private = max(self.peak_private, s["RssAnon"] + s["RssFile"])
            self.peak_shmem = max(self.peak_shmem, s["RssShmem"])
            time.sleep(0.002)


def _safe_open_load(model_dir: Path, store, units) -> None:
    """The alternative: safetensors' own mmap-based reader, one file open at a time."""
    from nodetrain.checkpoint.tensors import read_index

    index = read_index(model_dir)
    by_file: dict[Path, list] = {}
    for u in units:
        for p in u.params:
            by_file.setdefault(index[p.hf_name].file, []).append((u, p))
    for file, items in by_file.items():
        with safe_open(file, framework="pt") as f:
            for u, p in items:
                store.master(u.index)[p.offset : p.offset + p.numel].copy_(
                    f.get_tensor(p.hf_name).reshape(-1)
                )


def _measured(load, units) -> dict:
    """Run ``load()`` with the sampler on; its time, sizes and the rise of private and shared RSS."""
    base = _status()
    sampler = _Sampler()
    sampler.start()
    t0 = time.perf_counter()
    load()
    import_s = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    end = _status()
    private = base["RssAnon"] + base["RssFile"]
    return {
        "import_s": import_s,
        "units": len(units),
        "owned_fp32": sum(u.numel for u in units) * 4,
        "largest_unit_fp32": max(u.numel for u in units) * 4,
        "base_private": private,
        "peak_private_rise": max(sampler.peak_private, end["RssAnon"] + end["RssFile"]) - private,
        "shmem_rise": max(sampler.peak_shmem, end["RssShmem"]) - base["RssShmem"],
    }


def worker(spec_path: str) -> None:
    import torch.distributed as dist

    from nodetrain.checkpoint import check_model_dir, load_units
    from nodetrain.engine.startup import build_engine

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model = ModelConfig(name="bench", hf={**SHAPE, "num_hidden_layers": spec["layers"]})
    cfg.train.dtype, cfg.train.seq_len, cfg.train.micro_batch_size = "bfloat16", 16, 1
    cfg.store.dir = spec["shm"]
    model = HFModel(build_hf_config(cfg.model))
    model_dir = Path(spec["model_dir"])
    index = check_model_dir(model_dir, model)
    result = {}

    def init_from(store, units):
        result.update(_measured(lambda: load(store, units), units))

    if spec["reader"] == "safe_open":
        load = lambda store, units: _safe_open_load(model_dir, store, units)  # noqa: E731
    else:
        load = lambda store, units: load_units(index, store, units)  # noqa: E731
    engine = build_engine(
        cfg,
        model,
        rank=rank,
        world_size=world,
        local_rank=rank,
        run_id="bench-import",
        device=torch.device("cpu"),
        init_from=init_from,
    )
    u = engine.units[len(engine.units) // 2]  # spot check one tensor against safetensors' own reader
    p = u.params[0]
    with safe_open(index[p.hf_name].file, framework="pt") as f:
        want = f.get_tensor(p.hf_name).float().reshape(-1)
    result["spot_check_equal"] = bool(
        torch.equal(engine.store.master(u.index)[p.offset : p.offset + p.numel], want)
    )
    result["store_bytes"] = engine.store.nbytes
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    engine.close()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=0.36, help="store size / available RAM to aim for")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--reader", choices=["nodetrain", "safe_open"], default="nodetrain")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the HF directory is written")
    args = ap.parse_args()

    avail = psutil.virtual_memory().available
    layers, note = _choose_layers(args.fraction)
    model = _model(layers)
    store = _store_bytes(model)
    shm_free = shutil.disk_usage("/dev/shm").free
    print(f"available RAM {avail / 2**30:.1f} GiB, /dev/shm free {shm_free / 2**30:.1f} GiB")
    if note:
        print(note)
    n_params = sum(u.numel for u in model.units)
    print(
        f"model: {layers} layers, {n_params / 1e6:.0f}M parameters, host store {store / 2**30:.2f} GiB "
        f"= {store / avail:.0%} of available RAM; {args.dtype} shards, reader {args.reader}"
    )
    work = Path(tempfile.mkdtemp(prefix="nt-bench-import-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="nt-bench-import-", dir="/dev/shm"))
    try:
        t0 = time.perf_counter()
        _write_dir(model, work / "hf", getattr(torch, args.dtype))
        files = sorted((work / "hf").glob("model-*.safetensors"))
        gib = sum(f.stat().st_size for f in files) / 2**30
        print(f"wrote {len(files)} shards, {gib:.2f} GiB, in {time.perf_counter() - t0:.1f} s")
        spec = {
            "layers": layers,
            "model_dir": str(work / "hf"),
            "shm": str(shm),
            "out": str(work),
            "reader": args.reader,
        }
        (work / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TRANSFORMERS_VERBOSITY="error")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={args.ranks}",
            f"--master_port={_free_port()}",
        ]
        cmd += ["--master_addr=127.0.0.1", __file__, "--worker", str(work / "spec.json")]
        subprocess.run(cmd, env=env, check=True)
        _report([json.loads((work / f"rank{r}.json").read_text()) for r in range(args.ranks)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def _report(results: list[dict]) -> None:
    mib = 2**20
    print(
        f"\n{'rank':>4} {'units':>5} {'owned fp32':>11} {'largest unit':>12} {'import':>7} "
        f"{'private before':>14} {'peak rise':>10} {'bound':>10} {'store filled':>12}  ok"
    )
    ok_all = True
    for r, x in enumerate(results):
        bound = x["largest_unit_fp32"] + FIXED_OVERHEAD_BYTES
        ok = x["peak_private_rise"] <= bound and x["spot_check_equal"]
        ok_all &= ok
        sizes = [x["owned_fp32"], x["largest_unit_fp32"]]
        print(
            f"{r:>4} {x['units']:>5} {sizes[0] / mib:>8.0f} MiB {sizes[1] / mib:>8.0f} MiB "
            f"{x['import_s']:>6.1f}s {x['base_private'] / mib:>10.0f} MiB "
            f"{x['peak_private_rise'] / mib:>6.0f} MiB {bound / mib:>6.0f} MiB "
            f"{x['shmem_rise'] / mib:>8.0f} MiB  {'yes' if ok else 'NO'}"
        )
    print(
        "\npeak rise = max over the import of (RssAnon + RssFile) minus its value before; bound = "
        f"largest unit (fp32) + {FIXED_OVERHEAD_BYTES / mib:.0f} MiB fixed overhead. The store's pages "
        f"(RssShmem) are shared by all ranks and counted once per node. {'PASS' if ok_all else 'FAIL'}"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
