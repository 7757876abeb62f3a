"""Compute work: what a block's forward and backward cost a device, as pure arithmetic.

Owns: a block's work per micro-batch (matmul and attention FLOPs, the bytes its elementwise kernels
move, its share of a decoder layer's fixed overhead), the rates a device does each kind at
(``ComputeRates``), and the model FLOPs used for MFU. Does not own: the step those seconds add up
to (``step_time.py``: the pipeline, the host side, the optimizer), the activation bytes a layer keeps
(``memory.py``), or measuring the rates (``bench/cpu_profile.py``).

Shapes as in ``memory.py``: n = B·T tokens per micro-batch, T = sequence length, e = compute-dtype
bytes, D / F / V = hidden, MLP and vocab sizes, H / Q = query heads and head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodetrain.cost.memory import layer_saved_per_token
from nodetrain.cost.shape import ModelShape

__all__ = [
    "model_flops",
    "ComputeRates",
    "block_elementwise_bytes",
    "block_work",
    "block_seconds",
    "stage_compute",
]


def model_flops(shape: ModelShape, tokens: int, t: int) -> float:
    """Useful training FLOPs for ``tokens`` tokens of sequences of length ``t``.

    ``6·N·tokens + 12·L·H·Q·t·tokens`` (PaLM, arXiv:2204.02311, appendix B), N = the parameters
    multiplied per token (every matmul weight incl. the head; the embedding lookup is free).
    Recompute is not useful work and is not counted here.
    """
    n_matmul = sum(shape.costs)
    attention = 12 * shape.num_layers * shape.heads * shape.head_dim * t
    return float(6 * n_matmul + attention) * tokens


@dataclass(frozen=True)
class ComputeRates:
    """What one stage's device reaches on each kind of work in a block, per second."""

    matmul_flops_per_s: float
    """Achieved matmul FLOP/s in the compute dtype (the profile's peak × ``matmul_efficiency``)."""
    attention_flops_per_s: float = 0.0
    """Attention's nominal FLOP/s (4·n·T·H·Q per forward; causal SDPA skips about half): 0 = at
    ``matmul_flops_per_s``."""
    elementwise_bytes_per_s: float = 0.0
    """Bytes/s of the elementwise kernels (:func:`block_elementwise_bytes`); 0 = not priced."""
    layer_overhead_s: float = 0.0
    """Fixed seconds of one decoder layer's three passes for a micro-batch (forward, recompute,
    backward) that do not shrink with its size: Python, autograd, kernel dispatch."""

    def seconds(self, matmul_flops: float, attention_flops: float, elementwise_bytes: float, layers: float):
        """(matmul, attention, elementwise, overhead) seconds of that much work; ``layers``: the
        decoder-layer passes' share of :attr:`layer_overhead_s`."""
        attention = self.attention_flops_per_s or self.matmul_flops_per_s
        rate = self.elementwise_bytes_per_s
        return (
            matmul_flops / self.matmul_flops_per_s,
            attention_flops / attention,
            elementwise_bytes / rate if rate > 0 else 0.0,
            layers * self.layer_overhead_s,
        )


