"""Cost model: the bytes a model costs on the engine, as pure arithmetic.

Owns: host store bytes per field, each stage's peak device bytes (window + activations), and the
bytes a step moves (H2D, D2H, and through host DRAM: the DMA, the gradient accumulation, the
optimizer). Does not own: the seconds those cost (``step_time.py``, ``compute.py``), hardware
profiles or verdicts (planner.py), measuring (``bench/``), or anything that needs torch.distributed.
Byte counts of the store and the stage partition come from the engine's own code (``StoreLayout``,
``partition`` in the caller), so the model cannot drift from what a run allocates.

Shapes: B = micro-batch size, T = sequence length, n = B·T tokens, D = hidden size, F = MLP width,
V = vocab, H / K = query / key-value heads, Q = head dim, e = compute-dtype bytes, S = stages,
M = micro-batches per round, G = rounds per step (grad_accum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nodetrain.plan.shape import ModelShape, shape_of
from nodetrain.store import StoreLayout

__all__ = [
    "ModelShape",
    "shape_of",
    "store_layout",
    "field_bytes",
    "pin_overhead_bytes",
    "StageMemory",
    "stage_memory",
    "GRAD_ACC_ITEMSIZE",
    "resident_bytes_per_param",
    "layer_saved_per_token",
    "saved_per_micro_batch",
    "optimizer_bytes_per_param",
    "speculative_backup_bytes",
    "StageTraffic",
    "load_sequence",
    "stage_traffic",
]


def store_layout(shape: ModelShape, compute_dtype: torch.dtype, state: str = "full") -> StoreLayout:
    """The engine's host store layout for ``shape`` (the tied embedding carries ``grad_tied``);
    ``state``: ``optim.state`` (``full`` or ``lean``)."""
    return StoreLayout(shape.unit_numels, compute_dtype, tied_units=(0,) if shape.tied else (), state=state)


def field_bytes(layout: StoreLayout) -> dict[str, int]:
    """Bytes of each store field summed over units, page-aligned as stored; sums to ``layout.nbytes``."""
    starts = sorted((off, name) for (_, name), off in layout.offsets.items())
    out: dict[str, int] = {}
    for (off, name), (nxt, _) in zip(starts, [*starts[1:], (layout.nbytes, "")], strict=True):
        out[name] = out.get(name, 0) + nxt - off
    return out


PIN_BYTES_PER_PAGE = 16
"""Host bytes the CUDA driver and kernel keep per registered 4 KiB page (its GPU-visible mapping and
the pin bookkeeping); an assumption, ~0.4% of the registered bytes."""


def pin_overhead_bytes(compute_bytes: int) -> int:
    """Host bytes of page-locking the store's transfer copies on a GPU node (``HostStore.pin``):
    every rank registers only the units it loads, so over the node the transfer copy
    (``field_bytes(layout)["compute"]``) is registered about once (the tied embedding twice)."""
    return compute_bytes // 4096 * PIN_BYTES_PER_PAGE


# ----------------------------------------------------------------------------- device memory

GRAD_ACC_ITEMSIZE = 4
"""Bytes per parameter of a resident block's fp32 gradient accumulator on the device."""


def resident_bytes_per_param(itemsize: int) -> int:
    """Device bytes per parameter of a resident block: its weights in the compute dtype plus its fp32
    gradient accumulator (``Window``'s resident buffers; DESIGN invariant 8)."""
    return itemsize + GRAD_ACC_ITEMSIZE


