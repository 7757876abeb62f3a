"""Sweep over shapes that change the world size: each Hydra job starts its own ``torchrun``.

``torchrun ... -m nodetrain.train --multirun`` runs every job on the same ranks, so it cannot sweep
``pipeline.stages``. This launcher is a Hydra app over the same config (``conf/``): Hydra expands
the sweep, and each job runs ``torchrun --standalone --nproc_per_node <pipeline.stages> -m
nodetrain.train <the job's overrides>`` on this node, writing into the job's directory::

    python launch/sweep.py --multirun pipeline.stages=1,2,4 optim.lr=1e-3,3e-4

Jobs run one after another; a failed job is reported and the next one still starts (Hydra raises
at the end). Each job's wandb run is grouped by the sweep and named by its overrides, as with an
in-process ``--multirun``. ``pipeline.stages=0`` starts one rank per visible GPU (or 1 on CPU).
For a Slurm cluster, ``launch/slurm.sbatch`` starts one multi-node run per job.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from nodetrain.config.registry import register_configs, to_typed
from nodetrain.run.jobs import swept_name

__all__ = ["torchrun_command", "quote"]

log = logging.getLogger("nodetrain.launch.sweep")

# The nodetrain config, with the launcher's own output kept apart from what the job's rank 0
# writes into the same directory (its .hydra/ and rank<N>.log).
_LAUNCHER_CONFIG = {
    "defaults": ["config", "_self_"],
    "hydra": {
        "output_subdir": None,
        "job_logging": {"handlers": {"file": {"filename": "${hydra.runtime.output_dir}/launcher.log"}}},
    },
}


def quote(value: str) -> str:
    """``value`` as a quoted Hydra override value (commas, ``=`` and spaces stay literal)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def torchrun_command(nproc: int, overrides: list[str], run_dir: Path, group: str, name: str) -> list[str]:
    """The command that runs one job: ``torchrun --standalone --nproc_per_node nproc -m nodetrain.train``.

    Args:
        nproc: ranks (= pipeline stages) of this job.
        overrides: the job's Hydra overrides (``key=value``), passed on unchanged.
        run_dir: the job's directory; the run writes there (``hydra.run.dir``).
        group, name: wandb group and name, used unless the overrides set ``logging.group`` /
            ``logging.name``.
    """
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    extra = [f"hydra.run.dir={quote(str(run_dir))}"]
    extra += [
        f"logging.{k}={quote(v)}" for k, v in (("group", group), ("name", name)) if f"logging.{k}" not in keys
    ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "nodetrain.train",
        *overrides,
        *extra,
    ]


def _default_nproc() -> int:
    import torch  # only when pipeline.stages=0

    return max(1, torch.cuda.device_count())


def job(dict_cfg: DictConfig) -> None:
    """One Hydra job: run nodetrain under its own torchrun in the job's directory."""
    cfg = to_typed(dict_cfg)  # a typo is refused here, before any torchrun starts
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweep = Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else run_dir.name
    overrides = list(hc.overrides.task)
    name = swept_name(overrides) or hc.job.override_dirname or run_dir.name
    cmd = torchrun_command(cfg.pipeline.stages or _default_nproc(), overrides, run_dir, sweep, name)
    log.info("job %s: %s", hc.job.get("num", 0), " ".join(cmd))
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


if __name__ == "__main__":
    register_configs()
    ConfigStore.instance().store(name="sweep_launcher", node=_LAUNCHER_CONFIG)
    hydra.main(config_path="../conf", config_name="sweep_launcher", version_base="1.3")(job)()
