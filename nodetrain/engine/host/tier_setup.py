"""Opening the NVMe tier of a rank (``store.tier=nvme``) and wrapping its optimizer in it.

Owns: the tier file's start-up lifecycle over the node (local rank 0 creates and allocates it, the
others open it, the name goes once all have: store.py's protocol; collective over the world) and
the :class:`~nodetrain.optim.tier.TieredOptimizer` wiring (its I/O threads' role, the writer
check, the updating thread). Does not own the tier's I/O (optim/tier_files.py) or pool (optim/tier.py).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from nodetrain.config.schema import Config
from nodetrain.core.topology import Topology
from nodetrain.engine.comm.replicas import node_group
from nodetrain.engine.threads import check_writer, set_role
from nodetrain.optim.tier import TieredOptimizer
from nodetrain.optim.tier_files import TIER_FIELDS, TierFile, TierLayout
from nodetrain.run.inject import Faults

__all__ = ["open_tier", "tier_line", "tier_opener", "tier_skip"]

log = logging.getLogger(__name__)


def tier_skip(cfg: Config) -> tuple[str, ...]:
    """Store fields whose pages the tier keeps out of RAM (none with ``store.tier=ram``)."""
    return TIER_FIELDS[cfg.optim.state] if cfg.store.tier == "nvme" else ()


def tier_opener(cfg: Config, store, topo: Topology, run_id: str, faults: Faults):
    """``make_optimizer``'s ``tier``: ``optimizer -> open_tier(...)``, or None with ``store.tier=ram``."""
    if cfg.store.tier != "nvme":
        return None
    return lambda optimizer: open_tier(cfg, store, optimizer, topo, run_id, faults)


def _tier_thread() -> None:
    set_role("tier")


def tier_line(tier: TierFile, buffers: int, ranks: int) -> str:
    """What lives where with ``store.tier=nvme`` (logged once per node, by its creator): the host store's
    bytes in RAM (the fields the tier does not hold, plus ``buffers`` pool slots on each of ``ranks``
    ranks), the tier's bytes on NVMe, and the tier file's path."""
    layout = tier.layout
    pool = ranks * buffers * tier.slot_bytes
    ram = layout.store.nbytes - layout.nbytes + pool
    fields = ", ".join(layout.fields)
    return (
        f"store.tier=nvme: {ram / 1e9:.4g} GB in RAM (the host store without {fields}, and {ranks} x "
        f"{buffers} pool slots of {tier.slot_bytes / 1e6:.4g} MB), {layout.nbytes / 1e9:.4g} GB on NVMe "
        f"({fields}) in {tier.path}"
    )


def open_tier(cfg: Config, store, optimizer, topo: Topology, run_id: str, faults: Faults) -> TieredOptimizer:
    """``optimizer`` with its tier fields in this node's tier file under ``store.tier_dir``.

    Collective over the world (the path goes from local rank 0 to the node's ranks).

    Raises:
        TierIOError: the file cannot be created at its full size (local rank 0).
    """
    layout = TierLayout(store.layout)
    path = [None]
    if topo.local_rank == 0:
        tier = TierFile.create(layout, store, cfg.store.tier_dir, run_id, faults.tier_pwrite)
        path = [str(tier.path)]
        log.info("%s", tier_line(tier, cfg.store.tier_buffers, topo.num_stages))
    dist.broadcast_object_list(path, src=topo.node_root, group=node_group(topo, cfg.dist.timeout_s))
    if topo.local_rank != 0:
        tier = TierFile.open(layout, store, path[0], faults.tier_pwrite)
    dist.barrier()  # every rank of the node has the file open: the name can go
    tier.unlink()
    owner = "optimizer" if cfg.optim.overlap else "training"
    return TieredOptimizer(optimizer, tier, cfg.store.tier_buffers, owner, _tier_thread, check_writer)
