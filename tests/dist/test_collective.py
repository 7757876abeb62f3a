"""checkpoint/collective.py on two real gloo ranks: JSON values arrive equal, in rank order."""

from __future__ import annotations

import json
import socket

import torch.distributed as dist
import torch.multiprocessing as mp

from nodetrain.checkpoint.collective import all_gather_json, broadcast_json


def _worker(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        value = {"rank": rank, "files": [f"unit-{rank}.safetensors"], "loss": 0.1 * (rank + 1)}
        gathered = all_gather_json(value)
        told = broadcast_json({"from": rank, "ok": True} if rank == 1 else None, src=1)
        out.put((rank, json.dumps([gathered, told])))
    finally:
        dist.destroy_process_group()


def test_broadcast_and_all_gather_json_on_two_gloo_ranks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    want = [{"rank": r, "files": [f"unit-{r}.safetensors"], "loss": 0.1 * (r + 1)} for r in range(2)]
    for rank in range(2):
        gathered, told = json.loads(results[rank])
        assert gathered == want
        assert told == {"from": 1, "ok": True}
