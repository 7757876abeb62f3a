"""Memory: the bytes a model costs on the engine's host store and on each stage's device.

Owns: host store bytes per field, each stage's peak device bytes (window, resident blocks, saved
activations, P2P buffers, one block's recompute + backward), the margins the device keeps free
beyond them, and the head's chunk size. Does not own the bytes a step moves (``traffic.py``), the
seconds (``step_time.py``, ``compute.py``), which blocks stay on the device (``core/placement.py``)
or anything that needs torch.distributed. Byte counts of the store come from the engine's own
``StoreLayout``, so the model cannot drift from what a run allocates.

Shapes: B = micro-batch size, T = sequence length, n = B·T tokens, D = hidden size, F = MLP width,
V = vocab, H / K = query / key-value heads, Q = head dim, e = compute-dtype bytes, S = stages,
M = micro-batches per round, G = rounds per step (grad_accum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nodetrain.cost.shape import ModelShape
from nodetrain.cost.work import StageWork
from nodetrain.store import StoreLayout

__all__ = [
    "store_layout",
    "field_bytes",
    "pin_overhead_bytes",
    "StageMemory",
    "stage_memory",
    "GRAD_ACC_ITEMSIZE",
    "OPTIMIZER_ON_DEVICE_ITEMSIZE",
    "device_optimizer_bytes_per_param",
    "on_device_bytes_per_param",
    "resident_bytes_per_param",
    "layer_saved_per_token",
    "saved_per_micro_batch",
    "wave_summed_numel",
    "kept_activation_bytes",
    "CHUNK_LOGITS_BYTES",
    "chunk_tokens",
    "OFFLOADED_IN_FLIGHT",
    "MARGIN_BYTES",
    "NCCL_MARGIN_BYTES",
    "CUBLAS_MARGIN_BYTES",
    "ALLOCATOR_MARGIN_BYTES",
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
"""Bytes per parameter of a fp32 gradient accumulator on the device (a resident block's, or a streamed
one's with ``stream.grad_on_device``)."""


def resident_bytes_per_param(itemsize: int) -> int:
    """Device bytes per parameter of a resident block: its weights in the compute dtype plus its fp32
    gradient accumulator (``Window``'s resident buffers; DESIGN invariant 8)."""
    return itemsize + GRAD_ACC_ITEMSIZE


OPTIMIZER_ON_DEVICE_ITEMSIZE = 16
"""Bytes per parameter of a unit's optimizer kept on the device (``optim.on_device``): fp32 master
weights, ``exp_avg``, ``exp_avg_sq`` and the fp32 gradient (which is the accumulator itself)."""


def on_device_bytes_per_param(itemsize: int) -> int:
    """Device bytes per parameter of a resident block with its optimizer on the device: its weights in
    the compute dtype plus :data:`OPTIMIZER_ON_DEVICE_ITEMSIZE` (engine/device/device_adamw.py)."""
    return itemsize + OPTIMIZER_ON_DEVICE_ITEMSIZE


def device_optimizer_bytes_per_param(itemsize: int) -> int:
    """Device memory traffic of one fused AdamW update per parameter on the device: it reads master,
    gradient, ``exp_avg``, ``exp_avg_sq`` (4·4) and writes master and both moments (3·4), and the
    weights are rewritten from the master (``itemsize``); the norm² read of the gradient is left out
    (it is fused into the device's reduction kernels and small beside these)."""
    return 4 * 4 + 3 * 4 + itemsize


NCCL_MARGIN_BYTES = 1 << 30
"""NCCL's device buffers, not yet allocated when the budget reads the free memory (a communicator
connects a peer at its first P2P or collective). Per connection and channel NCCL keeps one buffer
per protocol: Simple ``NCCL_BUFFSIZE`` (default 4 MiB, NCCL's environment-variable docs), LL128
120 × 640 threads × 8 steps × 8 B = 4.7 MiB and LL 8 × 512 × 8 × 16 B = 0.5 MiB (NVIDIA/nccl
``src/init.cc``, ``src/include/device.h``); the channels grow with the link's bandwidth
(NVIDIA/nccl#986). Measured: 544-688 MB per communicator on 4 × A100 with NVLink (NVIDIA/nccl#964).
The engine's default group carries the P2P and the all-reduce: 1 GiB, an assumption for one
communicator (NVLink SHARP, ``NCCL_NVLS_ENABLE``, takes more: NVIDIA/nccl#864)."""
CUBLAS_MARGIN_BYTES = 128 << 20
"""cuBLAS and cuBLASLt workspaces: 32 MiB each per (handle, stream) on Hopper and newer, 4 MiB
before (cuBLAS docs, ``cublasSetWorkspace``; PyTorch's defaults since pytorch/pytorch#120925),
for the compute stream and one more."""
ALLOCATOR_MARGIN_BYTES = (2 << 30) - NCCL_MARGIN_BYTES - CUBLAS_MARGIN_BYTES
"""PyTorch's caching allocator: sizes rounded up (512 B; above 10 MiB to 2 MiB multiples; 1-10 MiB
requests carved from 20 MiB segments: ``c10/cuda/CUDACachingAllocator.cpp``) and fragmentation
between activations of varied sizes; an assumption (0.875 GiB) that keeps the margin at 2 GiB."""
MARGIN_BYTES = NCCL_MARGIN_BYTES + CUBLAS_MARGIN_BYTES + ALLOCATOR_MARGIN_BYTES
"""Device bytes the automatic budget leaves free beyond what :func:`stage_memory` counts."""


@dataclass(frozen=True)
class StageMemory:
    """Device bytes one stage holds at its peak (on a CPU profile: host bytes of that rank)."""

    stage: int
    blocks: range
    window_bytes: int
    """``slots × largest slotted block load × e``: the streamed blocks but a streamed embedding,
    which travels as gathered rows, plus the wave-sum buffers (:attr:`wave_bytes`) (``Window.nbytes``
    less its resident buffers and device accumulators)."""
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
    """Most micro-batches whose inputs the stage keeps at once (``core.schedule.in_flight_peak`` of the
    step's schedule: 1F1B min(S − s, G·M) in its one round, GPipe M)."""
    p2p_buffers: int = 0
    """Most [B, T, D] P2P buffers alive at once (``core.schedule.p2p_live_peak``; ``P2P.peak_buffers``)."""
    kept_bytes: int = 0
    """Activations of the layers not recomputed (``work.kept``), ``in_flight`` × their
    :func:`kept_activation_bytes` per micro-batch."""
    grad_acc_bytes: int = 0
    """fp32 gradient accumulators of the streamed blocks that keep one on the device (``work.grad_acc``,
    ``stream.grad_on_device``), ``4 × load`` each (``Window.grad_acc_nbytes``)."""
    wave_bytes: int = 0
    """With waves (``work.wave`` > 1): the fp32 wave-sum buffers a streamed block's gradients add into
    over a wave, one per slot, ``slots × 4 × largest wave-summed load`` (``DeviceSums.wave_nbytes``); part of
    :attr:`window_bytes` (so the automatic budget leaves them out), 0 without waves."""

    @property
    def activation_bytes(self) -> int:
        return self.saved_bytes + self.p2p_bytes + self.transient_bytes + self.kept_bytes

    @property
    def total_bytes(self) -> int:
        return self.window_bytes + self.resident_bytes + self.grad_acc_bytes + self.activation_bytes


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


def kept_activation_bytes(shape: ModelShape, block: int, n: int, e: int) -> int:
    """Device bytes one decoder layer's autograd graph keeps for a micro-batch of ``n`` tokens from
    its forward to its backward when it is not recomputed (``stream.recompute``, core/recompute.py).

    Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models" (arXiv:2205.05198, §4.1) count 34·s·b·h + 5·a·s²·b bytes per GPT layer at 16-bit (a 4h
    MLP, dropout masks, the s² attention scores and their softmax). Our layers differ in exactly
    those terms, so we use the same census read off our own layer (:func:`layer_saved_per_token`):
    SDPA (flash / memory-efficient) keeps no s × s scores, only an fp32 log-sum-exp (4·H per
    token), there is no dropout mask, the MLP is SwiGLU (4·F·e) and GQA keeps K < H key/value heads.
    That count less the output and incoming gradient (2·D·e: the output is the next block's saved
    input, ``saved_per_micro_batch``, and the gradient lives only during the backward); the layer's
    input is saved either way. Llama-3.2-3B at bf16: 137 kB per token (Korthikanti's 34·h: 104 kB).
    Checked against the storages a kept Llama and Qwen3 layer's graph holds on CPU, fp32 and bf16
    (tests/parity/test_recompute.py): 2-4% above them.

    Args:
        shape: the model; block: a decoder layer's index (1..L); n: tokens (B·T); e: compute-dtype bytes.
    """
    return n * (layer_saved_per_token(shape, e, block) - 2 * shape.hidden * e)


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


CHUNK_LOGITS_BYTES = 512 << 20
"""fp32 logits of one chunk (512 MiB: 1046 tokens at a 128k vocabulary, 4194 at 32k).

Why this size: the chunk's logits, their softmax and gradient (about 3 × this) are all the memory
the head adds, whatever the micro-batch's token count (full logits of 4 × 4096 tokens at 128k are
8.4 GB, 25 GB with their softmax and gradient). Smaller chunks cost time: each chunk adds its
weight gradient (V × D) into the fp32 sum, 8 bytes of traffic per element against the chunk's
6 × c FLOPs per element (logits, input and weight gradients), i.e. ≈ 440 / c of the head's matmul
time on a GPU doing ~1000 TFLOP/s over ~3 TB/s: 42% of the head at c = 1046, and the head is
~6% of Llama-3-8B's FLOPs, so ~2.5% of the step. Liger-Kernel's rule (``cdiv(V, D)`` chunks)
bounds the memory too, but at a small hidden size it makes thousands of one-token chunks whose
additions dominate (measured on CPU: 19× slower than full logits at V = 128k, D = 64)."""


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: as many as fit :data:`CHUNK_LOGITS_BYTES` of fp32 logits, at least 1.

    Args:
        vocab: V, the head's output rows.
    """
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab))


def _head_peak_bytes(shape: ModelShape, n: int, e: int, load: int) -> int:
    """Peak of the head's loss and gradients, taken chunk by chunk over tokens in its forward
    (``engine/linear_ce.py``) for ``n`` tokens and a head binding ``load`` elements (P).

    Throughout: the fp32 sums of its weight gradients (4·P) and its input's gradient (n·D·e). Per
    chunk of c = min(n, ``linear_ce.chunk_tokens(V)``) tokens: the final norm's c·D·(4 + 2e) and
    the larger of the log-softmax's backward (its fp32 output, the gradient flowing into it and the
    one it makes, 3 × 4·c·V) and the lm_head's (the logits' gradient in the compute dtype c·V·e,
    with its fp32 source when e < 4, and the chunk's weight gradient P·e, added to the sums next).
    """
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
    work: StageWork,
    *,
    b: int,
    t: int,
    slots: int,
    itemsize: int,
    on_cpu: bool = False,
    offload_activations: bool = False,
) -> StageMemory:
    """Peak device bytes of one stage (``work``: its step) for micro-batches of ``b × t`` tokens.

    The parts are the engine's live tensors: the window's slots, resident blocks with their fp32
    accumulators, the saved block inputs of the micro-batches in flight and the P2P buffers alive
    at once (both counted on the step's schedule: ``work.in_flight``, ``work.p2p_buffers``), and the
    transient peak of one block's recompute + backward with the gradients queued for D2H, and the
    activations of the layers not recomputed (``work.kept``) for every micro-batch in flight. The peaks
    of the parts are added, though they need not coincide (a bound, not a trace).

    Gradients queued for D2H: :func:`_queued_bytes`.
    Args:
        shape: the model; work: the stage's step (``StepPlan.work``: blocks, resident blocks, peaks).
        b, t: micro-batch size and sequence length.
        slots: window slots; itemsize: compute-dtype bytes (e).
        on_cpu: the device is the CPU (the stage's memory is host memory).
        offload_activations: only :data:`OFFLOADED_IN_FLIGHT` micro-batches' saved inputs on the device.

    Resident blocks (``work.resident``) are out of the slots' ``largest``, counted at ``load × (e + 4)``
    bytes each (``load × (e + 16)`` with their optimizer on the device, ``work.on_device``); their
    gradients accumulate on the device, none queue. A streamed block with a device accumulator
    (``work.grad_acc``) adds ``load × 4`` bytes (``grad_acc_bytes``). A streamed embedding
    (``work.rows``) is gathered by rows: never in a slot, its backward :func:`_rows_backward_bytes`,
    its offload the used rows (≤ min(n, V) × D). With waves (``work.wave`` = W > 1) the saved inputs,
    kept activations and P2P buffers are counted per micro-batch (``work.in_flight``, ``work.p2p_buffers``
    are W × the items'), and the window adds one fp32 wave-sum buffer per slot (``wave_bytes``).
    """
    n, e, d, blocks = b * t, itemsize, shape.hidden, work.blocks
    largest = max(shape.load_numels[i] for i in blocks)
    streamed, offloaded = _streamed(shape, work, n)
    in_flight, buffers = work.in_flight, work.p2p_buffers
    on_device = min(in_flight, OFFLOADED_IN_FLIGHT) if offload_activations else in_flight
    queued = _queued_bytes(on_cpu, slots, offloaded, e)
    kept = sum(kept_activation_bytes(shape, i, n, e) for i in work.kept)
    wave = slots * GRAD_ACC_ITEMSIZE * wave_summed_numel(shape, work)
    return StageMemory(
        stage=work.stage,
        blocks=blocks,
        window_bytes=slots * streamed * e + wave,
        staging_bytes=slots * largest * e,
        saved_bytes=on_device * saved_per_micro_batch(shape, blocks, n, e),
        p2p_bytes=buffers * n * d * e,
        transient_bytes=_transient_peak(shape, blocks, n, e, on_cpu, work.rows) + queued,
        resident_bytes=_resident_bytes(shape, work, e),
        in_flight=in_flight,
        p2p_buffers=buffers,
        kept_bytes=in_flight * kept,
        grad_acc_bytes=sum(shape.load_numels[i] for i in work.grad_acc) * GRAD_ACC_ITEMSIZE,
        wave_bytes=wave,
    )


def _resident_bytes(shape: ModelShape, work: StageWork, e: int) -> int:
    """Device bytes of a stage's resident blocks, those with their optimizer on the device included."""
    return sum(
        shape.load_numels[i]
        * (on_device_bytes_per_param(e) if i in work.on_device else resident_bytes_per_param(e))
        for i in work.resident
    )


def _streamed(shape: ModelShape, work: StageWork, n: int) -> tuple[int, int]:
    """(the largest slotted block's load, the most elements one offload queues) of a stage's step."""
    rows = work.rows  # a streamed embedding is gathered by rows, not slotted
    slotted = [i for i in work.blocks if i not in work.resident and not (rows and i == 0)]
    streamed = max((shape.load_numels[i] for i in slotted), default=0)
    return streamed, max(streamed, min(n, shape.vocab) * shape.hidden if rows else 0)


def wave_summed_numel(shape: ModelShape, work: StageWork) -> int:
    """Elements of one wave-sum buffer (the largest streamed block whose gradient is summed over a wave
    on the device: not resident, not a row block, no device accumulator); 0 without waves (W = 1)."""
    if work.wave <= 1:
        return 0
    skip = set(work.resident) | set(work.grad_acc) | ({0} if work.rows else set())
    return max((shape.load_numels[i] for i in work.blocks if i not in skip), default=0)


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


def _transient_peak(shape: ModelShape, blocks: range, n: int, e: int, on_cpu: bool, rows: bool) -> int:
    """The largest recompute + backward peak of the stage's blocks (a streamed embedding's by rows)."""
    return max(
        _rows_backward_bytes(shape, n, e, on_cpu)
        if rows and i == 0
        else _block_peak_bytes(shape, i, n, e, on_cpu)
        for i in blocks
    )
