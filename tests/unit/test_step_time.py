"""The step-time model's compute and shared-core terms (``nodetrain/cost/step_time.py``) against
closed forms written here from the docstrings' formulas, on a hand-built ``ModelShape``, and the
planner's choice of rates per dtype and profile (``pricing.priced_step``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from cost_cases import step as step_time

from nodetrain.config.schema import Config, HardwareConfig, ModelConfig
from nodetrain.cost.compute import block_elementwise_bytes
from nodetrain.cost.rates import helped_share
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.step_time import HostRates
from nodetrain.plan.planner import make_plan

# Untied Llama: V=300, D=64, H=4, K=2, Q=16, F=128; units embed, L0, L1, head (final norm + lm_head).
D, F, V, H, K, Q = 64, 128, 300, 4, 2, 16
LAYER = 2 * D * H * Q + 2 * D * K * Q + 3 * D * F + 2 * D  # q, o, k, v, gate/up/down, 2 norms
COST, HEAD = LAYER, D + V * D  # HFModel.block_cost: every parameter of the block
SHAPE = ModelShape(
    unit_numels=(V * D, LAYER, LAYER, D + V * D),
    load_numels=(V * D, LAYER, LAYER, D + V * D),
    largest_tensors=(V * D, D * F, D * F, V * D),
    costs=(0, COST, COST, HEAD),
    tied=False,
    hidden=D,
    intermediate=F,
    vocab=V,
    heads=H,
    kv_heads=K,
    head_dim=Q,
    qk_norm=False,
)
# Per token, a layer's forward makes (costs.layer_saved_per_token, e = 2): the input norm's fp32
# upcast 4·D, normalized copy and output 2·D·e; q, k, v (H + 2K)·Q·e; SDPA's output and o_proj's copy
# 2·H·Q·e, its log-sum-exp 4·H; the post-attention norm 4·D + 2·D·e; the MLP 4·F·e; output and
# incoming gradient 2·D·e: 512 + 256 + 256 + 16 + 512 + 1024 + 256 = 2832 bytes.
A_BF16 = 2832


def _rates(**kw) -> HostRates:
    base = dict(
        link_bytes_per_s=1e12,
        host_bytes_per_s=1e15,
        core_bytes_per_s=1e12,
        ranks=1,
        accum_threads=1,
        optim_threads=1,
    )
    return HostRates(**{**base, **kw})


def test_elementwise_bytes_of_a_layer_the_head_and_the_embedding() -> None:
    """A layer: each tensor its forward makes written and read once per forward (2·A·n), its
    backward the recompute's 2·A·n and 4·A·n for the gradients; the head per logit 16 (log_softmax)
    + 4 (nll_loss's zero-filled gradient) + 16 (its backward), and with e < 4 the upcast and its
    backward 4 + e each; per head parameter the fp32 gradient sum zeroed (4), added to (12, and
    widening a bf16 gradient first 2 + 4) and narrowed (4 + 2; none in fp32); the embedding none."""
    n = 32
    assert block_elementwise_bytes(SHAPE, 1, n, 2) == (2 * A_BF16 * n, 6 * A_BF16 * n)
    assert block_elementwise_bytes(SHAPE, 3, n, 2) == (n * V * (36 + 12) + HEAD * (4 + 6 + 12 + 6), 0)
    assert block_elementwise_bytes(SHAPE, 3, n, 4) == (n * V * 36 + HEAD * (4 + 12), 0)
    assert block_elementwise_bytes(SHAPE, 0, n, 2) == (0, 0)


def test_compute_is_matmuls_attention_elementwise_and_layer_overhead() -> None:
    """One stage, G·M = 2·3 micro-batches of n = B·T = 2·16 tokens: per micro-batch each layer costs
    8·cost·n matmul FLOPs, 16·n·T·H·Q attention FLOPs (forward, recompute, 2 × backward), 8·A·n
    elementwise bytes and one fixed overhead; the head 6·P·n FLOPs and n·V·48 + P·28 bytes
    (P = D + V·D)."""
    b, t, m, g, n = 2, 16, 3, 2, 32
    mm, attn, bw, overhead = 1e9, 2e8, 5e8, 1e-3
    kw = dict(b=b, t=t, m=m, g=g, itemsize=2, flops_per_s=mm, rates=_rates())
    x = step_time(
        SHAPE,
        [range(4)],
        **kw,
        attention_flops_per_s=attn,
        elementwise_bytes_per_s=bw,
        layer_overhead_s=overhead,
    )
    layers_mm, layers_attn = 2 * 8 * COST * n / mm, 2 * 16 * n * t * H * Q / attn
    layers_ew, head_mm = 2 * 8 * A_BF16 * n / bw, 6 * HEAD * n / mm
    head_ew = (n * V * 48 + HEAD * 28) / bw
    per_mb = layers_mm + layers_attn + layers_ew + 2 * overhead + head_mm + head_ew
    assert x.compute_s == pytest.approx(g * m * per_mb, rel=1e-12)
    assert x.attention_s == pytest.approx(g * m * layers_attn, rel=1e-12)
    assert x.elementwise_s == pytest.approx(g * m * (layers_ew + head_ew), rel=1e-12)
    assert x.overhead_s == pytest.approx(g * m * 2 * overhead, rel=1e-12)
    # without the new rates: attention at the matmul rate, no elementwise or overhead (the old model)
    old = step_time(SHAPE, [range(4)], **kw)
    assert old.compute_s == pytest.approx(
        g * m * (2 * 8 * COST * n + 2 * 16 * n * t * H * Q + 6 * HEAD * n) / mm
    )
    assert old.elementwise_s == old.overhead_s == 0.0


def test_shared_cores_bound_the_step_by_every_stage_cpu_seconds() -> None:
    """Two stages on one shared core: each stage's CPU seconds are its compute plus every byte its
    copies (read and write), accumulation and optimizer move at one core's bandwidth; the step is at
    least their sum over the one core (work-conserving), and is named so."""
    kw = dict(b=2, t=16, m=2, g=1, itemsize=2, flops_per_s=1e9, rates=_rates(core_bytes_per_s=2e9, ranks=2))
    blocks = [range(0, 2), range(2, 4)]
    alone = step_time(SHAPE, blocks, **kw)
    shared = step_time(SHAPE, blocks, **kw, shared_cores=1)
    assert alone.core_s == () and alone.shared_cores_s == 0.0
    want = [
        c + (2 * x.h2d_bytes + 2 * x.d2h_bytes + x.accum_bytes + x.optimizer_bytes) / 2e9
        for c, x in zip(shared.stage_compute_s, shared.traffic, strict=True)
    ]
    assert shared.core_s == pytest.approx(want, rel=1e-12)
    assert shared.shared_cores_s == pytest.approx(sum(want), rel=1e-12)
    assert shared.step_s == pytest.approx(sum(want), rel=1e-12) and shared.step_s > alone.step_s
    assert shared.bottleneck == "shared cores"


def test_a_stage_sharing_its_core_with_its_copies_takes_their_cpu_seconds() -> None:
    """One stage on one core with slow host bytes: its micro-batches take its in-step CPU seconds
    (compute + 2·H2D + 2·D2H + accumulation bytes at the core's bandwidth), more than any of those
    alone, where with a device of its own the copies overlap its compute; the serial optimizer
    follows at the same core's rate."""
    core = 4e7
    kw = dict(b=2, t=16, m=4, g=1, itemsize=2, flops_per_s=1e10, rates=_rates(core_bytes_per_s=core))
    x = step_time(SHAPE, [range(4)], **kw, shared_cores=1, update_mode="serial")
    (t,) = x.traffic
    in_step = x.compute_s + (2 * t.h2d_bytes + 2 * t.d2h_bytes + t.accum_bytes) / core
    assert in_step > max(x.compute_s, x.h2d_s, x.d2h_s, x.accum_s)
    assert x.optimizer_exposed_s == pytest.approx(t.optimizer_bytes / core, rel=1e-12)
    assert x.step_s == pytest.approx(in_step + t.optimizer_bytes / core, rel=1e-12)
    assert x.core_s == pytest.approx([in_step + t.optimizer_bytes / core], rel=1e-12)


def test_unequal_stages_take_the_slowest_stage_plus_the_others_fill_and_drain() -> None:
    """1F1B on two stages whose second is slower (L1 + the head): stage 0's first forward fills the
    pipeline, stage 1 runs its M micro-batches back to back, stage 0's last backward drains it:
    f0 + M·(f1 + b1) + b0, not (M + S − 1) slots of the slower stage."""
    b, t, m, n, mm = 2, 16, 4, 32, 1e9
    kw = dict(b=b, t=t, m=m, g=1, itemsize=2, flops_per_s=mm, rates=_rates())
    x = step_time(SHAPE, [range(0, 2), range(2, 4)], **kw)
    f0 = (2 * COST * n + 4 * n * t * H * Q) / mm  # L0 (the embedding: no FLOPs)
    b0, f1, b1 = 3 * f0, f0 + 6 * HEAD * n / mm, 3 * f0  # the head's gradients come with its forward
    assert f1 + b1 > f0 + b0
    # the edges (cost/blocks.py): stage 0's one-block window loads L0 once a step, spread over its 2·M
    # passes, and the embedding (rows, no compute) cannot hide it; its last backward leaves L0's and
    # the rows' offloads to the D2H worker (rate 1e12 B/s: link and accumulation): the flush
    p, rows = COST, n * D * 2 + 8 * n
    stall0 = 2 * p / 1e12 / (2 * m)
    flush0 = ((m * 2 * p + 4 * p + (m - 1) * 8 * p) + (4 * V * D + m * (rows + 8 * n * D))) / m / 1e12
    expected = f0 + stall0 + m * (f1 + b1) + b0 + flush0
    assert x.step_s - x.optimizer_exposed_s == pytest.approx(expected, rel=1e-12)
    flush1 = (m * 2 * p + 4 * p + (m - 1) * 8 * p) / m / 1e12  # stage 1's: L1's last offload
    assert x.bubble_s == pytest.approx(f0 + b0 + stall0 + flush0 - flush1, rel=1e-12)
    assert x.step_s - x.optimizer_exposed_s < (m + 2 - 1) * (f1 + b1)


def _cpu_config(dtype: str) -> Config:
    cfg = Config()
    hf = dict(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=K,
        intermediate_size=F,
        tie_word_embeddings=False,
    )
    cfg.model = ModelConfig(name="hand", arch="LlamaForCausalLM", hf=hf)
    cfg.data.vocab_size = V
    cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.dtype = 16, 2, dtype
    cfg.pipeline.stages, cfg.pipeline.microbatches = 1, 2
    cfg.hardware = HardwareConfig(
        name="cpu_test",
        peak_flops=4e11,
        fp32_flops=1e11,
        matmul_efficiency=0.5,
        attention_flops=2e10,
        fp32_attention_flops=3e10,
        device_memory_bandwidth_gbps=5.0,
        layer_overhead_s=2e-3,
        device_memory_gb=0.0,
        host_link_gbps=10.0,
        host_memory_gb=100.0,
        host_memory_bandwidth_gbps=200.0,
        core_memory_bandwidth_gbps=20.0,
        cores=4,
        gpus_per_node=0,
    )
    return cfg


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_planner_prices_each_dtype_at_its_own_rates(dtype: str) -> None:
    """A CPU profile's rank computes on one of its 4 cores: matmuls at the dtype's peak (fp32_flops in
    fp32) × efficiency / 4, attention at the dtype's attention_flops / 4, elementwise bytes at one
    core's device_memory_bandwidth_gbps, 2 ms per layer and micro-batch."""
    t = make_plan(_cpu_config(dtype)).time
    fp32 = dtype == "float32"
    e, n, mbs = (4 if fp32 else 2), 32, 2
    mm = (1e11 if fp32 else 4e11) * 0.5 / 4
    attn = (3e10 if fp32 else 2e10) / 4
    a = block_elementwise_bytes(SHAPE, 1, n, e)
    head = block_elementwise_bytes(SHAPE, 3, n, e)[0]
    per_mb = (
        (2 * 8 * COST * n + 6 * HEAD * n) / mm
        + 2 * 16 * n * 16 * H * Q / attn
        + (2 * sum(a) + head) / 5e9
        + 2 * 2e-3
    )
    assert t.compute_s == pytest.approx(mbs * per_mb, rel=1e-12)
    assert t.attention_s == pytest.approx(mbs * 2 * 16 * n * 16 * H * Q / attn, rel=1e-12)
    assert len(t.core_s) == 1 and t.shared_cores_s > 0  # the stages share the node's cores


def test_gpu_profile_prices_fp32_at_fp32_flops_and_nothing_on_shared_cores() -> None:
    cfg = _cpu_config("float32")
    cfg.hardware.gpus_per_node, cfg.hardware.device_memory_gb = 1, 10.0
    cfg.hardware.layer_overhead_s = 0.0
    cfg.stream.recompute = True  # every layer recomputed (auto would keep them on this device)
    t = make_plan(cfg).time
    n = 32
    a, head = block_elementwise_bytes(SHAPE, 1, n, 4), block_elementwise_bytes(SHAPE, 3, n, 4)[0]
    per_mb = (
        (2 * 8 * COST * n + 6 * HEAD * n) / 5e10 + 2 * 16 * n * 16 * H * Q / 3e10 + (2 * sum(a) + head) / 5e9
    )
    assert t.compute_s == pytest.approx(2 * per_mb, rel=1e-12)
    assert t.core_s == () and t.shared_cores_s == 0.0


def test_the_idle_optimizer_threads_help_prices_the_accumulation_by_update_mode() -> None:
    """``HostRates.accum_help`` (``stream.accum_help``): the helped share of the accumulation runs at
    the worker's rate per thread times both teams' threads (not the optimizer's AdamW rate), capped
    by the rank's DRAM share and never below the worker's alone; the share is none in ``serial``, all
    in ``deferred`` and (items − 1)/items in the backward modes. Closed forms: accumulation seconds =
    bytes × ((1 − h)/alone + h/helped)."""
    rates = _rates(core_bytes_per_s=1e9, host_bytes_per_s=2.5e9, accum_threads=2, optim_threads=1)
    assert rates.accum_rate() == 2e9 and rates.helped_accum_rate() == 2.5e9  # 2 + 1 GB/s, capped
    assert replace(rates, host_bytes_per_s=8e9).helped_accum_rate() == 3e9
    measured = replace(rates, host_bytes_per_s=8e9, accum_bytes_per_s=1.5e9, optim_bytes_per_s=0.5e9)
    assert measured.helped_accum_rate() == pytest.approx(2.25e9, rel=1e-15)  # 1.5 GB/s × (2 + 1) / 2 threads
    assert replace(rates, host_bytes_per_s=1e9).helped_accum_rate() == 1e9  # the share: no gain
    assert [helped_share(m, 4) for m in ("serial", "deferred", "in_backward", "speculative")] == [
        0,
        1,
        0.75,
        0.75,
    ]
    assert helped_share("in_backward", 1) == 0.0  # one item (W = M): every unit final in it
    kw = dict(b=2, t=16, m=4, g=1, itemsize=2, flops_per_s=1e9)
    for mode, h in (("serial", 0.0), ("deferred", 1.0), ("in_backward", 0.75), ("speculative", 0.75)):
        alone = step_time(SHAPE, [range(4)], **kw, rates=rates, update_mode=mode)
        helped = step_time(SHAPE, [range(4)], **kw, rates=replace(rates, accum_help=True), update_mode=mode)
        accum_bytes = alone.traffic[0].accum_bytes
        assert alone.accum_s == pytest.approx(accum_bytes / 2e9, rel=1e-12)
        assert helped.accum_s == pytest.approx(accum_bytes * ((1 - h) / 2e9 + h / 2.5e9), rel=1e-12), mode
