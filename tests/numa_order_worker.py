"""Start an Engine and record, in call order, its binding and every page allocation of the host store;
started by torchrun (gloo, CPU) from ``test_host_threads.py``. Not a test itself.

Recorded per rank (``<out_dir>/order_rank<r>.json``): ``["bind"]`` when the engine calls
``bind_rank_threads`` (which binds the rank's threads to its GPU's NUMA node on a GPU node), ``["create"]``
when it calls ``HostStore.create``, and ``["touch", offset, length]`` for every ``posix_fallocate`` of
the store file (the calls that allocate its pages); plus the layout and the units the rank owns.

    python -m torch.distributed.run --nproc_per_node 2 tests/numa_order_worker.py <store dir> <out dir>
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import nodetrain.engine.startup as engine_module
from nodetrain.config.schema import Config, ModelConfig, validate
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config
from nodetrain.run.jobs import exit_process
from nodetrain.store import HostStore

HF = {
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 320,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}


def _record(events: list) -> None:
    """Wrap the calls of interest so that each appends its event before it runs."""
    host_threads, fallocate, create = (
        engine_module.bind_rank_threads,
        os.posix_fallocate,
        HostStore.create.__func__,
    )

    def recorded_host_threads(*args, **kwargs):
        events.append(["bind"])
        return host_threads(*args, **kwargs)

    def recorded_fallocate(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".store"):
            events.append(["touch", offset, length])
        return fallocate(fd, offset, length)

    def recorded_create(cls, *args, **kwargs):
        events.append(["create"])
        return create(cls, *args, **kwargs)

    engine_module.bind_rank_threads = recorded_host_threads
    os.posix_fallocate = recorded_fallocate
    HostStore.create = classmethod(recorded_create)


def main(store_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model = ModelConfig(name="numa-order", arch="LlamaForCausalLM", hf=dict(HF))
    cfg.train.dtype, cfg.train.seq_len, cfg.train.micro_batch_size = "float32", 8, 1
    cfg.pipeline.microbatches, cfg.store.dir, cfg.data.vocab_size = 2, store_dir, HF["vocab_size"]
    validate(cfg, world, int(os.environ["LOCAL_WORLD_SIZE"]))
    model = HFModel(build_hf_config(cfg.model))
    events: list = []
    _record(events)
    local_rank = int(os.environ["LOCAL_RANK"])
    engine = build_engine(
        cfg,
        model,
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        run_id="numa-order",
        device=torch.device("cpu"),
    )
    layout = engine.store.layout
    report = {
        "events": events,
        "units": [u.index for u in engine.units],
        "unit_numels": list(layout.unit_numels),
        "compute_dtype": str(layout.compute_dtype).removeprefix("torch."),
        "tied_units": list(layout.tied_units),
        "nbytes": layout.nbytes,
    }
    (Path(out_dir) / f"order_rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    exit_process(0)  # skip the interpreter's teardown: ~0.8 s of CPU per rank (run/jobs.py)