@dataclass(frozen=True)
class StageMemory:
    """Device bytes one stage holds at its peak (on a CPU profile: host bytes of that rank)."""

    stage: int
    blocks: range
    window_bytes: int
    """``slots × largest slotted block load × e``: the streamed blocks but a streamed embedding,
    which travels as gathered rows (``Window.nbytes`` less its resident buffers)."""
    staging_bytes: int
    """Host bytes (on every profile, page-locked on CUDA) of the gradient offloads' staging buffers,
    ``slots × largest block × e`` (``Window.staging_nbytes``, staging.py); not device memory."""
    saved_bytes: int
    """Saved block inputs of the micro-batches in flight, ``in_flight`` × the stage's per-micro-batch
    inputs."""
    p2p_bytes: int
    """P2P buffers alive at once, ``p2p_buffers × n·D·e``: sends in flight or still held by the
    round loop, and received gradients (``P2P.peak_bytes`` measures it)."""
    transient_bytes: int
    """Recompute + backward of one block (the largest such), plus gradients queued for D2H."""
    resident_bytes: int = 0
    """Resident blocks' weights and fp32 gradient accumulators, ``load × (e + 4)`` each
    (``Window.resident_nbytes``)."""
    in_flight: int = 0
    """Most micro-batches whose inputs the stage keeps at once (``pipeline.in_flight_peak`` of the
    step's schedule: 1F1B min(S − s, G·M) in its one round, GPipe M)."""
    p2p_buffers: int = 0
    """Most [B, T, D] P2P buffers alive at once (``pipeline.p2p_live_peak``; ``P2P.peak_buffers``)."""

    @property
    def activation_bytes(self) -> int:
        return self.saved_bytes + self.p2p_bytes + self.transient_bytes

    @property
    def total_bytes(self) -> int:
        return self.window_bytes + self.resident_bytes + self.activation_bytes


def layer_saved_per_token(shape: ModelShape, e: int, block: int | None = None) -> int:
    """Bytes per token that autograd saves while recomputing one decoder layer (transformers 5's
    Llama/Qwen3 ``DecoderLayer`` with SDPA; no T×T matrix), plus its output and incoming gradient.

    Read off the layer's forward: ``input_layernorm`` keeps its fp32 upcast 4·D (with e = 4 that is
    the block input, already saved), the normalized copy and the output, 2·D·e; attention keeps
    q and k after RoPE and v, (H + 2K)·Q·e (GQA: k and v are not repeated), SDPA's output H·Q·e,
    the ``.transpose(1, 2).contiguous()`` copy ``o_proj`` reads, H·Q·e, and SDPA's fp32
    log-sum-exp 4·H; Qwen3's q/k norms add (H + K)·Q·(4 + e); ``post_attention_layernorm`` keeps
    4·D + 2·D·e (its input, the residual sum, is new in every dtype); the SwiGLU MLP keeps gate,
    act(gate), up and their product, 4·F·e. The recomputed output and the gradient arriving for
    it are 2·D·e more.
    A mixture of experts' layer (``block``'s :meth:`ModelShape.routed` k of E) runs k·F_e + the shared
    experts' widths (:meth:`ModelShape.width`) and adds its router's fp32 logits and probabilities
    8·E, the top-k weights and ids 12·k, and the k gathered copies of the input and the experts'
    outputs 2·k·D·e: an estimate from transformers' MoE forward, not measured as the dense layer is.
    """
    d, f, q = shape.hidden, shape.width(block), shape.head_dim
    h, k = shape.heads, shape.kv_heads
    norm_in = (4 * d if e < 4 else 0) + 2 * d * e
    attention = (h + 2 * k) * q * e + 2 * h * q * e + 4 * h
    attention += (h + k) * q * (4 + e) if shape.qk_norm else 0
    top, experts = shape.routed(block)
    routing = 8 * experts + 12 * top + 2 * top * d * e
    return norm_in + attention + (4 * d + 2 * d * e) + 4 * f * e + 2 * d * e + routing


