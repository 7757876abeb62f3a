"""Planner: will a model fit this node, how fast will it train, and what bounds it.

Owns: turning a config and a hardware profile (``conf/hardware/``) into a ``Plan`` (host and
device memory, the largest micro-batch that fits, step time and its bottleneck, tokens/day, nodes
for a token budget, a verdict with its reasons), the ``python -m nodetrain.plan`` entry point, and
the training start-up check that refuses a host store the node cannot hold (``preflight``). The
arithmetic itself is in ``costs.py``; printing is in ``plan_report.py``.

    python -m nodetrain.plan model=llama2_70b hardware=h100_sxm train.seq_len=4096 \\
        train.micro_batch_size=4 pipeline.microbatches=16
"""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import psutil
import torch
from omegaconf import DictConfig

from nodetrain.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    grad_accum_of,
    register_configs,
    to_typed,
    validate,
)
from nodetrain.costs import (
    ModelShape,
    StageMemory,
    StepTime,
    field_bytes,
    pin_overhead_bytes,
    shape_of,
    stage_memory,
    step_time,
    store_layout,
)
from nodetrain.model import HFModel, build_hf_config
from nodetrain.pipeline import partition
from nodetrain.store import remove_stale_stores

__all__ = ["GB", "Plan", "make_plan", "model_of", "host_problems", "preflight", "main"]

GB = 1e9
"""Bytes in the GB of every figure here (decimal, as datasheets and ``psutil`` totals are quoted)."""
_MAX_MICRO_BATCH = 1 << 16


def model_of(cfg: Config) -> HFModel:
    """The adapter of ``cfg.model`` with the vocabulary of ``model.hf.vocab_size``, else
    ``data.vocab_size`` (the size the BPE is trained to)."""
    return HFModel(build_hf_config(cfg.model, vocab_size=cfg.model.hf.get("vocab_size", cfg.data.vocab_size)))


# ----------------------------------------------------------------------------- host memory


def host_problems(
    store_bytes: int,
    world_size: int,
    rank_overhead_bytes: int,
    available_bytes: int,
    free_bytes: int,
    store_dir,
) -> list[str]:
    """Why a host store cannot be created (empty when it can); pure arithmetic on given numbers.

    The node needs ``store_bytes + world_size × rank_overhead_bytes`` of host memory, and the store
    file needs ``store_bytes`` of free space in ``store_dir`` (tmpfs counts its own limit). Pinned
    memory adds nothing: on CUDA the store itself is page-locked in place (``cudaHostRegister``), and
    the per-rank overhead covers the window and kept heap.
    """
    need = store_bytes + world_size * rank_overhead_bytes
    fix = (
        "use a smaller model, a node with more RAM (or free what holds it now), or see "
        "`python -m nodetrain.plan` for what fits"
    )
    problems = []
    if need > available_bytes:
        problems.append(
            f"host memory: the host store needs {store_bytes / GB:.1f} GB + {world_size} rank(s) × "
            f"{rank_overhead_bytes / GB:.2f} GB (plan.rank_overhead_gb) = {need / GB:.1f} GB, but only "
            f"{available_bytes / GB:.1f} GB is available; {fix}"
        )
    if store_bytes > free_bytes:
        problems.append(
            f"store.dir={store_dir}: the host store needs {store_bytes / GB:.1f} GB but the directory has "
            f"{free_bytes / GB:.1f} GB free; enlarge it (e.g. `mount -o remount,size=<GB>G /dev/shm`) or "
            "point store.dir at a larger RAM-backed filesystem"
        )
    return problems


