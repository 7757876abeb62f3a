"""The planner: its arithmetic against hand-computed values for two configurations, every hardware
profile, the ``python -m nodetrain.plan`` CLI, and the training start-up refusal of a host store
the node cannot hold (before anything is allocated).

The hand computations below are written from the model's shapes and the documented formulas
(``nodetrain/cost/memory.py`` and ``step_time.py`` docstrings), not by calling the planner's helpers.
"""

from __future__ import annotations

import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SONNET
from hydra import compose, initialize_config_dir
from rich.console import Console

from nodetrain.config.registry import register_configs, to_typed
from nodetrain.config.schema import (
    Config,
    ConfigError,
    HardwareConfig,
    ModelConfig,
)
from nodetrain.cost.memory import kept_activation_bytes
from nodetrain.plan.host import host_problems
from nodetrain.plan.planner import make_plan
from nodetrain.plan.report import render

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
PAGE = 4096


def _align(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _layer_peak(n: int, d: int, f: int, saved: int, norm_in: int, sdpa: int, grads: int, e: int) -> int:
    """Peak bytes of a decoder layer's recompute + backward for n tokens, by the walk documented in
    ``costs._layer_backward_peak``, from per-token byte counts (``saved``: everything the layer
    keeps; ``sdpa``: what lives at SDPA's backward) and gradient bytes. S = n·saved, W = one MLP
    weight's gradient D·F·e; at down_proj S + n·F·e + W, at the SwiGLU product S + 2·n·F·e + W, at
    up_proj S − n·F·e + n·D·e + 2W, at gate_proj S − 3·n·F·e + 2·n·D·e + 3W, at SDPA
    n·sdpa + 3W + D·D·e (o_proj, H·Q = D here), at the layer's end its gradients + n·(input norm + 3·D·e)."""
    s, w = n * saved, d * f * e
    return max(
        s + n * f * e + w,
        s + 2 * n * f * e + w,
        s - n * f * e + n * d * e + 2 * w,
        s - 3 * n * f * e + 2 * n * d * e + 3 * w,
        n * sdpa + 3 * w + d * d * e,
        grads + n * (norm_in + 3 * d * e),
    )


def _hardware(**kw) -> HardwareConfig:
    base = dict(
        name="test",
        peak_flops=1e12,
        matmul_efficiency=0.5,
        device_memory_gb=10.0,
        host_link_gbps=10.0,
        host_memory_gb=100.0,
        host_memory_bandwidth_gbps=200.0,
        cores=8,
        gpus_per_node=2,
    )
    return HardwareConfig(**{**base, **kw})


# ----------------------------------------------------------------------------- config A


def _config_a() -> Config:
    """Untied Llama, D=64, 2 layers, H=4, K=2 (Q=16), F=128, V=300; bf16; 2 stages, 1F1B,
    B=2, T=16, M=2, G=1, 2 slots; two GPUs of 1 TFLOP/s at 50%, 10 GB/s links, 200 GB/s host memory."""
    cfg = Config()
    hf = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
    )
    cfg.model = ModelConfig(name="hand_a", arch="LlamaForCausalLM", hf=hf)
    cfg.data.vocab_size = 300
    cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.dtype = 16, 2, "bfloat16"
    cfg.pipeline.stages, cfg.pipeline.microbatches, cfg.pipeline.schedule = 2, 2, "1f1b"
    cfg.hardware = _hardware()
    cfg.optim.on_device = False  # the host path's bytes by hand (test_on_device.py prices the device's)
    return cfg


# Units: embed V·D; a layer: q, o D·(H·Q) each, k, v D·(K·Q) each, gate/up/down D·F each, 2 norms D;
# head: final norm D + lm_head V·D.
A_EMBED = 300 * 64
A_LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
A_HEAD = 64 + 300 * 64


def test_config_a_host_store_by_hand() -> None:
    plan = make_plan(_config_a())
    assert (A_EMBED, A_LAYER, A_HEAD) == (19200, 36992, 19264)
    # four fp32 fields and one bf16 field per unit, each page-aligned
    expected = sum(4 * _align(n * 4) + _align(n * 2) for n in (A_EMBED, A_LAYER, A_LAYER, A_HEAD))
    assert expected == 2_072_576
    assert plan.store_bytes == expected
    assert plan.fields["master"] == _align(A_EMBED * 4) + 2 * _align(A_LAYER * 4) + _align(A_HEAD * 4)
    assert plan.fields["compute"] == _align(A_EMBED * 2) + 2 * _align(A_LAYER * 2) + _align(A_HEAD * 2)
    assert "grad_tied" not in plan.fields
    assert plan.shape.num_params == A_EMBED + 2 * A_LAYER + A_HEAD