def _layer_backward_peak(shape: ModelShape, n: int, e: int, grads: int, block: int | None = None) -> int:
    """Peak bytes of recomputing one decoder layer for ``n`` tokens and taking its gradients.

    Autograd runs the MLP's backward first (``down_proj``, the SwiGLU product, ``up_proj``, the
    SiLU, ``gate_proj``: reverse creation order) and frees each node's saved tensors once it ran,
    while the weight gradients (F·D·e each) accumulate (a mixture of experts: F the width a token runs
    through, :meth:`ModelShape.width`, F·D its matrix over all experts, :meth:`ModelShape.mlp_weight`).
    With S the saved bytes
    (:func:`layer_saved_per_token` × n) the live bytes at each node are:

    - ``down_proj``: S + n·F·e (gradient of its input) + F·D·e;
    - the product: its input p is freed, grad_p stays while grad_a, grad_u are made: S + 2·n·F·e + F·D·e;
    - ``up_proj``: p, a, u, grad_p freed, grad_a kept: S − n·F·e + n·D·e + 2·F·D·e;
    - ``gate_proj``: the MLP's saved tensors and grad_a, grad_u freed, grad_g kept:
      S − 3·n·F·e + 2·n·D·e + 3·F·D·e;
    - SDPA's backward (the MLP and the post-attention norm done, ``o_proj``'s input copy freed):
      the input norm's and the attention's saved tensors, output, incoming and residual gradients
      3·D·e, the gradient of SDPA's output H·Q·e and the q, k, v gradients it makes (H + 2K)·Q·e,
      per token; weight gradients 3·F·D·e + ``o_proj``'s D·H·Q·e;
    - the end of the layer: every weight gradient (``grads``: the block's load × e), the input
      norm's saved tensors, the output, the incoming
      gradient and the input gradient.

    Checked against the resident peak of one layer's recompute + backward (``VmHWM`` with a pinned
    mmap threshold) on the three configurations of ``bench/plan_accuracy.py``: 3–4% above it.
    """
    d, f, q, h, k = shape.hidden, shape.width(block), shape.head_dim, shape.heads, shape.kv_heads
    saved = n * layer_saved_per_token(shape, e, block)
    w = shape.mlp_weight(block) * e
    norm_in = (4 * d if e < 4 else 0) + 2 * d * e
    attention = (h + 2 * k) * q * e + h * q * e + 4 * h + ((h + k) * q * (4 + e) if shape.qk_norm else 0)
    sdpa = n * (norm_in + attention + 3 * d * e + h * q * e + (h + 2 * k) * q * e) + 3 * w + d * h * q * e
    return max(
        saved + n * f * e + w,
        saved + 2 * n * f * e + w,
        saved - n * f * e + n * d * e + 2 * w,
        saved - 3 * n * f * e + 2 * n * d * e + 3 * w,
        sdpa,
        grads + n * (norm_in + 3 * d * e),
    )


def _head_peak_bytes(shape: ModelShape, n: int, e: int, load: int) -> int:
    """Peak of the head's loss and gradients, taken chunk by chunk over tokens in its forward
    (``engine/linear_ce.py``) for ``n`` tokens and a head binding ``load`` elements (P).

    Throughout: the fp32 sums of its weight gradients (4·P) and its input's gradient (n·D·e). Per
    chunk of c = min(n, ``linear_ce.chunk_tokens(V)``) tokens: the final norm's c·D·(4 + 2e) and
    the larger of the log-softmax's backward (its fp32 output, the gradient flowing into it and the
    one it makes, 3 × 4·c·V) and the lm_head's (the logits' gradient in the compute dtype c·V·e,
    with its fp32 source when e < 4, and the chunk's weight gradient P·e, added to the sums next).
    """
    from nodetrain.engine.linear_ce import chunk_tokens  # the engine's own chunk size

    v, d = shape.vocab, shape.hidden
    c = min(n, chunk_tokens(v))
    logits = max(12 * c * v, c * v * (e + (4 if e < 4 else 0)) + load * e)
    return 4 * load + n * d * e + c * d * (4 + 2 * e) + logits


def _block_peak_bytes(shape: ModelShape, block: int, n: int, e: int, on_cpu: bool) -> int:
    """Peak of recomputing ``block`` and taking its gradients.

    A decoder layer: :func:`_layer_backward_peak`; the head: :func:`_head_peak_bytes`; a dense
    (resident) embedding: its weight gradient (``load × e``).
    When the device is the CPU, ``Window.offload`` first copies the block's gradients into its
    staging buffer (staging.py, allocated with the window) and releases them; only then does the
    D2H worker convert each staged tensor to fp32 to add it to the store (4 bytes per element of
    the block's largest tensor, when e < 4), so that copy is a separate, later peak, not one on
    top of the gradients.
    """
    last = len(shape.unit_numels) - 1
    grads = shape.load_numels[block] * e
    convert = 4 * shape.largest_tensors[block] if on_cpu and e < 4 else 0
    if 0 < block < last:
        return max(_layer_backward_peak(shape, n, e, grads, block), convert)
    if block == last:
        return max(_head_peak_bytes(shape, n, e, shape.load_numels[block]), convert)
    return max(grads, convert)  # a dense embedding only scatters: no activations to recompute


