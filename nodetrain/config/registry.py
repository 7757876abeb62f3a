"""Hydra registration of the schema: ``base_config`` in the ConfigStore, the ``nt_*`` resolvers, and the
one conversion of the composed DictConfig into the typed ``Config`` at an entry point.

Owns: the run id every rank of a launch agrees on (``run_id``), the rank-dependent resolvers the
config files use, ``to_typed``. Does not own: the fields (nodetrain/config/schema.py) or the checks
(nodetrain/config/checks.py).
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from typing import Any

import psutil
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from nodetrain.config.checks import ConfigError, check_unknown_keys
from nodetrain.config.schema import Config

__all__ = ["register_configs", "run_id", "to_typed"]


def _stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d_%H-%M-%S")


def _start_time(pid: int) -> str:
    """Creation time of process ``pid`` as ``YYYY-mm-dd_HH-MM-SS`` (local time)."""
    return _stamp(psutil.Process(pid).create_time())


def _launch_time(agent: int) -> str:
    """When ``agent`` (the torchrun agent) started this launch's ranks: the earliest creation time
    among its children that run this process's command line (every rank of the launch exists
    from then on, so all compute the same). Not the agent's own: a shell that ``exec``s torchrun as
    the last step of a longer command keeps its process, and so its start time (README command 1's
    ``pip install`` before ``torchrun``)."""
    me = psutil.Process()
    command, starts = me.cmdline(), []
    for child in psutil.Process(agent).children():
        try:
            if child.cmdline() == command:
                starts.append(child.create_time())
        except psutil.Error:  # a sibling that exited meanwhile
            continue
    return _stamp(min(starts, default=me.create_time()))


_UNSAFE = re.compile(r"[^-\w.]")


def run_id() -> str:
    """A run id that every rank of one torchrun launch on a node computes identically, race-free.

    Hydra's ``${now:}`` is resolved by each rank at its own instant and can straddle a second; the
    start of the launch (when the shared parent, the torchrun agent, started its ranks) cannot.

    Returns:
        ``$NODETRAIN_RUN_ID`` when set (the multi-node launchers set it once for every node, whose
        torchrun agents start at different instants); else ``<launch>_<TORCHELASTIC_RUN_ID>`` when
        torchrun set a rendezvous id (not ``none``); else ``<launch>_p<ppid>`` under torchrun
        (``LOCAL_RANK`` set), ``<launch>`` the time its ranks started (``_launch_time``; an elastic
        restart's ranks are a launch of their own); else, for a plain ``python`` process,
        ``<own start>_p<pid>``.
    """
    if given := os.environ.get("NODETRAIN_RUN_ID", ""):
        return _UNSAFE.sub("_", given)
    rdzv_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv_id and rdzv_id.lower() != "none":
        return f"{_launch_time(os.getppid())}_{_UNSAFE.sub('_', rdzv_id)}"
    if "LOCAL_RANK" in os.environ:
        return f"{_launch_time(os.getppid())}_p{os.getppid()}"
    return f"{_start_time(os.getpid())}_p{os.getpid()}"


def _rank() -> int:
    """Global rank from the ``RANK`` env var torchrun sets; 0 outside torchrun."""
    return int(os.environ.get("RANK", "0"))


def _rank0_only(value: Any) -> Any:
    """``value`` on global rank 0, ``None`` elsewhere (``hydra.output_subdir: null`` = no snapshot)."""
    return value if _rank() == 0 else None


def _rank0_else(on_rank0: Any, elsewhere: Any) -> Any:
    """``on_rank0`` on global rank 0, ``elsewhere`` on the other ranks (e.g. the console log level)."""
    return on_rank0 if _rank() == 0 else elsewhere


def register_configs() -> None:
    """Store ``Config`` in Hydra's ConfigStore as ``base_config`` and register the resolvers.

    Call once before ``@hydra.main`` or ``compose`` runs; calling again is harmless. Resolvers:
    ``${nt_run_id:}`` (see ``run_id``), ``${nt_rank:}`` (global rank), ``${nt_rank0_only:x}``
    (``x`` on rank 0, null elsewhere) and ``${nt_rank0_else:x,y}`` (``x`` on rank 0, ``y`` elsewhere).
    """
    ConfigStore.instance().store(name="base_config", node=Config)
    OmegaConf.register_new_resolver("nt_run_id", run_id, replace=True)
    OmegaConf.register_new_resolver("nt_rank", _rank, replace=True)
    OmegaConf.register_new_resolver("nt_rank0_only", _rank0_only, replace=True)
    OmegaConf.register_new_resolver("nt_rank0_else", _rank0_else, replace=True)


def to_typed(dict_config: DictConfig) -> Config:
    """Convert the composed config to the typed ``Config`` (once, at the entry point).

    Raises:
        ConfigError: a mandatory value (``???``) was never set (e.g. ``model.name``), or a key that
            is not in the schema was forced in with ``+key=value``.
    """
    try:
        cfg = OmegaConf.to_object(dict_config)
    except MissingMandatoryValue as e:
        key = getattr(e, "full_key", "?")
        raise ConfigError(f"{key}=???: missing value; set it in a YAML or on the command line") from e
    assert isinstance(cfg, Config), f"expected a Config, got {type(cfg).__name__}"
    check_unknown_keys(cfg)
    return cfg