def test_config_a_device_memory_by_hand() -> None:
    plan = make_plan(_config_a())
    # costs: embed 0, layers A_LAYER, head A_HEAD -> {embed, L0} | {L1, head} (max 56,256 < 73,984)
    assert [list(s.blocks) for s in plan.stages] == [[0, 1], [2, 3]]
    n, d, e = 2 * 16, 64, 2
    s0, s1 = plan.stages
    assert s0.window_bytes == s1.window_bytes == 2 * A_LAYER * e == 147_968
    # 1F1B: stage 0 holds min(S - 0, M) = 2 micro-batches, stage 1 holds 1; the embedding saves int64 ids
    assert s0.saved_bytes == 2 * (n * 8 + n * d * e) == 8_704
    assert s1.saved_bytes == 1 * (2 * n * d * e) == 8_192
    # P2P buffers alive at once (n·D·e each). Stage 0 (F0 F1 B0 B1): act 0 goes alone and is held
    # until a receive from stage 1 completes; the group before B0 posts act 1 and receives grad 0
    # while act 0 is still held: 3. Stage 1 (F0 B0 F1 B1) only ever has one input gradient out: 1.
    # (Reserving every send of the step until its end, 2 · G·M · n·D·e, was the old model.)
    assert (s0.p2p_buffers, s1.p2p_buffers) == (3, 1)
    assert s0.p2p_bytes == 3 * n * d * e == 12_288 and s1.p2p_bytes == n * d * e == 4_096
    # a layer saves per token: input norm 4D + 2·D·e, q/k/v (H+2K)·Q·e, SDPA output and o_proj's
    # copy 2·H·Q·e, lse 4·H, post norm 4D + 2·D·e, MLP 4·F·e, output + incoming gradient 2·D·e
    # = 512 + 256 + 256 + 16 + 512 + 1024 + 256 = 2832 bytes
    # at SDPA's backward per token: input norm 512, q/k/v + output + lse 400, 3·D·e 384, the output's
    # gradient 128 and q/k/v's 256 = 1680
    layer = _layer_peak(n, d, f=128, saved=2832, norm_in=512, sdpa=1680, grads=A_LAYER * e, e=e)
    assert layer == 90_624 + 2 * 8_192 + 16_384 == 123_392  # at the SwiGLU product's backward
    # the head (linear_ce.py, one chunk: 32 tokens < 512 MiB / (4·V)): fp32 sums of its 19,264
    # weight gradients 77,056, its input's gradient n·D·e 4,096, the final norm n·D·(4 + 2e)
    # 16,384, and the log-softmax backward 3 × 4·n·V = 115,200 (more than the lm_head's: its logits'
    # gradient n·V·(e + 4) 57,600 + the chunk's weight gradient 19,264·e 38,528)
    head = 77_056 + 4_096 + 16_384 + 115_200
    queued = 2 * A_LAYER * e  # a GPU stage may hold `slots` earlier blocks' gradients for D2H
    assert s0.transient_bytes == layer + queued == 271_360
    assert s1.transient_bytes == head + queued == 360_704
    assert s1.total_bytes == 147_968 + 8_192 + 4_096 + 360_704 == 520_960


def test_config_a_keeps_every_layer_and_prices_no_recompute() -> None:
    """``stream.recompute=auto`` on config A's 10 GB device: what the resident blocks leave holds
    every layer's activations, so no layer is recomputed and a layer's backward is 2 × its forward:
    per micro-batch stage 1 (L1 and the head) does 6·N·n + 3 forward attentions, not 8·N·n + 4."""
    plan = make_plan(_config_a())
    assert plan.run.kept == (frozenset({1}), frozenset({2}))
    assert any(ln.startswith("stream.recompute=auto on stage 1: 1 of 1 layers keep") for ln in plan.choices)
    n, tq = 32, 16
    flops = 6 * A_LAYER * n + 6 * A_HEAD * n + 3 * (4 * n * tq * 4 * 16)
    assert plan.time.compute_s == pytest.approx(2 * flops / (1e12 * 0.5), rel=1e-12)


def _rates_a() -> tuple[float, float]:
    """Config A's host rates: 8 cores / 2 ranks = 4, split 2 accumulation + 2 optimizer threads at
    10 GB/s per core (HardwareConfig's default), below each rank's 100 GB/s share of 200 GB/s."""
    return 2 * 10e9, 2 * 10e9


