"""Shared fixtures: launching torchrun jobs (gloo, CPU) and a private store directory in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Debug mode for every test and every job it launches: each write of step state checks its writer's
# thread (nodetrain/engine/threads.py; read when that module is first imported, after this line).
os.environ.setdefault("NODETRAIN_CHECK_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]

TINY_HF = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
"""The HF fields of a tiny Llama (2 layers, 32 wide, 128 tokens) for in-process unit tests."""

TINY_RUN = [
    "model.hf.hidden_size=64",
    "model.hf.num_hidden_layers=2",
    "model.hf.num_attention_heads=4",
    "model.hf.num_key_value_heads=2",
    "model.hf.intermediate_size=128",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "pipeline.microbatches=2",
    "logging.plots=false",
]
"""Hydra overrides of a 2-layer, hidden-64 Llama on 16-token sequences: the cheapest real CLI run
(no PNG plots at its end: a second of matplotlib; a test of the plots a run draws turns them on)."""
TESTS = Path(__file__).resolve().parent
"""tests/: the shared helpers (fixtures, *_worker.py scripts run by path, templates/) live here."""
TIERS = ("unit", "dist", "parity", "e2e")
"""The suite's layers (README): in-process units, multi-process, against references, end to end."""
for _tier in TIERS:  # a test may import a sibling test module's helpers across tiers (test_plan's _config_a)
    if str(TESTS / _tier) not in sys.path:
        sys.path.append(str(TESTS / _tier))


SONNET = (
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
    "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date;\n"
)
"""Four lines of a public-domain sonnet: real text for small training runs."""


def pytest_configure(config) -> None:
    """Under ``-n`` (pytest-xdist) each worker computes on one OpenMP thread, as torchrun gives each rank
    (``OMP_NUM_THREADS=1``): two workers of two threads on CI's two cores spin against each other and
    the ranks they launch (measured: a quarter more CPU seconds in the in-process tests)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n`` (pytest-xdist, what CI runs): each worker takes whole test files, so a module's
    shared launches (its module-scoped fixtures: a reference run several tests read) run once, not
    once per worker."""
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """Overrides for a small real-text corpus (:data:`SONNET` × 200) and its prepared-data dir,
    shared by the launches of one test module."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "sonnet.txt").write_text(SONNET * 200)
    return [f"data.source={d / 'sonnet.txt'}", f"data.dir={d / 'prepared'}", "data.vocab_size=300"]


def prepared_dir(root: Path) -> Path:
    """The one dataset that ``data.prepare`` wrote under the ``data.dir`` root ``root``."""
    (meta,) = Path(root).glob("*/meta.json")
    return meta.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a launched job: this checkout first on ``PYTHONPATH`` (what it held stays:
    the GPU test machine's wheels in /tmp/site), one OpenMP thread per rank (the machine is shared),
    no network (HF hub offline, wandb disabled), quiet transformers, no injected faults; ``extra`` is set
    last (e.g. ``WANDB_MODE="offline"``, or ``NODETRAIN_FAULTS="fail_rank=1,fail_step=2"``,
    nodetrain/run/inject.py)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        WANDB_MODE="disabled",
        NODETRAIN_FAULTS="",
    )
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, *target: str, nnodes: int = 1, node_rank: int = 0, port: int = 0) -> list[str]:
    """``python -m torch.distributed.run`` of ``nproc`` ranks on 127.0.0.1 running ``target``.

    Args:
        target: what torchrun runs and its arguments: ``str(script), *args`` or ``"-m", module, *args``.
        nnodes, node_rank: for a job of several (simulated) nodes; every node's launch must then be
            given the same ``port``.
        port: the rendezvous port; 0 = a free one.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--node_rank", str(node_rank)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port or free_port())]
    return [*cmd, *target]


def start_job(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in the checkout, output (stdout and stderr, text) piped, in a session of its own
    so that a hung job is killed as a whole (torchrun and every rank)."""
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill_job(proc: subprocess.Popen) -> None:
    """``bench._launch.kill_job``: the launcher's group and its ranks (each in a session of its own)."""
    from bench._launch import kill_job as kill

    kill(proc)


def run_torchrun(nproc: int, script: Path, *args: str, timeout_s: float = 180) -> str:
    """Run ``script`` under ``torch.distributed.run`` with ``nproc`` ranks; returns its output.

    Fails the test (with the output's tail) on a non-zero exit or after ``timeout_s``.
    """
    cmd = torchrun_cmd(nproc, str(script), *args)
    proc = start_job(cmd, job_env())
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout_s}s: {' '.join(cmd)}\n{output[-8000:]}")
    except BaseException:  # interrupted (gpu_check.sh's SIGINT at its limit): the job must not outlive us
        kill_job(proc)
        raise
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}: {' '.join(cmd)}\n{output[-8000:]}")
    return output


def shm_store_dir() -> Path:
    """A new private directory in /dev/shm for host stores (other test runs may share /dev/shm); a
    module's shared launch (a module-scoped fixture) makes one and checks it is left empty."""
    return Path(tempfile.mkdtemp(prefix="nt-test-", dir="/dev/shm"))


@pytest.fixture
def shm_dir():
    """A private directory in /dev/shm for host stores (other test runs may share /dev/shm); the
    test's store must be gone from it afterwards."""
    path = shm_store_dir()
    yield path
    left = sorted(p.name for p in path.iterdir())
    shutil.rmtree(path, ignore_errors=True)
    assert not left, f"files left in the store directory: {left}"


@pytest.fixture
def torchrun():
    """``run_torchrun`` as a fixture: ``torchrun(nproc, script, *args, timeout_s=...) -> output``."""
    return run_torchrun


@contextlib.contextmanager
def single_process_world():
    """A gloo world of one in this process (``bench._engine.init_single_process``) while inside;
    torn down with its environment on leaving unless it was already up (later tests launch torchrun
    with ``os.environ``)."""
    import torch.distributed as dist

    from bench._engine import init_single_process

    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved, was_up = {k: os.environ.get(k) for k in keys}, dist.is_initialized()
    init_single_process()
    try:
        yield
    finally:
        if not was_up:
            dist.destroy_process_group()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture
def one_rank_world():
    """:func:`single_process_world` for one test."""
    with single_process_world():
        yield
