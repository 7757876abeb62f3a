"""Chunked linear cross-entropy (linear_ce.py) against full logits + autograd, with a 128k-row head.

The reference is written here with plain PyTorch and transformers' own ``LlamaRMSNorm``: full fp32
logits [N, V], ``F.cross_entropy`` summed, scaled, ``backward()``. The chunked loss must match it
and give the same gradients of the head's input, norm weight and lm_head weight (fp32, 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from nodetrain.cost.memory import chunk_tokens
from nodetrain.engine.linear_ce import IGNORE_INDEX, linear_cross_entropy
from nodetrain.model import HFModel

VOCAB, HIDDEN, B, T = 128_256, 32, 2, 24  # Llama-3's vocabulary


@pytest.fixture(scope="module")
def head_case():
    hf = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        rms_norm_eps=1e-6,
    )
    hf.architectures = ["LlamaForCausalLM"]
    model = HFModel(hf)
    gen = torch.Generator().manual_seed(0)
    params = {
        "norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "lm_head.weight": 0.05 * torch.randn(VOCAB, HIDDEN, generator=gen),
    }
    h = torch.randn(B, T, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (B, T), generator=gen)
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    labels[1, -3:] = IGNORE_INDEX  # padding
    head_block = len(model.units) - 1
    head = lambda p, x: model.forward_block(head_block, p, x, None)  # noqa: E731
    return hf, head, params, h, labels


def _reference(hf, params, h, labels, scale):
    """Full logits [N, V] in fp32, summed CE, autograd."""
    norm = LlamaRMSNorm(HIDDEN, eps=hf.rms_norm_eps)
    norm.weight.data.copy_(params["norm.weight"])
    w = params["lm_head.weight"].clone().requires_grad_(True)
    x = h.clone().requires_grad_(True)
    logits = norm(x) @ w.T  # [B, T, V]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), {"norm.weight": norm.weight.grad, "lm_head.weight": w.grad}, x.grad


@pytest.mark.parametrize("chunk", [None, 1, 7, B * T], ids=["rule", "one-token", "uneven-7", "all-tokens"])
def test_chunked_head_matches_full_logits_and_autograd(head_case, chunk) -> None:
    hf, head, params, h, labels = head_case
    scale = 1.0 / int((labels != IGNORE_INDEX).sum())
    want_loss, want_grads, want_h = _reference(hf, params, h, labels, scale)
    loss, grads, grad_h = linear_cross_entropy(head, params, h, labels, loss_scale=scale, chunk=chunk)
    tol = dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad_h, want_h, **tol)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, **tol, msg=name)
    assert grads["lm_head.weight"].abs().sum() > 0 and grad_h[0, :5].abs().sum() == 0  # masked: no grad


def test_forward_only_returns_the_loss(head_case) -> None:
    hf, head, params, h, labels = head_case
    want_loss, _, _ = _reference(hf, params, h, labels, 1.0)
    loss, grads, grad_h = linear_cross_entropy(head, params, h, labels, grads=False)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    assert grads is None and grad_h is None


def test_chunk_rule_bounds_the_chunk_logits() -> None:
    assert chunk_tokens(128_256) == 1046  # 1046 × 128,256 × 4 bytes ≤ 512 MiB
    assert chunk_tokens(32_000) == 4194
    assert chunk_tokens(1 << 40) == 1