def test_config_a_step_time_by_hand() -> None:
    """The 10 GB device keeps every block resident (automatic budget): each is loaded once per step
    and offloads its fp32 gradient once (4 B/param), whatever the micro-batch count. Every layer is
    recomputed (``stream.recompute=true``; ``auto`` keeps them here: the test below)."""
    cfg = _config_a()
    cfg.stream.recompute = True
    plan = make_plan(cfg)
    assert plan.resident == (frozenset({0, 1}), frozenset({2, 3}))
    t = plan.time
    n, tq, e = 32, 16, 2
    attn = 16 * n * tq * 4 * 16  # one layer: 4 × forward attention 4·n·T·H·Q
    # per micro-batch: 8·N·n (forward, recompute, backward); the head 6·N·n (gradients in its forward)
    flops = [8 * A_LAYER * n + attn, 8 * A_LAYER * n + 6 * A_HEAD * n + attn]
    rate = 1e12 * 0.5
    slot = flops[1] / rate  # stage 1's compute is the slowest part of any micro-batch
    s0, s1 = A_EMBED + A_LAYER, A_LAYER + A_HEAD
    assert [x.loads for x in t.traffic] == [2, 2]
    assert [x.h2d_bytes for x in t.traffic] == [s0 * e, s1 * e]
    assert [x.d2h_bytes for x in t.traffic] == [4 * s0, 4 * s1]  # once per step, fp32
    assert [x.accum_bytes for x in t.traffic] == [8 * s0, 8 * s1]  # read staged + write accumulator
    assert [x.optimizer_bytes for x in t.traffic] == [42 * s0, 42 * s1]
    accum_rate, optim_rate = _rates_a()
    assert t.compute_s == pytest.approx(2 * slot, rel=1e-12)  # G·M = 2 micro-batches
    assert t.h2d_s == pytest.approx(s1 * e / 10e9, rel=1e-12)
    assert t.d2h_s == pytest.approx(4 * s1 / 10e9, rel=1e-12)
    # deferred updates (clipping): the idle optimizer thread helps the whole accumulation
    # (stream.accum_help), both teams' 20 GB/s together, below the rank's 100 GB/s share
    assert t.accum_s == pytest.approx(8 * s1 / (accum_rate + optim_rate), rel=1e-12)
    # the pipeline: stage 0's first forward fills it, stage 1 (the slower: L1 and the head) runs its
    # 2 micro-batches back to back, stage 0's last backward drains it; f_l = a layer's forward
    f_l, f_h = (2 * A_LAYER * n + attn / 4) / rate, 6 * A_HEAD * n / rate
    assert slot == pytest.approx(4 * f_l + f_h, rel=1e-12)
    # the step's edges (cost/blocks.py): each resident block ships its fp32 gradient at the last
    # backward, max(4·P over the 10 GB/s link, 8·P at the helped accumulation's 40 GB/s) = 4·P / 1e10 s;
    # stage 1 queues the head's ship first, then L1's after its backward; stage 0 L0's after its
    # backward, then the embedding's (no compute): its flush is both ships
    ship = {x: 4 * x / 1e10 for x in (A_EMBED, A_LAYER, A_HEAD)}
    extra1 = max(ship[A_HEAD], 3 * f_l) + ship[A_LAYER] - 3 * f_l
    flush0 = ship[A_LAYER] + ship[A_EMBED]
    pipeline = max(f_l + 2 * slot + 3 * f_l + flush0, f_l + 2 * slot + extra1)
    assert t.bubble_s == pytest.approx(pipeline - 2 * slot - extra1, rel=1e-12)  # stage 0's one micro-batch
    assert t.optimizer_s == pytest.approx(42 * s1 / optim_rate, rel=1e-12)
    host = (2 + 4 + 8 + 42) * (s0 + s1)
    assert t.host_bytes == host and t.host_dram_s == pytest.approx(host / 200e9, rel=1e-12)
    params = A_EMBED + 2 * A_LAYER + A_HEAD
    # Clipping (the default): deferred updates, released at the all-reduce in forward order; a load
    # waits for its unit's update, on one H2D worker in order; a block's forward waits for its load.
    # Stage 0 (embed, L0; no fill): the embedding (no FLOPs) after u_e + l_e, L0's forward after
    # u_e + u_l + l_l; without the updates after l_e + l_l. Stage 1 (L1, head) starts after a fill
    # of stage 0's forward f_l, its L1 update first.
    u_e, u_l, u_h = (42 * x / optim_rate for x in (A_EMBED, A_LAYER, A_HEAD))
    l_e, l_l, l_h = (e * x / 10e9 for x in (A_EMBED, A_LAYER, A_HEAD))  # resident: whole loads
    # Without the updates the first forward takes its passes' seconds (the pipeline's: resident
    # blocks have no per-pass loads): f_l on stage 0, the fill f_l + f_l + f_h on stage 1.
    stage0 = (max(u_e + l_e, u_e + u_l) + l_l + f_l) - f_l
    l1 = max(f_l, u_l + l_l) + f_l
    head = max(l1, max(u_l + l_l, u_l + u_h) + l_h) + f_h
    base = f_l + f_l + f_h
    exposed = max(stage0, head - base)
    assert t.update_mode == "deferred"
    assert t.optimizer_exposed_s == pytest.approx(exposed, rel=1e-12)
    assert exposed > 0.9 * t.optimizer_s  # little of AdamW hides behind a first forward this short
    # the exposed seconds add to the pipeline; the DRAM (each stage's optimizer moving at most its
    # rate while exposed) binds less
    moved = sum(min(exposed * optim_rate, 42 * x) for x in (s0, s1))
    assert (host - moved) / 200e9 < pipeline
    assert t.step_s == pytest.approx(pipeline + exposed, rel=1e-12)
    assert t.bottleneck == "optimizer cores"
    assert t.tokens == 2 * n
    # PaLM: 6·N + 12·L·H·Q·T per token, N = matmul weights (2 layers + lm_head)
    assert t.model_flops == (6 * (2 * A_LAYER + A_HEAD) + 12 * 2 * 4 * 16 * tq) * 64
    assert t.mfu(plan.peak_flops) == pytest.approx(t.model_flops / t.step_s / 2e12)
    assert plan.fits and plan.verdict == "fits; optimizer cores-bound"
    assert plan.train_tokens == 20 * params
    assert plan.days_one_node == pytest.approx(20 * params / (64 / t.step_s * 86400))


