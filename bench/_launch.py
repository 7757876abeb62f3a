"""The torchrun command line the benchmarks launch ``nodetrain.train`` with (one node, a free port), and
how a launched job is killed (the tests' launches too: tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
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


def start_job(cmd: list[str], root, stderr=subprocess.PIPE) -> subprocess.Popen:
    """Start a launch from the checkout ``root`` in a session of its own (so :func:`kill_job` can end it),
    wandb off, ``root`` first on PYTHONPATH (keeping the wheels' /tmp/site after it), stdout piped and
    ``stderr`` piped (or ``subprocess.STDOUT``); the command is printed first."""
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=path)
    print("+", " ".join(cmd), flush=True)
    return subprocess.Popen(
        cmd, cwd=root, env=env, text=True, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True
    )


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun job started with ``start_new_session=True``: its process group and every
    process under the launcher. torchrun starts each rank in a session of its own, so killing the
    group alone leaves the ranks running (holding the GPU and the host store) after a timeout."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)  # before they lose their parent
    except psutil.NoSuchProcess:
        ranks = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
