"""What a rank builds before its first step: the host store, the optimizer over it, MFU's peak.

Owns: opening the node's host store (local rank 0 creates it, the others attach, each allocates its
own units' pages, then the name goes: store.py's lifecycle; collective over the world), the stage's
AdamW with its units' weights initialised or imported and their transfer copies refreshed (and
page-locked on CUDA), and the peak FLOP/s of one device (logged with its source). Each takes the
sub-configs it reads. Does not own the order of set-up (engine.py: threads are bound first, so the
first touch of a stage's pages lands on its GPU's NUMA node) or the step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from nodetrain.config.schema import OptimConfig, StoreConfig
from nodetrain.engine.replicas import Topology, node_group
from nodetrain.model import HFModel
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.optim.lean import LeanAdamW, init_lean
from nodetrain.run.breakdown import hardware_profiles, measured_peak_flops, peak_flops_line, select_peak_flops
from nodetrain.store import HostStore, StoreLayout

__all__ = ["make_optimizer", "open_store", "peak_flops"]

log = logging.getLogger(__name__)


def open_store(model: HFModel, dtype: torch.dtype, state: str, store_cfg: StoreConfig, topo: Topology,
               timeout_s: float, run_id: str, units, skip=()) -> HostStore:  # fmt: skip
    """The node's host store, mapped in this rank, with the pages of ``units`` allocated here.

    Local rank 0 creates it without allocating it, the others map it, and each rank allocates its own
    units' pages (first touch on the NUMA node its threads are bound to); then the name goes.
    Collective over the world.

    Args:
        model: the HF adapter (every unit's size, ties); dtype: the compute dtype (transfer copies).
        state: ``optim.state``; store_cfg: ``store`` (directory, stale-store clean-up).
        topo: this rank's topology; timeout_s: ``dist.timeout_s``; run_id: names the file.
        units: this rank's units; skip: fields whose pages stay unallocated (the tier's).

    Raises:
        OSError: the store's filesystem cannot hold it.
    """
    layout = StoreLayout(
        tuple(u.numel for u in model.units), dtype, tied_units=(0,) if model.tied else (), state=state
    )
    path = [None]
    if topo.local_rank == 0:
        store = HostStore.create(layout, Path(store_cfg.dir), run_id, store_cfg.cleanup_stale, populate=False)
        path = [str(store.path)]
    node = node_group(topo, timeout_s)
    dist.broadcast_object_list(path, src=topo.node_root, group=node)  # one per node
    if topo.local_rank != 0:
        store = HostStore.attach(layout, path[0])
    store.populate([u.index for u in units], skip)
    dist.barrier()  # every rank has mapped it and allocated its units: the name can go
    store.unlink()
    return store


def make_optimizer(store: HostStore, model: HFModel, units, blocks, optim: OptimConfig, seed: int,
                   device: torch.device, init_from=None, tier=None) -> StoreAdamW:  # fmt: skip
    """The stage's AdamW over the store (``optim.state``), its units' master weights initialised
    (``init_from(store, units)``: a checkpoint import; default random) and transfer copies refreshed,
    and on CUDA the transfer copies its ``blocks`` load page-locked. Collective (a barrier: the tied
    embedding's transfer copy is read by the last stage).

    Args:
        tier: ``tier(optimizer) -> TieredOptimizer`` (``store.tier=nvme``, tier_setup.py): then each
            unit is initialised alone and written to the tier file (RAM holds one unit's state).
    """
    if optim.state == "lean":
        optimizer = LeanAdamW(store, units, optim, seed)
        init = lambda us: init_lean(optimizer, model, us, init_from, seed)  # noqa: E731
    else:
        optimizer = StoreAdamW(store, units, optim)

        def init(us):
            if init_from is not None:
                init_from(store, us)
            else:
                for u in us:
                    model.init_unit(u, store.master(u.index), seed)
            for u in us:
                store.compute(u.index).copy_(store.master(u.index))

    if tier is None:
        init(units)
    else:
        optimizer = tier(optimizer)
        for u in units:
            optimizer.fill(u.index, lambda u=u: init([u]))
    dist.barrier()  # the tied embedding's transfer copy is read by the last stage
    if device.type == "cuda":  # only the transfer copies this rank's H2D copies read
        store.pin({b.unit for i in blocks for b in model.bindings[i]})
    return optimizer


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float, hardware) -> tuple[float, str]:
    """MFU's denominator (``breakdown.select_peak_flops``: ``train.peak_flops``, else the ``hardware``
    profile naming this GPU, else a measured matmul), logged with its source. A measured matmul's
    device memory goes back to the driver before the residency budget is read."""
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else None
    peak, source = select_peak_flops(configured, name, hardware, hardware_profiles())
    if peak is None:
        peak = measured_peak_flops(str(device), dtype, torch.get_num_threads())
        if cuda:
            torch.cuda.empty_cache()
    log.info(peak_flops_line(peak, source))
    return peak, source
