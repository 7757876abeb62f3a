"""Shared by ``host_memory.py`` and ``plan_accuracy.py``: launch ``memory_worker.py`` under torchrun
and plan the same config with ``nodetrain.plan.planner``, so measured and predicted figures come from one
config. Stores go to a private directory under /dev/shm that is removed afterwards."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' job launcher (conftest.py)

from conftest import job_env, torchrun_cmd  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from nodetrain.config.registry import register_configs, to_typed  # noqa: E402
from nodetrain.plan.planner import Plan, make_plan  # noqa: E402

__all__ = ["GB", "MB", "measure", "plan", "err"]

GB, MB = 1e9, 1e6


def measure(
    nproc: int,
    overrides: list[str],
    steps: int = 2,
    timeout_s: float = 900,
    pin_malloc: bool = True,
    calibrate: dict | None = None,
) -> list[dict]:
    """Run the real engine on ``nproc`` ranks (gloo, CPU) and return every rank's figures.

    With ``calibrate`` (``memory_worker._kernels``' keys) the ranks measure the machine's rates right
    before each timed step, after the previous step's updates finished.

    With ``pin_malloc``, ``MALLOC_MMAP_THRESHOLD_`` pins glibc's mmap threshold at 64 kB so freed
    tensors go back to the kernel and a step's resident peak (VmHWM) tracks the bytes actually live
    in it; without, the ranks run with glibc's defaults, as a training run does.
    """
    store_dir = Path(tempfile.mkdtemp(prefix="nt-bench-", dir="/dev/shm"))
    env = job_env(MALLOC_MMAP_THRESHOLD_="65536") if pin_malloc else job_env()
    spec = {"overrides": [*overrides, f"store.dir={store_dir}"], "steps": steps}
    spec = json.dumps({**spec, "calibrate": calibrate} if calibrate else spec)
    cmd = torchrun_cmd(nproc, str(ROOT / "bench/memory_worker.py"), spec)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    finally:
        left = list(store_dir.iterdir())
        shutil.rmtree(store_dir, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    assert not left, f"store files left behind: {left}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def plan(nproc: int, overrides: list[str]) -> Plan:
    """The planner's view of the same run: CPU profile, ``nproc`` stages."""
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_typed(compose("config", overrides=[*overrides, "hardware=cpu", f"pipeline.stages={nproc}"]))
    return make_plan(cfg)


def err(predicted: float, measured: float) -> str:
    """Signed relative error of the prediction, e.g. ``+3.1%``."""
    return f"{(predicted - measured) / measured:+.1%}"