def preflight(cfg: Config, model: HFModel, world_size: int) -> int:
    """Refuse, before anything is allocated, a run whose host store cannot fit this node.

    Removes host stores of dead runs from ``store.dir`` first (as ``HostStore.create`` would), so
    their memory counts as available. Call on one rank per node and share the outcome.

    Returns:
        the host store's size in bytes.

    Raises:
        ConfigError: ``store.dir`` does not exist, or the store (+ per-rank overhead) exceeds the
            available host memory (``psutil.virtual_memory().available``) or the free space of
            ``store.dir`` (``shutil.disk_usage``); the message gives the numbers and the fix.
    """
    store_dir = Path(cfg.store.dir)
    if not store_dir.is_dir():
        raise ConfigError(f"store.dir={store_dir}: not a directory; create it or use /dev/shm")
    remove_stale_stores(store_dir, remove=cfg.store.cleanup_stale)
    shape = shape_of(model)
    nbytes = store_layout(shape, getattr(torch, cfg.train.dtype), cfg.optim.state).nbytes
    overhead = int(cfg.plan.rank_overhead_gb * GB)
    if torch.cuda.is_available():  # each rank page-locks the transfer copies it loads (HostStore.pin)
        compute = field_bytes(store_layout(shape, getattr(torch, cfg.train.dtype), cfg.optim.state))[
            "compute"
        ]
        overhead += pin_overhead_bytes(compute) // world_size
    available, free = psutil.virtual_memory().available, shutil.disk_usage(store_dir).free
    problems = host_problems(nbytes, world_size, overhead, available, free, store_dir)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        n = shape.num_params
        what = f"{n / 1e9:,.2f}B parameters × {nbytes / n:.1f} bytes/param of host store"
        raise ConfigError(f"model {cfg.model.name} ({what}) does not fit this node:\n{lines}")
    return nbytes


# ----------------------------------------------------------------------------- the whole plan


@dataclass(frozen=True)
class _Node:
    """What memory checks need besides the micro-batch size: the model on its stages, the batch
    shape, and the node's limits in bytes."""

    shape: ModelShape
    stage_blocks: list[range]
    seq_len: int
    microbatches: int
    grad_accum: int
    schedule: str
    slots: int
    itemsize: int
    store_bytes: int
    fields: dict[str, int]
    overhead_bytes: int
    """All ranks' overhead beyond the store (``S × plan.rank_overhead_gb``, plus on a GPU profile the
    page-locking of the transfer copies, ``costs.pin_overhead_bytes``)."""
    host_bytes: int
    device_limit_bytes: int
    """Device memory one stage may use; 0 on a CPU profile (the stages then live in host memory)."""

    @property
    def cpu(self) -> bool:
        return self.device_limit_bytes == 0

    def memory(self, b: int) -> tuple[list[StageMemory], int]:
        """Every stage's peak at micro-batch size ``b``, and the node's host need (store + overhead,
        plus the stages themselves on a CPU profile)."""
        stages = [
            stage_memory(
                self.shape,
                blocks,
                s,
                len(self.stage_blocks),
                b=b,
                t=self.seq_len,
                m=self.microbatches,
                g=self.grad_accum,
                schedule=self.schedule,
                slots=self.slots,
                itemsize=self.itemsize,
                on_cpu=self.cpu,
            )
            for s, blocks in enumerate(self.stage_blocks)
        ]
        host = self.store_bytes + self.overhead_bytes + sum(x.staging_bytes for x in stages)
        host += sum(x.total_bytes for x in stages) if self.cpu else 0
        return stages, host

    def fits(self, b: int) -> bool:
        """Whether micro-batches of ``b`` fit the device (on a CPU profile: the host, with the store)."""
        stages, host = self.memory(b)
        if self.cpu:
            return host <= self.host_bytes
        return max(x.total_bytes for x in stages) <= self.device_limit_bytes

    def max_micro_batch(self) -> int:
        """Largest b in [1, 65536] that fits (peak memory grows with b); 0 if none does."""
        if not self.fits(1):
            return 0
        lo, hi = 1, _MAX_MICRO_BATCH
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(mid) else (lo, mid - 1)
        return lo


@dataclass(frozen=True)
class Plan:
    """Everything the planner reports for one config on one hardware profile."""

    cfg: Config
    shape: ModelShape
    num_stages: int
    fields: dict[str, int]
    """Host store bytes per field (``master``, ``grad``, ``exp_avg``, ``exp_avg_sq``, ``compute``,
    ``grad_tied``)."""
    store_bytes: int
    host_need_bytes: int
    """Host store + per-rank overhead + every stage's D2H staging buffers (+ its window and
    activations on a CPU profile)."""
    stages: list[StageMemory]
    device_limit_bytes: int
    """Device memory one stage may use (device memory − plan.device_reserve_gb); 0 on a CPU profile."""
    max_micro_batch: int
    """Largest ``train.micro_batch_size`` whose peak fits the device (on a CPU profile: the host,
    store included); 0: not even 1."""
    time: StepTime
    train_tokens: float
    nodes: int
    """Nodes to train ``train_tokens`` within ``plan.days`` days (0 when ``plan.days`` is 0)."""
    problems: list[str]
    hints: list[str]

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def days_one_node(self) -> float:
        return self.train_tokens / self.time.tokens_per_day

    @property
    def peak_flops(self) -> float:
        """Peak of the devices the plan uses: S GPUs, or the one CPU."""
        hw = self.cfg.hardware
        return hw.peak_flops * (self.num_stages if hw.gpus_per_node else 1)

    @property
    def verdict(self) -> str:
        return "does not fit" if self.problems else f"fits; {self.time.bottleneck}-bound"