def test_config_a_streamed_transfers_by_hand() -> None:
    """``stream.device_budget=0``: the load sequence of 1F1B under the engine's rules, by hand.

    Stage 0 (embed, L0; warm-up 1): F0 F1 B0 B1 loads L0 | L0 | L0 | L0 -> a block used twice in a
    row is loaded once: L0 once; the embedding never enters the load sequence (each forward gathers
    its rows, the backward scatter-adds a row gradient).
    Stage 1 (L1, head; no warm-up): F0 B0 F1 B1 loads L1 head | L1 | L1 head | L1 (the head takes
    its gradients in the forward) -> L1, head, L1, head, L1."""
    cfg = _config_a()
    cfg.stream.device_budget = 0
    plan = make_plan(cfg)
    assert plan.resident == (frozenset(), frozenset())
    t0, t1 = plan.time.traffic
    n, d, e = 32, 64, 2
    rows = n * d * e  # the embedding moves the gathered rows only
    assert (t0.loads, t1.loads) == (1, 5)
    assert t0.h2d_bytes == 2 * rows + A_LAYER * e
    assert t1.h2d_bytes == 3 * A_LAYER * e + 2 * A_HEAD * e
    # one offload per backward (the head: per forward); the embedding's: its rows and 8-byte ids
    assert t0.d2h_bytes == 2 * (rows + 8 * n) + 2 * A_LAYER * e
    assert t1.d2h_bytes == 2 * A_LAYER * e + 2 * A_HEAD * e
    # the worker reads each staged gradient; the first offload of the step writes the accumulator,
    # later ones read and write it; the embedding's is zeroed once and scatter-added per row
    layer = 2 * A_LAYER * e + 4 * A_LAYER + 8 * A_LAYER
    assert t0.accum_bytes == 4 * A_EMBED + 2 * (rows + 8 * n + 8 * n * d) + layer
    assert t1.accum_bytes == layer + 2 * A_HEAD * e + 4 * A_HEAD + 8 * A_HEAD
    assert plan.time.h2d_s == pytest.approx(t1.h2d_bytes / 10e9, rel=1e-12)


def test_more_microbatches_leave_resident_offload_unchanged() -> None:
    """Invariant 8: with every unit resident, D2H bytes per step do not grow with the micro-batches
    (4 B/param of the stage, once); streamed, they double when the micro-batches double."""
    by_m = {}
    for budget in (-1, 0):
        for m in (4, 8):
            cfg = _config_a()
            cfg.pipeline.microbatches, cfg.stream.device_budget = m, budget
            by_m[budget, m] = [x.d2h_bytes for x in make_plan(cfg).time.traffic]
    assert by_m[-1, 4] == by_m[-1, 8] == [4 * (A_EMBED + A_LAYER), 4 * (A_LAYER + A_HEAD)]
    assert [b / a for a, b in zip(by_m[0, 4], by_m[0, 8], strict=True)] == [2.0, 2.0]


def test_grad_accum_runs_as_one_round() -> None:
    """G rounds of M run as one 1F1B round of G·M: one fill and drain (stage 0's first forward and
    last backward: one of its micro-batches) around the slower stage 1's G·M micro-batches."""
    cfg = _config_a()
    cfg.train.grad_accum = 3
    cfg.plan.overlap_optimizer = False
    t = make_plan(cfg).time
    cfg.train.grad_accum = 1
    once = make_plan(cfg).time  # the step's edges (the ships, the flush) come once a step, whatever G
    edges = once.bubble_s - once.stage_compute_s[0] / 2
    assert t.compute_s == pytest.approx(t.stage_compute_s[1], rel=1e-12)
    assert t.bubble_s == pytest.approx(t.stage_compute_s[0] / (3 * 2) + edges, rel=1e-12)
    # serial updates: the phases add up (stage 1's waits: its ships' flush)
    phases = t.compute_s + t.stall_s + t.d2h_wait_s + t.bubble_s + t.optimizer_s
    assert t.step_s == pytest.approx(phases, rel=1e-12)


def test_host_dram_bottleneck_named() -> None:
    """A slow memory bus shared by the ranks bounds the step at all ranks' host bytes / bandwidth."""
    cfg = _config_a()
    cfg.stream.device_budget = 0
    cfg.hardware.host_memory_bandwidth_gbps = 1e-4
    t = make_plan(cfg).time
    # the gradient accumulation (on the bus too) sets each stage's micro-batches, and the optimizer
    # (at each rank's half of the bus) is exposed after the pipeline: stage 1's 2 micro-batches and
    # stage 0's one (its drain: the flush of its last backward; its fill is a forward with its
    # loads, microseconds), longer than the bus's bytes alone
    accum = [x.accum_bytes / 5e4 for x in t.traffic]
    assert t.accum_s == pytest.approx(accum[1], rel=1e-12)
    assert t.step_s == pytest.approx(accum[1] + accum[0] / 2 + t.optimizer_exposed_s, rel=1e-6)
    assert t.step_s > t.host_bytes / 1e5
    assert t.bottleneck == "host DRAM"
    cfg.hardware.host_memory_bandwidth_gbps, cfg.hardware.core_memory_bandwidth_gbps = 200.0, 1e-5
    t = make_plan(cfg).time  # 2 threads × 10 kB/s: the optimizer's cores, not the bus
    assert t.optimizer_s == pytest.approx(42 * (A_LAYER + A_HEAD) / 2e4, rel=1e-12)
    assert t.bottleneck == "optimizer cores"