def _rows_backward_bytes(shape: ModelShape, n: int, e: int, on_cpu: bool) -> int:
    """Peak of the backward of a streamed embedding, which travels as the rows a micro-batch uses
    (``Window.rows``; stage.py ``_embedding_backward``): the output gradient in fp32 (4·n·D, a new
    tensor when e < 4), the fp32 sums of the U ≤ min(n, V) used rows (4·U·D) and their
    compute-dtype copy for the offload (U·D·e, when e < 4); on the CPU the D2H worker's fp32 copy
    of the staged rows (4·U·D, when e < 4) comes later, as for a dense block."""
    u, d = min(n, shape.vocab), shape.hidden
    upcast = 4 * n * d if e < 4 else 0
    rows = 4 * u * d + (u * d * e if e < 4 else 0)
    return max(upcast + rows, 4 * u * d if on_cpu and e < 4 else 0)


def stage_memory(
    shape: ModelShape,
    blocks: range,
    stage: int,
    num_stages: int,
    *,
    b: int,
    t: int,
    m: int,
    g: int,
    schedule: str,
    slots: int,
    itemsize: int,
    on_cpu: bool = False,
    resident=(),
    offload_activations: bool = False,
) -> StageMemory:
    """Peak device bytes of ``stage`` (owning ``blocks``) for micro-batches of ``b × t`` tokens.

    The parts are the engine's live tensors: the window's slots, resident blocks with their fp32
    accumulators, the saved block inputs of the micro-batches in flight and the P2P buffers alive
    at once (both counted on the step's schedule, ``pipeline.build_schedule`` in the rounds of
    ``pipeline.step_rounds``: :func:`~nodetrain.engine.pipeline.in_flight_peak`,
    :func:`~nodetrain.engine.pipeline.p2p_live_peak`), and the transient peak of one block's
    recompute + backward with the gradients queued for D2H. The peaks of the parts are added,
    though they need not coincide (a bound, not a trace).

    Gradients queued for D2H: :func:`_queued_bytes`.
    Args:
        shape: the model; blocks: this stage's block indices (from ``partition``).
        b, t, m, g: micro-batch size, sequence length, micro-batches per round, rounds per step.
        schedule: ``1f1b`` or ``gpipe``; slots: window slots; itemsize: compute-dtype bytes (e).
        on_cpu: the device is the CPU (the stage's memory is host memory).
        resident: blocks kept resident (residency.py): out of the slots' ``largest``, counted at
            ``load × (e + 4)`` bytes each; their gradients accumulate on the device, none queue. A
            streamed embedding (stage 0's block 0, not resident) is gathered by rows: never in a slot,
            its backward :func:`_rows_backward_bytes`, its offload the used rows (≤ min(n, V) × D).
        offload_activations: only :data:`OFFLOADED_IN_FLIGHT` micro-batches' saved inputs on the device.

    Raises:
        ValueError: unknown schedule.
    """
    n, e, d = b * t, itemsize, shape.hidden
    largest = max(shape.load_numels[i] for i in blocks)
    rows, streamed, offloaded = _streamed(shape, blocks, resident, n)
    in_flight, buffers = _schedule_peaks(schedule, num_stages, stage, m, g)
    on_device = min(in_flight, OFFLOADED_IN_FLIGHT) if offload_activations else in_flight
    queued = _queued_bytes(on_cpu, slots, offloaded, e)
    return StageMemory(
        stage=stage,
        blocks=blocks,
        window_bytes=slots * streamed * e,
        staging_bytes=slots * largest * e,
        saved_bytes=on_device * saved_per_micro_batch(shape, blocks, n, e),
        p2p_bytes=buffers * n * d * e,
        transient_bytes=_transient_peak(shape, blocks, n, e, on_cpu, rows) + queued,
        resident_bytes=sum(shape.load_numels[i] for i in resident) * resident_bytes_per_param(e),
        in_flight=in_flight,
        p2p_buffers=buffers,
    )


def _streamed(shape: ModelShape, blocks: range, resident, n: int) -> tuple[bool, int, int]:
    """(stage 0's embedding is gathered by rows, the largest slotted block's load, the most elements
    one offload queues) for a stage owning ``blocks`` with ``resident`` kept on the device."""
    rows = 0 in blocks and 0 not in resident  # a streamed embedding is gathered by rows, not slotted
    slotted = [i for i in blocks if i not in resident and not (rows and i == 0)]
    streamed = max((shape.load_numels[i] for i in slotted), default=0)
    return rows, streamed, max(streamed, min(n, shape.vocab) * shape.hidden if rows else 0)


