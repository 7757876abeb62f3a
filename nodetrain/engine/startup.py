"""What a rank builds before its first step, in the order its parts need, ending in its Engine.

Owns: :func:`build_engine` (the order of set-up: threads bound, the peak found, the machine measured
and the run resolved once, the store and optimizer opened, the engine wired), opening the node's host
store (local rank 0 creates it, the others attach, each allocates its own units' pages, then the name
goes: store.py's lifecycle; collective over the world), the stage's AdamW with its units' weights
initialised or imported and their transfer copies refreshed (and page-locked on CUDA), and the peak
FLOP/s of one device (logged with its source). Each takes the sub-configs it reads. Does not own the
step (engine.py) or what is decided (core/run_shape.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nodetrain.config.constants import DTYPES
from nodetrain.config.schema import Config, OptimConfig, StoreConfig
from nodetrain.core.batch import BatchShape
from nodetrain.core.cores import CoreSplit
from nodetrain.core.run_shape import resolve
from nodetrain.core.topology import Topology
from nodetrain.cost.shape import shape_of
from nodetrain.engine.comm.comm import Comm
from nodetrain.engine.comm.replicas import node_group
from nodetrain.engine.engine import Engine
from nodetrain.engine.host.binding import bind_rank_threads
from nodetrain.engine.host.measure import measure_machine
from nodetrain.engine.host.tier_setup import tier_opener, tier_skip
from nodetrain.model import HFModel
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.optim.lean import LeanAdamW, init_lean
from nodetrain.run.breakdown import hardware_profiles, measured_peak_flops, peak_flops_line, select_peak_flops
from nodetrain.run.inject import Faults
from nodetrain.store import HostStore, StoreLayout

__all__ = ["Opened", "build_engine", "make_optimizer", "open_store", "peak_flops"]

log = logging.getLogger(__name__)


def open_store(
    model: HFModel,
    dtype: torch.dtype,
    state: str,
    store_cfg: StoreConfig,
    topo: Topology,
    timeout_s: float,
    run_id: str,
    units,
    skip=(),
) -> HostStore:
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


def make_optimizer(
    store: HostStore,
    model: HFModel,
    units,
    blocks,
    optim: OptimConfig,
    seed: int,
    device: torch.device,
    init_from=None,
    tier=None,
) -> StoreAdamW:
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


@dataclass(frozen=True)
class Opened:
    """What a rank opened before its engine is wired: where it sits, its host side and its peak.

    Attributes:
        topo: its place (stage, replica); device: its compute device.
        cores: its host cores' split (threads bound first: ``host_threads.bind_rank_threads``).
        peak: (one device's peak FLOP/s, where it comes from): MFU's denominator.
        store: the node's host store, mapped, this stage's pages allocated.
        optimizer: its AdamW over the store, weights initialised (or imported).
    """

    topo: Topology
    device: torch.device
    cores: CoreSplit
    peak: tuple[float, str]
    store: HostStore
    optimizer: object


def build_engine(
    cfg: Config,
    model: HFModel,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    run_id: str,
    device: torch.device,
    init_from=None,
    topology: Topology | None = None,
    faults: Faults | None = None,
    batch: BatchShape | None = None,
) -> Engine:
    """This rank's :class:`~nodetrain.engine.engine.Engine`, built in the order its parts need: threads
    bound to the GPU's NUMA node, the peak FLOP/s found (its scratch freed), the machine measured and
    shared (``measure.measure_machine``), the run resolved once (``core.run_shape.resolve``, logged),
    then the host store opened with this stage's pages first touched on the bound node, the optimizer
    built and initialised (the NVMe tier's too), and the engine wired from them. Collective over the
    world.

    Args:
        cfg: the validated run config; model: the HF adapter (templates + units).
        rank, world_size: this rank in the (single-node) pipeline; local_rank: rank on the node (local
            rank 0 creates the host store); run_id: names the store file; device: compute device.
        init_from: optional ``(store, units) -> None`` that fills master weights of the given units
            (checkpoint import); default is random init.
        topology: stage and replica of this rank when several nodes each run a replica of the pipeline
            (core/topology.py); default: one pipeline over the world, stage = rank.
        faults: test-only fault injection (run/inject.py); default: ``Faults.from_env(world_size)``
            (``NODETRAIN_FAULTS``).
        batch: the run's batch, already resolved (train.py resolves it before the data); default: resolved
            here.
    """
    topo = topology or Topology.single(rank, world_size, local_rank)
    faults = faults or Faults.from_env(world_size)
    cores = bind_rank_threads(cfg.stream.accum_threads, cfg.optim.threads, device, topo.local_rank)
    dtype = DTYPES[cfg.train.dtype]
    peak = peak_flops(device, dtype, cfg.train.peak_flops, cfg.hardware)
    shape = shape_of(model)
    machine = measure_machine(cfg, shape, topo, device, cores, Comm(device), peak[0])
    run = resolve(cfg, shape, machine, topo.num_stages, topo.num_replicas, batch)
    for line in run.lines:
        log.info("%s", line)
    units = [model.units[i] for i in run.plans[topo.stage].blocks]
    store = open_store(
        model, dtype, cfg.optim.state, cfg.store, topo, cfg.dist.timeout_s, run_id, units, tier_skip(cfg)
    )
    tier = tier_opener(cfg, store, topo, run_id, faults)  # None: store.tier=ram
    blocks = run.plans[topo.stage].blocks
    optimizer = make_optimizer(store, model, units, blocks, cfg.optim, cfg.seed, device, init_from, tier)
    return Engine(cfg, run, model, Opened(topo, device, cores, peak, store, optimizer), faults)
