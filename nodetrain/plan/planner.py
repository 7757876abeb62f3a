"""Planner: will a model fit this node, how fast will it train, and what bounds it.

Owns: turning a config and a hardware profile (``conf/hardware/``) into a ``Plan`` (host and
device memory, the largest micro-batch that fits, step time and its bottleneck, tokens/day, nodes
for a token budget, a verdict with its reasons) and the ``python -m nodetrain.plan`` entry point.
Every choice comes from ``core.run_shape.resolve`` on the machine the profile describes, the same
call the engine makes on the machine it measured; the arithmetic from ``cost/``. Does not own the
verdict's wording (``verdict.py``), printing (``report.py``) or the training start-up host check
(``host.py``).

    python -m nodetrain.plan model=llama2_70b hardware=h100_sxm train.seq_len=4096 \\
        train.micro_batch_size=4 pipeline.microbatches=16
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nodetrain.config.schema import Config, ConfigError, validate
from nodetrain.core.batch import BatchShape, priced_batch
from nodetrain.core.fit import profile_host_free_bytes
from nodetrain.core.machine import GB, profile_machine
from nodetrain.core.placement import on_device_request
from nodetrain.core.pricing import host_rates
from nodetrain.core.run_shape import RunShape, resolve
from nodetrain.cost.memory import StageMemory
from nodetrain.cost.shape import ModelShape, shape_of
from nodetrain.cost.step_time import HostRates, StepTime
from nodetrain.model import HFModel, build_hf_config
from nodetrain.plan.verdict import hints, problems
from nodetrain.plan.waves import WaveOption, wave_options

__all__ = ["GB", "Plan", "make_plan", "model_of", "compute_bound_batch"]


def model_of(cfg: Config) -> HFModel:
    """The adapter of ``cfg.model`` with the vocabulary of ``model.hf.vocab_size``, else
    ``data.vocab_size`` (the size the BPE is trained to)."""
    return HFModel(build_hf_config(cfg.model, vocab_size=cfg.model.hf.get("vocab_size", cfg.data.vocab_size)))


@dataclass(frozen=True)
class Plan:
    """Everything the planner reports for one config on one hardware profile."""

    cfg: Config
    """The config as given (``auto`` included: the resolved values are in :attr:`run`)."""
    run: RunShape
    """The run resolved on the profile's machine: the batch, each stage's step and placement."""
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
    rates: HostRates | None = None
    """The host side the step time assumes (link, DRAM, cores, the accumulation/optimizer split)."""
    tier_bytes: int = 0
    """Store bytes on NVMe (``store.tier=nvme``); the host store in RAM is ``store_bytes`` − this +
    ``tier_pool_bytes``."""
    tier_pool_bytes: int = 0
    placed: tuple[StageMemory, ...] = ()
    """Per stage its peak with the run's placement (resident units, their optimizer on the device,
    kept activations, device gradient accumulators); :attr:`stages` is the streamed peak the fit and
    the automatic budget start from."""
    compute_bound: tuple[int, int, StepTime] | None = None
    """With the tier or activation offload: the smallest batch found compute-bound,
    (micro-batch size, micro-batches, its step), by :func:`compute_bound_batch`; None: none found."""
    waves: tuple[WaveOption, ...] = ()
    """The batch priced at every ``pipeline.wave`` dividing its micro-batches per round
    (``waves.wave_options``)."""

    @property
    def batch(self) -> BatchShape:
        return self.run.batch

    @property
    def resident(self) -> tuple[frozenset[int], ...]:
        """Per stage, the blocks the plan keeps on the device (``stream.device_budget``)."""
        return self.run.resident

    @property
    def choices(self) -> tuple[str, ...]:
        """What ``auto`` became (``RunShape.lines``), one line each."""
        return self.run.lines

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

    @property
    def searched_compute_bound(self) -> bool:
        """Whether :attr:`compute_bound` was searched (``store.tier=nvme`` or activation offload)."""
        return self.cfg.store.tier == "nvme" or self.cfg.stream.offload_activations


def _check_hardware(cfg: Config, num_stages: int) -> None:
    hw, problems = cfg.hardware, []
    for key in ("peak_flops", "host_link_gbps", "host_memory_gb", "host_memory_bandwidth_gbps"):
        if not getattr(hw, key) > 0:
            problems.append(
                f"hardware.{key}={getattr(hw, key)}: must be > 0; take it from the datasheet (units in "
                "nodetrain/config/schema.py HardwareConfig) or pick a profile of conf/hardware/"
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
    on_device, _ = on_device_request(cfg.optim.on_device, cfg.optim.state, cfg.store.tier)
    if hw.gpus_per_node and on_device and not (hw.hbm_bandwidth_gbps or hw.device_memory_bandwidth_gbps):
        problems.append(
            "hardware.hbm_bandwidth_gbps=0: the AdamW of units kept on the device (optim.on_device="
            f"{str(cfg.optim.on_device).lower()}) would be priced at 0 s; set the GPU's memory bandwidth "
            "in GB/s (datasheet: H100 SXM 3350, H200 4800) or optim.on_device=false"
        )
    if hw.gpus_per_node and num_stages > hw.gpus_per_node:
        problems.append(
            f"pipeline.stages={num_stages}: more stages than hardware.gpus_per_node={hw.gpus_per_node} "
            "(one stage per GPU); lower it or use 0"
        )
    if problems:
        raise ConfigError(f"{len(problems)} config problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def make_plan(cfg: Config, model: HFModel | None = None) -> Plan:
    """Plan ``cfg`` (model, batch shape, pipeline, ``hardware`` profile) without allocating anything.

    Stages: ``pipeline.stages``, else one per GPU of the profile (1 on a CPU profile). ``auto`` keys
    are resolved by ``core.run_shape.resolve`` on the machine the profile describes.

    Raises:
        ConfigError: the config is invalid for that many stages, or the profile is, or an automatic
            batch fits nowhere.
    """
    hw = cfg.hardware
    num_stages = cfg.pipeline.stages or max(1, hw.gpus_per_node)
    validate(cfg, world_size=num_stages)
    _check_hardware(cfg, num_stages)
    shape = shape_of(model if model is not None else model_of(cfg))
    machine = profile_machine(cfg, profile_host_free_bytes(cfg, shape), num_stages)
    run = resolve(cfg, shape, machine, num_stages)
    batch = run.batch
    fit, *_, time = priced_batch(cfg, shape, machine, batch, num_stages)
    stages, host_need = fit.memory(batch.micro_batch_size)
    train_tokens = cfg.plan.train_tokens or 20 * shape.num_params
    days_one_node = train_tokens / time.tokens_per_day
    max_b = fit.max_micro_batch()
    return Plan(
        cfg=cfg,
        run=run,
        shape=shape,
        num_stages=num_stages,
        fields=fit.fields,
        store_bytes=fit.store_bytes,
        host_need_bytes=host_need,
        stages=stages,
        placed=tuple(fit.memory_of(w, batch.micro_batch_size) for w in run.works),
        device_limit_bytes=fit.device_limit_bytes,
        max_micro_batch=max_b,
        time=time,
        train_tokens=train_tokens,
        nodes=math.ceil(days_one_node / cfg.plan.days) if cfg.plan.days > 0 else 0,
        problems=problems(cfg, fit, batch, stages, host_need, max_b),
        hints=hints(batch, time, max_b, num_stages),
        rates=host_rates(machine, num_stages),
        tier_bytes=fit.tier_bytes,
        tier_pool_bytes=fit.tier_pool_bytes,
        compute_bound=compute_bound_batch(cfg, shape, num_stages, max_b)
        if cfg.store.tier == "nvme" or cfg.stream.offload_activations
        else None,
        waves=wave_options(cfg, shape, machine, batch, num_stages),
    )


_BOUND_MAX_ROUNDS = 64
""":func:`compute_bound_batch` tries up to this many × the stages micro-batches."""


def compute_bound_batch(cfg: Config, shape: ModelShape, num_stages: int, max_b: int):
    """The smallest batch at which ``cfg``'s step is compute-bound: (micro-batch size, micro-batches,
    its ``StepTime``), or None when no micro-batch size that fits (≤ ``max_b``) is, with up to
    :data:`_BOUND_MAX_ROUNDS` × S micro-batches (one round).

    A micro-batch's own streaming (H2D, D2H, accumulation) shrinks against its compute only with
    more tokens per micro-batch; the per-step optimizer and tier I/O and the bubble with more
    micro-batches. So: the smallest power-of-two size compute-bound at the most micro-batches, then
    the fewest micro-batches (S, 2S, 4S …) that stay compute-bound at that size."""
    counts = [num_stages << k for k in range(_BOUND_MAX_ROUNDS.bit_length())]
    sizes = [1 << k for k in range(max(0, max_b).bit_length())]
    machine = profile_machine(cfg, profile_host_free_bytes(cfg, shape), num_stages)

    def step(b: int, m: int) -> StepTime:
        batch = BatchShape(b, cfg.train.seq_len, m, 1)
        return priced_batch(cfg, shape, machine, batch, num_stages)[-1]

    size = next((b for b in sizes if step(b, counts[-1]).bottleneck == "compute"), 0)
    if not size:
        return None
    return next((size, m, t) for m in counts if (t := step(size, m)).bottleneck == "compute")