# ----------------------------------------------------------------------------- config B


def _config_b() -> Config:
    """Tied Qwen3 (q/k norms), D=64, 2 layers, H=4, K=2, Q=16, F=128, V=300; fp32; 1 stage, GPipe,
    B=1, T=8, M=3, G=2; a CPU profile (gpus_per_node=0) with a slow memory bus."""
    cfg = Config()
    hf = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    cfg.model = ModelConfig(name="hand_b", arch="Qwen3ForCausalLM", hf=hf)
    cfg.data.vocab_size = 300
    cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.dtype, cfg.train.grad_accum = 8, 1, "float32", 2
    cfg.pipeline.stages, cfg.pipeline.microbatches, cfg.pipeline.schedule = 1, 3, "gpipe"
    cfg.hardware = _hardware(gpus_per_node=0, device_memory_gb=0.0, host_memory_bandwidth_gbps=1e-3)
    return cfg


B_EMBED = 300 * 64
B_LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 16 + 3 * 64 * 128 + 2 * 64  # + q_norm, k_norm
B_HEAD = 64  # the final norm; lm_head is the embedding


def test_config_b_host_store_by_hand() -> None:
    plan = make_plan(_config_b())
    assert (B_EMBED, B_LAYER) == (19200, 37024)
    # fp32 transfer copy: five 4-byte fields per unit, and the tied embedding's 2nd gradient
    expected = 6 * _align(B_EMBED * 4) + 2 * 5 * _align(B_LAYER * 4) + 5 * _align(B_HEAD * 4)
    assert expected == 2_002_944
    assert plan.store_bytes == expected
    assert plan.fields["grad_tied"] == _align(B_EMBED * 4)
    assert plan.shape.num_params == B_EMBED + 2 * B_LAYER + B_HEAD


def test_config_b_memory_and_time_by_hand() -> None:
    plan = make_plan(_config_b())
    (s0,) = plan.stages
    n, d, e = 8, 64, 4
    assert s0.window_bytes == 2 * B_LAYER * e == 296_192  # the tied head binds 64 + 19,200 < B_LAYER
    assert s0.saved_bytes == 3 * (n * 8 + 3 * n * d * e) == 18_624  # GPipe: all M in flight
    assert s0.p2p_bytes == 0
    # a layer saves per token (e = 4: the input norm's upcast is its input): input norm 2·D·e, q/k/v
    # (H+2K)·Q·e, SDPA output and o_proj's copy 2·H·Q·e, lse 4·H, q/k norms (H+K)·Q·(4+e), post
    # norm 4D + 2·D·e, MLP 4·F·e, output + incoming gradient 2·D·e
    # = 512 + 512 + 512 + 16 + 768 + 768 + 2048 + 512 = 5648 bytes
    # at SDPA's backward per token: input norm 512, q/k/v + output + lse + q/k norms 1552, 3·D·e
    # 768, the output's gradient 256 and q/k/v's 512 = 3600
    layer = _layer_peak(n, d, f=128, saved=5648, norm_in=512, sdpa=3600, grads=B_LAYER * e, e=e)
    # the layer's end: its weight gradients 37,024·4 and n·(512 + 3·D·e) = 10,240
    assert layer == 148_096 + 10_240 == 158_336
    # the tied head binds 64 + 19,200: fp32 sums of its gradients 77,056, its input's gradient
    # n·D·e 2,048, the final norm n·D·12 6,144, and the lm_head's backward (fp32: logits' gradient
    # n·V·4 9,600 + the chunk's weight gradient 77,056, more than the log-softmax's 3·4·n·V
    # 28,800) is the stage's peak; fp32 needs no conversion, the CPU copy worker holds no queue
    assert s0.transient_bytes == 77_056 + 2_048 + 6_144 + 9_600 + 77_056 == 171_904 > layer
    # on a CPU profile the stage lives in host memory next to the store and the rank overhead
    assert s0.staging_bytes == 2 * B_LAYER * e  # host: one D2H staging buffer per slot, the largest block
    assert plan.host_need_bytes == plan.store_bytes + int(0.5e9) + s0.total_bytes + s0.staging_bytes
    t = plan.time
    params = B_EMBED + 2 * B_LAYER + B_HEAD
    # 4 optimizer threads (8 cores, 1 rank) at 10 GB/s each, bound by the 1e-3 GB/s bus
    assert t.optimizer_s == pytest.approx(params * (40 + 4) / 1e6, rel=1e-12)
    # the bus carries every host byte: it bounds the step (overlapped) and is named
    assert t.host_dram_s == pytest.approx(t.host_bytes / 1e6, rel=1e-12) and t.host_dram_s > t.optimizer_s
    assert t.bottleneck == "host DRAM"
    assert t.step_s == pytest.approx(t.host_dram_s)
    assert t.tokens == 2 * 3 * n
    # GPipe, G = 2 rounds of M = 3: forwards load L0, L1, head (the embedding gathers rows); backwards
    # L1, L0 (the head's gradients come with its forward, the embedding's need no weights): 15 loads a
    # round, none repeated within it; the second round's first L0 follows the first's last: 29
    (x,) = t.traffic
    assert x.loads == 2 * (3 * 3 + 3 * 2) - 1
    h2d = 6 * n * d * e + 23 * B_LAYER * e + 6 * (B_HEAD + B_EMBED) * e  # the tied head binds V·D
    assert x.h2d_bytes == h2d
    assert x.d2h_bytes == 6 * (n * d * e + 8 * n) + 12 * B_LAYER * e + 6 * (B_HEAD + B_EMBED) * e
    cfg = _config_b()
    cfg.plan.overlap_optimizer = False
    serial = make_plan(cfg).time
    slot = max(serial.compute_s, serial.h2d_s, serial.d2h_s, serial.accum_s) / 6
    assert serial.h2d_s == pytest.approx(h2d / 10e9, rel=1e-12)
    want = max((6 + 1 - 1) * slot + serial.optimizer_s, serial.host_dram_s)
    assert serial.step_s == pytest.approx(want, rel=1e-12)
    cfg.plan.train_tokens, cfg.plan.days = 1e9, 7.0
    p = make_plan(cfg)
    assert p.nodes == math.ceil(1e9 / p.time.tokens_per_day / 7.0)


