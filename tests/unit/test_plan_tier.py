"""The planner's NVMe tier (``store.tier=nvme``) and activation offload (``stream.offload_activations``)
against closed forms written here from the docstrings: the tier's bytes and its buffer pool, the
optimizer thread at max(CPU AdamW, tier I/O), the saved inputs of two micro-batches on the device
and each saved input crossing the link once each way per micro-batch, the host RAM the plan then
needs, the refusals, and the smallest compute-bound batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cost_cases import memory as stage_memory
from cost_cases import step as step_time
from cost_cases import traffic
from test_step_time import SHAPE, _rates

from nodetrain.config.schema import Config, HardwareConfig, ModelConfig
from nodetrain.cost.memory import store_layout
from nodetrain.cost.tier import tier_bytes
from nodetrain.plan.planner import make_plan

PAGE = 4096


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def test_tier_bytes_full_and_lean() -> None:
    """``full``: master, exp_avg, exp_avg_sq, 4 bytes each per element, page-aligned per unit; lean:
    the 4-bit exp_avg (n/2 bytes) with one fp32 absmax per 128, the 8-bit exp_avg_sq (n bytes) with
    one per 2048. The pool: ``buffers`` × the largest unit's tier fields."""
    numels = SHAPE.unit_numels
    full, pool = tier_bytes(store_layout(SHAPE, torch.bfloat16, "full"), 3)
    assert full == sum(3 * _align(4 * n) for n in numels)
    assert pool == 3 * max(3 * _align(4 * n) for n in numels)

    def lean_unit(n: int) -> int:
        return _align(-(-n // 2)) + _align(4 * -(-n // 128)) + _align(n) + _align(4 * -(-n // 2048))

    lean, pool = tier_bytes(store_layout(SHAPE, torch.bfloat16, "lean"), 2)
    assert lean == sum(lean_unit(n) for n in numels)
    assert pool == 2 * max(lean_unit(n) for n in numels)


def _kw(**kw):
    base = dict(b=2, t=16, m=2, g=1, itemsize=2, flops_per_s=1e12, update_mode="serial")
    return {**base, **kw}


def test_optimizer_is_the_slower_of_adamw_and_the_tier_io() -> None:
    """Two stages on one node's drives (each rank gets half of the read and write rates): the
    optimizer seconds of a stage owning P parameters are max(P·(40 + e) / AdamW rate, P·w / (R/2) +
    P·w / (W/2)) for w tier bytes/param; the tier's read + write bytes (2·P·w) go through DRAM."""
    w, read, write, adamw = 12.0, 1e9, 0.5e9, 1e9
    blocks = [range(0, 2), range(2, 4)]
    owned = [sum(SHAPE.unit_numels[i] for i in b) for b in blocks]
    rates = _rates(ranks=2, core_bytes_per_s=adamw, nvme_read_bytes_per_s=read, nvme_write_bytes_per_s=write)
    x = step_time(SHAPE, blocks, **_kw(rates=rates), tier_bytes_per_param=w)
    io = [p * w / (read / 2) + p * w / (write / 2) for p in owned]
    cpu = [p * 42 / adamw for p in owned]
    assert max(io) > max(cpu)  # the tier bounds here
    assert x.optimizer_s == pytest.approx(max(max(i, c) for i, c in zip(io, cpu, strict=True)), rel=1e-12)
    assert x.bottleneck == "NVMe tier"
    ram = step_time(SHAPE, blocks, **_kw(rates=rates))
    assert ram.optimizer_s == pytest.approx(max(cpu), rel=1e-12)
    assert x.host_bytes - ram.host_bytes == int(2 * w * owned[0]) + int(2 * w * owned[1])
    fast = dataclasses.replace(rates, nvme_read_bytes_per_s=1e15, nvme_write_bytes_per_s=1e15)
    hidden = step_time(SHAPE, blocks, **_kw(rates=fast), tier_bytes_per_param=w)
    assert hidden.optimizer_s == pytest.approx(max(cpu), rel=1e-12) and hidden.bottleneck != "NVMe tier"


def test_activation_offload_keeps_two_micro_batches_and_crosses_the_link() -> None:
    """Stage 0 of 2 in 1F1B with 6 micro-batches keeps min(S − s, M) = 2 in flight: offloaded it
    keeps min(that, 2); stage 0 of 4 keeps 4, offloaded 2. Every micro-batch's saved inputs (n·8 for the
    embedding's ids, n·D·e per layer) go D2H and come back H2D once."""
    n, e = 32, 2
    per_mb = n * 8 + n * SHAPE.hidden * e  # stage 0 of 2 owns embed and L0
    kw = dict(b=2, t=16, m=6, g=1, schedule="1f1b", slots=2, itemsize=e)
    for stages, kept in ((2, 2), (4, 4)):
        plain = stage_memory(SHAPE, range(0, 2), 0, stages, **kw)
        off = stage_memory(SHAPE, range(0, 2), 0, stages, **kw, offload_activations=True)
        assert plain.saved_bytes == kept * per_mb and off.saved_bytes == 2 * per_mb
        assert off.window_bytes == plain.window_bytes and off.transient_bytes == plain.transient_bytes
    plain = traffic(SHAPE, range(0, 2), 0, 2, m=6, g=1, n=n, itemsize=e)
    off = traffic(SHAPE, range(0, 2), 0, 2, m=6, g=1, n=n, itemsize=e, offload_activations=True)
    assert off.h2d_bytes - plain.h2d_bytes == 6 * per_mb
    assert off.d2h_bytes - plain.d2h_bytes == 6 * per_mb


def _gpu(**kw) -> HardwareConfig:
    base = dict(
        name="gpu",
        peak_flops=1e15,
        device_memory_gb=80,
        hbm_bandwidth_gbps=3350,  # prices the AdamW of units kept on the device (store.tier=ram only)
        host_link_gbps=50,
        host_memory_gb=2048,
        host_memory_bandwidth_gbps=500,
        cores=64,
        gpus_per_node=2,
        nvme_read_gbps=40,
        nvme_write_gbps=20,
        nvme_capacity_gb=10_000,
    )
    return HardwareConfig(**{**base, **kw})


def _cfg(**hw) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(
        name="t",
        arch="LlamaForCausalLM",
        hf=dict(
            vocab_size=32000,
            hidden_size=2048,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            intermediate_size=5632,
            max_position_embeddings=4096,
        ),
    )
    cfg.hardware = _gpu(**hw)
    cfg.train.seq_len, cfg.train.micro_batch_size, cfg.pipeline.microbatches = 2048, 1, 4
    cfg.store.tier, cfg.store.tier_dir, cfg.stream.offload_activations = "nvme", "/tier", True
    return cfg


def test_plan_with_the_tier_needs_less_ram_and_refuses_missing_or_small_drives() -> None:
    """The RAM store is the store less the tier's fields plus the pool, and the offloaded saved inputs
    of every micro-batch in flight wait in host RAM; a profile without NVMe rates or with drives
    smaller than the tier is refused, naming the field."""
    cfg = _cfg()
    plan = make_plan(cfg)
    ram_cfg = _cfg()
    ram_cfg.store.tier, ram_cfg.stream.offload_activations = "ram", False
    ram = make_plan(ram_cfg)
    tier, pool = tier_bytes(store_layout(plan.shape, torch.bfloat16, "full"), cfg.store.tier_buffers)
    assert (plan.tier_bytes, plan.tier_pool_bytes) == (tier, pool)
    offloaded = sum(s.in_flight * 2048 * 2048 * 2 * len(s.blocks) for s in plan.stages)  # n·D·e a block
    offloaded -= sum(s.in_flight * 2048 * (2048 * 2 - 8) for s in plan.stages if 0 in s.blocks)  # ids
    assert plan.host_need_bytes == ram.host_need_bytes - tier + pool + offloaded
    assert plan.fits and plan.compute_bound is not None
    none = make_plan(_cfg(nvme_read_gbps=0))
    assert any("hardware.nvme_read_gbps=0" in p for p in none.problems)
    small = make_plan(_cfg(nvme_capacity_gb=1))
    assert any("hardware.nvme_capacity_gb=1" in p and f"{tier / 1e9:,.0f} GB" in p for p in small.problems)


def test_compute_bound_batch_is_the_smallest_found() -> None:
    """The batch named compute-bound is: its step's bottleneck is compute; half its micro-batch
    size is not at the most micro-batches tried, and half its micro-batches (when ≥ S) is not."""
    from nodetrain.plan.planner import _BOUND_MAX_ROUNDS, compute_bound_batch

    cfg = _cfg()
    plan = make_plan(cfg)
    b, m, t = plan.compute_bound
    assert t.bottleneck == "compute" and t.tokens == b * cfg.train.seq_len * m
    s = plan.num_stages
    if b > 1:
        smaller = compute_bound_batch(cfg, plan.shape, s, b // 2)
        assert smaller is None
    if m > s:
        cfg2 = _cfg()
        cfg2.train.micro_batch_size, cfg2.pipeline.microbatches = b, m // 2
        assert make_plan(cfg2).time.bottleneck != "compute"
    assert m <= _BOUND_MAX_ROUNDS * s