def _check_hardware(cfg: Config, num_stages: int) -> None:
    hw, problems = cfg.hardware, []
    for key in ("peak_flops", "host_link_gbps", "host_memory_gb", "host_memory_bandwidth_gbps"):
        if not getattr(hw, key) > 0:
            problems.append(
                f"hardware.{key}={getattr(hw, key)}: must be > 0; take it from the datasheet (units in "
                "nodetrain/config.py HardwareConfig) or pick a profile of conf/hardware/"
            )
    if not 0 < hw.matmul_efficiency <= 1:
        problems.append(f"hardware.matmul_efficiency={hw.matmul_efficiency}: must be in (0, 1]; use 0.6")
    if hw.cores < 1:
        problems.append(f"hardware.cores={hw.cores}: must be >= 1; the node's CPU cores")
    if hw.gpus_per_node < 0 or (hw.gpus_per_node == 0 and hw.device_memory_gb > 0):
        problems.append(
            f"hardware.gpus_per_node={hw.gpus_per_node}: must be >= 1 on a GPU profile (device_memory_gb="
            f"{hw.device_memory_gb}); 0 only with hardware=cpu (or device_memory_gb=0)"
        )
    if hw.gpus_per_node and not hw.device_memory_gb > cfg.plan.device_reserve_gb:
        what = f"must exceed plan.device_reserve_gb={cfg.plan.device_reserve_gb} on a GPU profile"
        problems.append(f"hardware.device_memory_gb={hw.device_memory_gb}: {what}")
    if hw.gpus_per_node and num_stages > hw.gpus_per_node:
        problems.append(
            f"pipeline.stages={num_stages}: more stages than hardware.gpus_per_node={hw.gpus_per_node} "
            "(one stage per GPU); lower it or use 0"
        )
    if problems:
        raise ConfigError(f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def _node(cfg: Config, shape: ModelShape, num_stages: int) -> _Node:
    hw, dtype = cfg.hardware, getattr(torch, cfg.train.dtype)
    layout = store_layout(shape, dtype, cfg.optim.state)
    device_limit = (
        0 if hw.gpus_per_node == 0 else int((hw.device_memory_gb - cfg.plan.device_reserve_gb) * GB)
    )
    return _Node(
        shape=shape,
        stage_blocks=partition(list(shape.costs), num_stages),
        seq_len=cfg.train.seq_len,
        microbatches=cfg.pipeline.microbatches,
        grad_accum=grad_accum_of(cfg),
        schedule=cfg.pipeline.schedule,
        slots=cfg.stream.slots,
        itemsize=dtype.itemsize,
        store_bytes=layout.nbytes,
        fields=field_bytes(layout),
        overhead_bytes=int(num_stages * cfg.plan.rank_overhead_gb * GB)
        + (pin_overhead_bytes(field_bytes(layout)["compute"]) if hw.gpus_per_node else 0),
        host_bytes=int(hw.host_memory_gb * GB),
        device_limit_bytes=device_limit,
    )


def make_plan(cfg: Config, model: HFModel | None = None) -> Plan:
    """Plan ``cfg`` (model, batch shape, pipeline, ``hardware`` profile) without allocating anything.

    Stages: ``pipeline.stages``, else one per GPU of the profile (1 on a CPU profile).

    Raises:
        ConfigError: the config is invalid for that many stages, or the profile is.
    """
    hw, b = cfg.hardware, cfg.train.micro_batch_size
    num_stages = cfg.pipeline.stages or max(1, hw.gpus_per_node)
    validate(cfg, world_size=num_stages)
    _check_hardware(cfg, num_stages)
    shape = shape_of(model if model is not None else model_of(cfg))
    node = _node(cfg, shape, num_stages)
    stages, host_need = node.memory(b)
    share = num_stages if node.cpu else 1  # a CPU's cores and memory bus are shared by its ranks
    time = step_time(
        shape,
        node.stage_blocks,
        b=b,
        t=node.seq_len,
        m=node.microbatches,
        g=node.grad_accum,
        itemsize=node.itemsize,
        flops_per_s=hw.peak_flops * hw.matmul_efficiency / share,
        link_bytes_per_s=hw.host_link_gbps * GB / share,
        host_bytes_per_s=hw.host_memory_bandwidth_gbps * GB,
        overlap_optimizer=cfg.plan.overlap_optimizer,
    )
    train_tokens = cfg.plan.train_tokens or 20 * shape.num_params
    days_one_node = train_tokens / time.tokens_per_day
    max_b = node.max_micro_batch()
    return Plan(
        cfg=cfg,
        shape=shape,
        num_stages=num_stages,
        fields=node.fields,
        store_bytes=node.store_bytes,
        host_need_bytes=host_need,
        stages=stages,
        device_limit_bytes=node.device_limit_bytes,
        max_micro_batch=max_b,
        time=time,
        train_tokens=train_tokens,
        nodes=math.ceil(days_one_node / cfg.plan.days) if cfg.plan.days > 0 else 0,
        problems=_problems(cfg, node, stages, host_need, max_b),
        hints=_hints(cfg, time, max_b, num_stages),
    )


def _problems(cfg: Config, node: _Node, stages: list[StageMemory], host_need: int, max_b: int) -> list[str]:
    """Why the run cannot start on this hardware, each with its numbers and a fix."""
    hw, b, host, problems = cfg.hardware, cfg.train.micro_batch_size, node.host_bytes, []
    if node.store_bytes + node.overhead_bytes > host:
        per_param = node.store_bytes / node.shape.num_params
        largest = (host - node.overhead_bytes) / per_param
        problems.append(
            f"host memory: the host store needs {node.store_bytes / GB:,.0f} GB ({per_param:.1f} bytes/param)"
            f" + {node.overhead_bytes / GB:.1f} GB rank overhead, but {hw.name} has {host / GB:,.0f} GB; the "
            f"largest model that fits is ~{largest / 1e9:,.1f}B parameters"
        )
        if node.cpu:
            return problems
    if max_b >= b:
        return problems
    worst = max(stages, key=lambda x: x.total_bytes)
    limit, need = (host, host_need) if node.cpu else (node.device_limit_bytes, worst.total_bytes)
    fix = (
        f"use train.micro_batch_size={max_b}"
        if max_b
        else "shorten train.seq_len, lower stream.slots or use more stages"
    )
    problems.append(
        f"{'host' if node.cpu else 'device'} memory at train.micro_batch_size={b}: needs {need / GB:,.1f} GB "
        f"(stage {worst.stage}: window {worst.window_bytes / GB:.2f} + activations "
        f"{worst.activation_bytes / GB:.2f} GB) but {limit / GB:,.1f} GB is usable; {fix}"
    )
    return problems


def _hints(cfg: Config, t: StepTime, max_b: int, num_stages: int) -> list[str]:
    """What would make the step faster."""
    tr, hints = cfg.train, []
    if t.bottleneck in ("H2D", "D2H"):
        ratio = max(t.h2d_s, t.d2h_s) / t.compute_s
        tokens = math.ceil(ratio * tr.micro_batch_size * tr.seq_len)
        hints.append(
            f"streaming takes {ratio:.1f}× the compute: ≥ {tokens:,} tokens per micro-batch "
            "(train.micro_batch_size × train.seq_len) would hide it"
        )
    if t.bubble_s > 0.25 * t.step_s:
        hints.append(
            f"the pipeline bubble is {t.bubble_s / t.step_s:.0%} of the step: raise pipeline.microbatches "
            f"(now {cfg.pipeline.microbatches}) to ≥ {4 * (num_stages - 1)}"
        )
    if t.bottleneck == "CPU optimizer":
        hints.append("the CPU AdamW is bound by host memory bandwidth: more tokens per step amortise it")
    if max_b > tr.micro_batch_size:
        hints.append(f"up to train.micro_batch_size={max_b} fits")
    return hints


@hydra.main(config_path=str(CONFIG_DIR), config_name="plan", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    """Hydra entry: print the plan of the composed config (same keys as training, plus ``hardware``)."""
    from nodetrain.plan_report import render  # rich output only where it is printed

    try:
        plan = make_plan(to_typed(dict_cfg))
    except ConfigError as e:  # a user's mistake: the message, not a traceback
        print(f"ConfigError: {e}", file=sys.stderr)
        sys.exit(2)
    render(plan)


if __name__ == "__main__":
    register_configs()
    main()