def test_recompute_false_counts_every_layers_kept_activations() -> None:
    """``stream.recompute=false`` keeps every layer's activations whatever the budget: the fit and
    the automatic budget count them (``in_flight × kept_activation_bytes`` a layer), so a device that
    holds config A's streamed step but not its kept layers refuses it, and ``auto`` keeps what fits.
    The planned placement's table (``Plan.placed``) holds them with the resident units."""
    auto = make_plan(_config_a())
    kept = [auto.placed[k].kept_bytes for k in range(2)]
    assert all(kept) and kept == [
        st.in_flight * kept_activation_bytes(auto.shape, k + 1, 32, 2) for k, st in enumerate(auto.placed)
    ]
    assert [st.kept_bytes for st in auto.stages] == [0, 0]  # the streamed peak keeps nothing
    placed = auto.placed[1]
    assert placed.total_bytes == (
        placed.window_bytes + placed.resident_bytes + placed.grad_acc_bytes + placed.activation_bytes
    )
    cfg = _config_a()
    cfg.stream.recompute = False
    everything = make_plan(cfg)
    assert [st.kept_bytes for st in everything.stages] == kept  # one layer per stage: all of them
    cfg.hardware.device_memory_gb = 2.0 + (everything.stages[1].total_bytes - kept[1] // 2) / 1e9
    assert not make_plan(cfg).fits  # the streamed step fits, its kept activations do not
    cfg.stream.recompute = "auto"
    assert make_plan(cfg).fits


def test_device_does_not_fit_names_the_largest_micro_batch() -> None:
    cfg = _config_a()
    cfg.hardware.device_memory_gb = 2.0 + 0.0005  # 500 kB usable beyond the 2 GB reserve
    plan = make_plan(cfg)
    assert plan.stages[1].total_bytes == 520_960  # B=2 (see above) does not fit
    # stage 1 at B=1 (n=16): window + saved + P2P + head + gradients queued
    saved = 1 * 2 * (16 * 64 * 2)  # one micro-batch in flight, inputs of L1 and the head
    p2p = 1 * (16 * 64 * 2)  # one input gradient out at a time
    # the head: sums 77,056 + input gradient 2,048 + norm 16·64·8 + lm_head backward 16·300·6 +
    # 38,528 (more than 3·4·16·300 = 57,600)
    head = 77_056 + 2_048 + 8_192 + 28_800 + 38_528
    assert 147_968 + saved + p2p + head + 147_968 == 456_704 < 500_000
    assert not plan.fits and plan.max_micro_batch == 1
    assert "train.micro_batch_size=1" in plan.problems[0] and "device memory" in plan.problems[0]


def test_more_stages_than_gpus_is_refused() -> None:
    cfg = _config_a()
    cfg.hardware.gpus_per_node = 1
    with pytest.raises(
        ConfigError, match=re.escape("pipeline.stages=2: more stages than hardware.gpus_per_node=1")
    ):
        make_plan(cfg)


def test_host_problems_by_hand() -> None:
    assert host_problems(10 * 10**9, 2, 10**9, 12 * 10**9, 20 * 10**9, "/dev/shm") == []
    (memory,) = host_problems(10 * 10**9, 4, 10**9, 12 * 10**9, 20 * 10**9, "/dev/shm")
    assert "10.0 GB + 4 rank(s) × 1.00 GB (plan.rank_overhead_gb) = 14.0 GB" in memory
    assert "only 12.0 GB is available" in memory
    (disk,) = host_problems(10 * 10**9, 1, 0, 99 * 10**9, 9 * 10**9, "/x")
    assert disk.startswith("store.dir=/x:") and "9.0 GB free" in disk
    # a small store is not printed as "0.0 GB" (issue 25): 12.3 MB needed, 4.5 MB free
    (small,) = host_problems(12_345_678, 1, 0, 99 * 10**9, 4_500_000, "/y")
    assert "needs 12.3 MB but the directory has 4.5 MB free" in small


# ----------------------------------------------------------------------------- profiles and CLI


def _profiles() -> list[str]:
    return sorted(p.stem for p in (CONF / "hardware").glob("*.yaml"))


@pytest.mark.parametrize("profile", _profiles())
def test_every_hardware_profile_states_sources_and_plans(profile: str) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_typed(compose("config", overrides=[f"hardware={profile}"]))
    hw = cfg.hardware
    assert hw.name == profile and len(hw.source) > 40
    assert hw.peak_flops > 1e10 and hw.host_link_gbps > 0 and hw.host_memory_bandwidth_gbps > 0
    assert hw.host_memory_gb > 0 and hw.cores >= 1
    assert (hw.gpus_per_node == 0) == (hw.device_memory_gb == 0)
    plan = make_plan(cfg)
    assert plan.store_bytes > 0 and plan.time.step_s > 0


def _plan_cli(*overrides: str, rc: int = 0) -> str:
    """``python -m nodetrain.plan`` as a process: its exit status must be ``rc``; its output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", COLUMNS="200")
    cmd = [sys.executable, "-m", "nodetrain.plan", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _plan_text(*overrides: str) -> str:
    """What ``python -m nodetrain.plan`` prints for ``overrides``, in this process: its main's own
    calls (``make_plan`` of the composed ``plan`` config, then ``render``) on a 200-column console.
    The process itself (exit status, no traceback) is :func:`_plan_cli`'s."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_typed(compose("plan", overrides=list(overrides)))
    text = io.StringIO()
    render(make_plan(cfg), Console(file=text, width=200))
    return text.getvalue()


def test_cli_refuses_meaningless_hardware_without_a_traceback() -> None:
    out = _plan_cli("hardware=h100_sxm", "hardware.cores=0", "hardware.gpus_per_node=0", rc=2)
    assert "hardware.cores=0: must be >= 1" in out
    assert "hardware.gpus_per_node=0: must be >= 1 on a GPU profile" in out
    assert "Traceback" not in out
    with pytest.raises(ConfigError) as refused:
        _plan_text("hardware=h100_sxm", "hardware.hbm_bandwidth_gbps=0")
    assert "hardware.hbm_bandwidth_gbps=0: the AdamW of units kept on the device" in str(refused.value)
    _plan_cli("hardware=h100_sxm", "hardware.hbm_bandwidth_gbps=0", "optim.on_device=false")  # not needed


def test_cli_llama2_70b_on_h100_fits() -> None:
    out = _plan_text(
        "model=llama2_70b",
        "hardware=h100_sxm",
        "train.seq_len=4096",
        "train.micro_batch_size=4",
        "pipeline.microbatches=16",
    )
    # 18 bytes/param (4 fp32 fields + bf16) of the published 68.98B parameters
    assert re.search(r"host store\s+│\s+18\.00\s+│\s+1,241\.\d\d", out), out
    for part in (
        "compute: forward",
        "H2D",
        "D2H",
        "host accumulation",
        "pipeline bubble",
        "CPU optimizer",
        "host DRAM",
        "tokens/day",
        "Bytes per step per stage",
        "host side: 8 rank(s)",
    ):
        assert part in out
    assert "verdict: fits" in out and "largest micro-batch that fits" in out


def test_cli_1t_model_on_8_gpus_does_not_fit() -> None:
    out = _plan_text("model=llama_1t", "hardware=h100_sxm", "train.seq_len=4096", "train.micro_batch_size=1")
    assert "verdict: does not fit" in out
    # 18 bytes/param × 1.005T parameters against the DGX H100's 2,048 GB
    assert re.search(r"host store needs 18,0\d\d GB \(18\.0 bytes/param\)", out), out
    assert "largest model that fits is ~113" in out


# ----------------------------------------------------------------------------- training refusal


def test_training_refuses_a_store_larger_than_host_memory(tmp_path, shm_dir) -> None:
    """llama2_70b needs ~1.24 TB of host store: every rank refuses before the store exists, and no
    rank grows beyond a small fraction of the machine (nothing was allocated)."""
    corpus = tmp_path / "sonnet.txt"
    corpus.write_text(SONNET * 150)
    overrides = [
        "model=llama2_70b",
        f"data.source={corpus}",
        f"data.dir={tmp_path / 'prepared'}",
        "data.vocab_size=300",
        "train.seq_len=16",
        f"store.dir={shm_dir}",
    ]
    # A wrapper reports the peak RSS of its waited-for descendants (torchrun and both ranks).
    wrapper = (
        "import resource, subprocess, sys\n"
        "rc = subprocess.run(sys.argv[1:]).returncode\n"
        "print(f'MAXRSS_KB={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}', flush=True)\n"
        "sys.exit(rc)\n"
    )
    cmd = [sys.executable, "-c", wrapper, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "nodetrain.train", *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", NODETRAIN_RUNS=str(tmp_path / "runs"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "llama2_70b (68.98B parameters × 18.0 bytes/param of host store) does not fit" in out, out[-4000:]
    assert re.search(r"host store needs 1241\.6 GB \+ 2 rank\(s\) × 0\.50 GB .* = 1242\.6 GB, but only", out)
    assert f"store.dir={shm_dir}: the host store needs 1241.6 GB" in out
    assert out.count("does not fit this node") == 1, "printed once, by rank 0"
    (rank1_log,) = (tmp_path / "runs").glob("*/rank1.log")
    assert "does not fit this node" in rank1_log.read_text(), "rank 1 refused too (in its own log)"
    assert not list(shm_dir.iterdir()), "a store file was created"
    assert not list((tmp_path / "runs").glob("*/metrics.jsonl")), "training started"
    max_rss_gb = int(re.search(r"MAXRSS_KB=(\d+)", out)[1]) / 1e6
    assert max_rss_gb < 2.0, f"a rank reached {max_rss_gb:.1f} GB: something was allocated"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gpu_profile_counts_page_locking_the_transfer_copies() -> None:
    """On a GPU profile the host need adds 16 B per 4 KiB page of the transfer copy (each rank
    page-locks the units it loads, HostStore.pin); a CPU profile pins nothing."""
    gpu = make_plan(_config_a())
    cfg = _config_a()
    cfg.hardware = _hardware(gpus_per_node=0, device_memory_gb=0.0)
    cpu = make_plan(cfg)
    compute = gpu.fields["compute"]
    assert compute == _align(A_EMBED * 2) + 2 * _align(A_LAYER * 2) + _align(A_HEAD * 2) == 58 * 4096
    staging = sum(s.staging_bytes for s in gpu.stages)
    assert gpu.host_need_bytes == gpu.store_bytes + 2 * 0.5 * 1e9 + compute // 4096 * 16 + staging
    assert cpu.host_need_bytes - cpu.store_bytes - 2 * 0.5 * 1e9 - staging == sum(
        s.window_bytes + s.activation_bytes for s in cpu.stages
    )


# ----------------------------------------------------------------------------- automatic sizes


def _tokens_per_s(cfg: Config) -> float:
    t = make_plan(cfg).time
    return t.tokens / t.step_s


def test_auto_micro_batch_and_microbatches_pick_the_smallest_fast_batch() -> None:
    """``auto`` sizes: among the fitting powers of two × multiples of the stages, the smallest batch
    within 2% of the fastest, checked against explicit plans of every candidate."""
    cfg = _config_a()
    cfg.hardware.device_memory_gb = 2.0 + 0.0015  # 1.5 MB usable: micro-batches of 11-16 fit
    cfg.train.micro_batch_size, cfg.pipeline.microbatches = "auto", "auto"
    plan = make_plan(cfg)
    b, m = plan.batch.micro_batch_size, plan.batch.microbatches
    rates = {}
    for bb in (1, 2, 4, 8, 16, 32):
        for mm in (2, 4, 8, 16):
            trial = _config_a()
            trial.hardware.device_memory_gb = cfg.hardware.device_memory_gb
            trial.train.micro_batch_size, trial.pipeline.microbatches = bb, mm
            p = make_plan(trial)
            if p.fits:
                rates[bb, mm] = p.time.tokens / p.time.step_s
    assert (b, m) in rates and max(bb for bb, _ in rates) < 32, rates  # the memory limit binds
    best = max(rates.values())
    want = min((k for k, r in rates.items() if r >= 0.98 * best), key=lambda k: (k[0] * k[1], k[1]))
    assert (b, m) == want
    assert plan.fits and plan.time.tokens / plan.time.step_s == pytest.approx(rates[want])
    (line,) = [c for c in plan.choices if "train.micro_batch_size" in c]  # the budget's lines follow
    assert f"train.micro_batch_size={b}, pipeline.microbatches={m}" in line and "tokens/s" in line


def test_auto_sizes_divide_the_batch_and_refuse_when_nothing_fits() -> None:
    cfg = _config_a()
    cfg.train.batch_size, cfg.pipeline.microbatches = 24, "auto"
    plan = make_plan(cfg)
    m = plan.batch.microbatches
    assert 24 % (2 * m) == 0 and plan.time.tokens == 24 * 16
    cfg = _config_a()
    cfg.hardware.device_memory_gb = 2.0 + 0.0001  # 100 kB: not even one sequence
    cfg.train.micro_batch_size = "auto"
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=auto: no candidate fits test"):
        make_plan(cfg)


def test_auto_device_budget_is_the_engines_automatic_one() -> None:
    cfg = _config_a()
    cfg.stream.device_budget = "auto"
    plan = make_plan(cfg)
    assert _config_a().stream.device_budget == -1 and "stream.device_budget=auto" in plan.choices[0]
    assert plan.run.budgets == make_plan(_config_a()).run.budgets and min(plan.run.budgets) > 0
    assert plan.resident == make_plan(_config_a()).resident
