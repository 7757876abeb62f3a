"""The torchrun command line the benchmarks launch ``nodetrain.train`` with (one node, a free port)."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(nproc: int, run_dir, *overrides: str) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node=N … -m nodetrain.train hydra.run.dir=D …``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += [f"--master_port={free_port()}", "-m", "nodetrain.train", f"hydra.run.dir={run_dir}"]
    return cmd + list(overrides)
