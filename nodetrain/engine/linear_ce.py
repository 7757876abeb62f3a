"""Chunked linear cross-entropy: the head's loss and gradients without full logits.

Owns: the last stage's head (final norm + lm_head) applied chunk by chunk over tokens, its fp32
token cross-entropy sum, and, when training, the gradients of that loss (scaled by ``loss_scale``)
with respect to the head's weights and its input, all in the same pass. Does not own: which
weights (stage.py binds them) nor where the gradients go (window.py offloads them).

Why: full logits are ``N × V`` (4096 tokens × 128k vocab = 2 GB in fp32, and as much again for
their gradient). Per chunk of ``c`` tokens only ``c × V`` logits live at a time; the loss is
terminal and its scale (1 / valid tokens of the step) is known at forward time, so the backward of
the head runs right after its forward and the head is never recomputed. This is the chunked /
fused linear cross-entropy of Liger-Kernel (``LigerFusedLinearCrossEntropyLoss``,
arXiv:2410.10989) and Apple's Cut Cross-Entropy (arXiv:2411.09009), in plain PyTorch.

Shapes: N = B × T tokens, D = hidden, V = vocab, c = tokens per chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nodetrain.cost.memory import chunk_tokens

__all__ = ["IGNORE_INDEX", "linear_cross_entropy"]

IGNORE_INDEX = -100


HeadFn = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


def linear_cross_entropy(
    head: HeadFn,
    params: dict[str, torch.Tensor],
    h: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_scale: float = 1.0,
    grads: bool = True,
    chunk: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """Σ token cross-entropy of ``head(params, h)`` against ``labels``, chunk by chunk over tokens.

    Args:
        head: ``head(params, x [c, D]) -> logits [c, V]`` (the head block, weights bound per call).
        params: local name -> weight (compute dtype, on the compute device).
        h: [B, T, D] head input, compute dtype.
        labels: [B, T] int64 next-token ids, -100 (``IGNORE_INDEX``) = no loss.
        loss_scale: the gradients are those of ``loss_scale × Σ CE`` (1 / valid tokens of the step).
        grads: also return the gradients (training); False: the loss only, no autograd.
        chunk: tokens per chunk; default :func:`chunk_tokens` of the vocabulary.

    Memory (on h's device): one chunk's logits, softmax and gradient (≈ 3 × c × V × 4 bytes),
    the fp32 sums of the weight gradients (4 bytes per head parameter) and ``grad_h``.

    Returns:
        (loss, param_grads, grad_h): the unscaled fp32 sum of token cross-entropies (scalar, on
        h's device); with ``grads``, local name -> gradient (params' dtype and shape, summed over
        chunks in fp32) and ``grad_h`` [B, T, D] in h's dtype, else (loss, None, None).
    """
    x, y = h.flatten(0, -2), labels.flatten()  # [N, D], [N]
    weight = next(p for p in params.values() if p.dim() == 2)
    c = chunk or chunk_tokens(weight.shape[0])
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    if not grads:
        with torch.no_grad():
            for s in range(0, x.shape[0], c):
                loss += _ce_sum(head(params, x[s : s + c]), y[s : s + c])
        return loss, None, None
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    sums = {k: torch.zeros(v.shape, dtype=torch.float32, device=v.device) for k, v in params.items()}
    grad_x = torch.empty_like(x)
    for s in range(0, x.shape[0], c):
        x_c = x[s : s + c].detach().requires_grad_(True)  # [c, D]
        with torch.enable_grad():  # the caller may run under no_grad (a pipeline forward)
            loss_c = _ce_sum(head(leaves, x_c), y[s : s + c])
            *g_params, grad_x[s : s + c] = torch.autograd.grad(loss_c * loss_scale, [*leaves.values(), x_c])
        for acc, g in zip(sums.values(), g_params, strict=True):
            acc.add_(g)  # fp32: the chunks' partial sums do not lose bits to the compute dtype
        loss += loss_c.detach()
    out = {k: acc.to(params[k].dtype) for k, acc in sums.items()}
    return loss, out, grad_x.view_as(h)


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 Σ cross-entropy of logits [c, V] (any float dtype) against labels [c]."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