def _queued_bytes(on_cpu: bool, slots: int, offloaded: int, e: int) -> int:
    """Device bytes of gradients queued for D2H at a block's backward peak.

    Gradients queued for D2H: on a GPU up to ``slots`` earlier blocks' (``Window.offload``'s bound;
    the planner takes the bound, since a D2H-bound stage reaches it); on the CPU none (measured by
    ``bench/plan_accuracy.py``: the copy worker drains each block's gradients before the next
    block's recompute peaks). A CPU copy worker starved of cores (a machine running more threads
    than it has) can still hold up to ``slots`` blocks' gradients at that peak, which the planner
    does not count. ``bench/plan_accuracy.py`` on 2 cores (2026-12-01, one run): every stage of its
    three configurations predicted 0.7-10.3% above the measured peak growth, every window exact.
    """
    return 0 if on_cpu else slots * offloaded * e


OFFLOADED_IN_FLIGHT = 2
"""Micro-batches whose saved block inputs stay on the device with ``stream.offload_activations``: the
one in its forward or backward and the one prefetched back H2D for the next backward."""


def saved_per_micro_batch(shape: ModelShape, blocks: range, n: int, e: int) -> int:
    """Bytes of the block inputs a stage saves per micro-batch of ``n`` tokens: n·D·e per block, the
    embedding its int64 ids (8·n)."""
    return sum(n * 8 if i == 0 else n * shape.hidden * e for i in blocks)


def _schedule_peaks(schedule: str, num_stages: int, stage: int, m: int, g: int) -> tuple[int, int]:
    """(micro-batches in flight, P2P buffers alive) at the peak of ``stage`` on the step's schedule."""
    from nodetrain.engine.pipeline import (  # pure; imported here: costs stays light
        build_schedule,
        in_flight_peak,
        p2p_live_peak,
        step_rounds,
    )

    rounds, per_round = step_rounds(schedule, g, m)
    actions = build_schedule(schedule, num_stages, stage, per_round)
    return in_flight_peak(actions), p2p_live_peak(actions, rounds, stage, num_stages)


def _transient_peak(shape: ModelShape, blocks: range, n: int, e: int, on_cpu: bool, rows: bool) -> int:
    """The largest recompute + backward peak of the stage's blocks (a streamed embedding's by rows)."""
    return max(
        _rows_backward_bytes(shape, n, e, on_cpu)
        if rows and i == 0
        else _block_peak_bytes(shape, i, n, e, on_cpu)
        for i in blocks
    )


# ----------------------------------------------------------------------------- traffic


def optimizer_bytes_per_param(itemsize: int) -> int:
    """Host memory traffic of one CPU AdamW update per parameter: the fused AdamW reads master,
    grad, exp_avg, exp_avg_sq (16) and writes master, exp_avg, exp_avg_sq (12); the global norm
    reads the grad (4); refreshing the transfer copy reads master (4) and writes ``itemsize``;
    zeroing the grad writes 4. (An active clip adds 8 more.)"""
    return 40 + itemsize


def speculative_backup_bytes(shape: ModelShape, speculative: bool) -> int:
    """Private host RAM of ``optim.speculative``'s backups, all ranks of a node together: master
    weights, ``exp_avg`` and ``exp_avg_sq`` of every unit updated during the backward, 12 bytes per
    parameter (StoreAdamW.backup_unit); 0 without speculation."""
    return 12 * shape.num_params if speculative else 0


@dataclass(frozen=True)
class StageTraffic:
    """What one stage moves in one optimizer step (bytes), under the engine's transfer rules."""

    loads: int
    """H2D loads of blocks (a resident block's one load counted once)."""
    h2d_bytes: int
    """Host → device: every load's bytes (the embedding's: the gathered rows only)."""
    d2h_bytes: int
    """Device → host: streamed blocks' gradients per backward (e bytes), resident ones' once (fp32)."""
    accum_bytes: int
    """Host DRAM bytes the D2H worker touches adding gradients into the fp32 accumulators (reads of
    the staged gradients, reads and writes of the accumulators; not the DMA itself)."""
    optimizer_bytes: int
    """Host DRAM bytes of the CPU AdamW over the stage's units (``optimizer_bytes_per_param``)."""
    tier_bytes: int = 0
    """NVMe bytes of the stage's tier fields per step (``store.tier=nvme``): each read and written once,
    through host DRAM."""

    @property
    def host_bytes(self) -> int:
        """Everything through host DRAM: the DMA reads (H2D) and writes (D2H), the host's passes and the
        tier's NVMe reads and writes."""
        return self.h2d_bytes + self.d2h_bytes + self.accum_bytes + self.optimizer_bytes + self.tier_bytes