def block_elementwise_bytes(shape: ModelShape, block: int, n: int, itemsize: int) -> tuple[int, int]:
    """(forward, backward) bytes that ``block``'s elementwise kernels move for a micro-batch of ``n``
    tokens: the work between its matmuls and attention (RMSNorms, RoPE, SiLU and the SwiGLU product,
    residual adds, the head's softmax and casts), bound by memory bandwidth on any device.

    A decoder layer: each tensor its forward makes (``costs.layer_saved_per_token``, A bytes per
    token) is written once and read once, 2·A·n per forward; its backward (``stage.py``) recomputes
    the forward (2·A·n), then writes and reads each tensor's gradient and reads the tensor and one
    more operand (4·A·n): (2·A·n, 6·A·n). The head (``linear_ce.py``, gradients taken in its forward,
    none in the backward), per logit: ``log_softmax`` reads its fp32 input three times and writes
    once (16 bytes), ``nll_loss``'s backward writes a zero-filled fp32 gradient (4), the softmax's
    backward reads the gradient twice and its output once and writes (16); with e < 4 the upcast
    reads e and writes 4, its backward reads 4 and writes e: n·V·(36 + 8 + 2e); and per micro-batch,
    over the head's P parameters, the fp32 sums of its weight gradients zeroed (4), the chunk's
    gradient added (read 4 + 4, write 4; with e < 4 torch first widens it into a temporary: read e,
    write 4) and the sums narrowed to the compute dtype (read 4, write e; a no-op in fp32):
    P·(24 + 2e), P·16 in fp32 (one chunk: ``linear_ce.chunk_tokens`` ≥ n). The embedding's row
    gather and scatter-add (n·D each way) are not counted.
    """
    e, last = itemsize, len(shape.unit_numels) - 1
    if block == last:
        logits = n * shape.vocab * (36 + (8 + 2 * e if e < 4 else 0))
        return logits + shape.load_numels[block] * (24 + 2 * e if e < 4 else 16), 0
    if block == 0:
        return 0, 0
    per_pass = 2 * n * layer_saved_per_token(shape, e, block)
    return per_pass, 3 * per_pass


def block_work(shape: ModelShape, block: int, n: int, t: int, e: int, kept: bool = False):
    """(forward, backward) work of one block for one micro-batch, each as (matmul FLOPs, attention
    FLOPs, elementwise bytes, share of a layer's fixed overhead): a layer 2·cost·n matmul and
    4·n·T·H·Q attention FLOPs forward and 3 × those backward (recompute, then the backward's two
    matmuls per forward one), its overhead split the same 1 : 3; a ``kept`` layer (its activations
    kept from the forward, ``core/recompute.py``) 2 × those backward, no recompute: its elementwise
    bytes 4·A·n and overhead 0.5; the head 6·cost·n in its forward (it takes its gradients there)
    and none in the backward; the embedding none (a gather and a scatter-add). Elementwise bytes:
    :func:`block_elementwise_bytes`."""
    last = len(shape.unit_numels) - 1
    fwd_bytes, bwd_bytes = block_elementwise_bytes(shape, block, n, e)
    if block == last:
        return (6.0 * shape.costs[block] * n, 0.0, fwd_bytes, 0.0), (0.0, 0.0, bwd_bytes, 0.0)
    if block == 0:
        return (0.0, 0.0, fwd_bytes, 0.0), (0.0, 0.0, bwd_bytes, 0.0)
    matmul, attention = 2.0 * shape.costs[block] * n, 4.0 * n * t * shape.heads * shape.head_dim
    if kept:  # the backward without the recompute: its forward pass's work drops out
        return (matmul, attention, fwd_bytes, 0.25), (2 * matmul, 2 * attention, bwd_bytes - fwd_bytes, 0.5)
    return (matmul, attention, fwd_bytes, 0.25), (3 * matmul, 3 * attention, bwd_bytes, 0.75)


def block_seconds(
    shape, block: int, n: int, t: int, e: int, compute: ComputeRates, kept: bool = False
) -> tuple[float, float]:
    """(forward, backward) seconds of one block for one micro-batch on ``compute`` (``kept``: not
    recomputed, :func:`block_work`)."""
    fwd, bwd = block_work(shape, block, n, t, e, kept)
    return sum(compute.seconds(*fwd)), sum(compute.seconds(*bwd))


def stage_compute(shape, blocks, n: int, t: int, e: int, compute: ComputeRates, kept=()) -> tuple[float, ...]:
    """(matmul, attention, elementwise, overhead) seconds of one micro-batch's forward and backward
    on a stage (``kept``: the blocks not recomputed, :func:`block_work`)."""
    parts = [compute.seconds(*w) for i in blocks for w in block_work(shape, i, n, t, e, i in kept)]
    return tuple(sum(p[j] for p in parts) for j in range(4))