def load_sequence(shape: ModelShape, blocks: range, actions, resident=frozenset()) -> list[int]:
    """The blocks one round of ``actions`` loads, in order, under the engine's rules.

    A forward visits the stage's blocks in order, a backward in reverse, except the last stage's
    head (it takes its gradients in the forward, so its backward needs no second load) and stage
    0's embedding (it gathers rows outside the load sequence; its backward scatter-adds a row
    gradient and needs no weights). Resident blocks
    are loaded once per step, not here; a block used twice in a row is loaded once (1F1B's last
    block between F(i + w) and B(i), the first between B(i) and F(i + 1 + w)).

    Args:
        shape: the model; blocks: this stage's blocks; actions: ``pipeline.build_schedule``'s list
            for one round of G·M micro-batches; resident: blocks kept on the device.
    """
    last = len(shape.unit_numels) - 1
    seq: list[int] = []
    for a in actions:
        order = (
            [i for i in blocks if i != 0]
            if a.kind == "F"
            else [i for i in reversed(blocks) if i not in (0, last)]
        )
        for i in order:
            if i not in resident and (not seq or seq[-1] != i):
                seq.append(i)
    return seq


def _embed_sparse(block: int) -> bool:
    """Stage 0's embedding moves gathered rows, not V×D (tied or not: the tied head, on the last
    stage, binds the whole matrix as its own load)."""
    return block == 0


def stage_traffic(
    shape: ModelShape,
    blocks: range,
    actions,
    *,
    n: int,
    itemsize: int,
    resident=frozenset(),
    offload_activations: bool = False,
) -> StageTraffic:
    """Bytes one stage moves per step (see :func:`load_sequence` for which loads happen).

    Gradients: a streamed block offloads ``load × e`` after each of its backwards (the last stage's
    head after each forward) and the D2H worker adds it into the fp32 accumulator: it reads the
    staged copy (e) and the accumulator (4) and writes the accumulator (4), except that the step's
    first offload overwrites it (no read). A resident block accumulates on the device and offloads
    its fp32 gradient once per step, copied into the accumulator (read 4 + write 4). Stage 0's
    embedding gathers only the n used rows (n·D·e in) and offloads an n-row gradient (n·D·e
    and the 8-byte ids out) that is scatter-added into an accumulator zeroed once per step.

    With ``offload_activations`` every micro-batch's saved block inputs
    (:func:`saved_per_micro_batch`) go D2H after its forward and come back H2D before its backward.

    Args:
        n: tokens per micro-batch (B·T); itemsize: compute-dtype bytes (e); the rest as
            :func:`load_sequence`.
    """
    e, d = itemsize, shape.hidden
    num_mb = sum(1 for a in actions if a.kind == "F")
    seq = load_sequence(shape, blocks, actions, resident)
    row_bytes = n * d * e
    h2d = sum(shape.load_numels[i] * e for i in seq)
    h2d += num_mb * row_bytes if 0 in blocks and 0 not in resident else 0  # the gathered rows
    h2d += sum(shape.load_numels[i] * e for i in resident)
    d2h = accum = 0
    for i in blocks:
        p = shape.load_numels[i]
        if i in resident:
            d2h, accum = d2h + 4 * p, accum + 8 * p
        elif _embed_sparse(i):
            d2h += num_mb * (row_bytes + 8 * n)
            accum += 4 * p + num_mb * (row_bytes + 8 * n + 8 * n * d)
        else:
            d2h += num_mb * p * e
            accum += num_mb * p * e + 4 * p + (num_mb - 1) * 8 * p
    saved = num_mb * saved_per_micro_batch(shape, blocks, n, e) if offload_activations else 0
    h2d, d2h = h2d + saved, d2h + saved
    owned = sum(shape.unit_numels[i] for i in blocks)
    opt = owned * optimizer_bytes_per_param(e)
    return StageTraffic(len(seq) + len(resident), h2d, d2h, accum, opt)
