"""Peak memory of the last stage's head: full logits + autograd vs chunked linear cross-entropy.

    python bench/chunked_ce.py                           # vocab 128,256 × 4096 tokens, hidden 256, fp32
    python bench/chunked_ce.py --hidden 1024 --tokens 2048

Both modes compute the loss and the gradients of the head's input, final-norm weight and lm_head
weight of ``loss_scale × Σ token CE`` (what the last stage needs from its head per micro-batch):
``full`` builds logits [N, V] and differentiates them with autograd (what nodetrain did before
issue 14, twice per micro-batch: once in the forward, once in the backward's recompute);
``chunked`` is ``linear_ce.linear_cross_entropy`` at its default chunk (``chunk_tokens``). Each
mode runs in a fresh process; the figure is the peak resident set size (``ru_maxrss``) above the
process's RSS once the inputs and weights exist, i.e. the bytes the head's computation adds on top
of its inputs. The hidden size is smaller than a real model's (4096) to keep the CPU run short; the
logits' share (N × V) — the point of the comparison — does not depend on it, the weight gradient
(V × D × 4 bytes, in both modes) does. Also printed: wall seconds and the largest gradient
difference between the modes (fp32).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodetrain.cost.memory import chunk_tokens
from nodetrain.engine.linear_ce import IGNORE_INDEX, linear_cross_entropy
from nodetrain.model import HFModel


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _head(vocab: int, hidden: int):
    from transformers import AutoConfig

    hf = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=2 * hidden,
    )
    hf.architectures = ["LlamaForCausalLM"]
    model = HFModel(hf)
    block = len(model.units) - 1
    return lambda p, x: model.forward_block(block, p, x, None)


def worker(mode: str, vocab: int, hidden: int, tokens: int) -> dict:
    """One mode in this process; returns its figures (and the gradients' checksum inputs)."""
    torch.manual_seed(0)
    head = _head(vocab, hidden)
    params = {"norm.weight": torch.ones(hidden), "lm_head.weight": 0.02 * torch.randn(vocab, hidden)}
    h = torch.randn(1, tokens, hidden)
    labels = torch.randint(0, vocab, (1, tokens))
    labels[0, : tokens // 10] = IGNORE_INDEX
    scale = 1.0 / int((labels != IGNORE_INDEX).sum())
    base = _rss_bytes()
    t0 = time.perf_counter()
    if mode == "full":
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        x = h.clone().requires_grad_(True)
        loss = F.cross_entropy(
            head(leaves, x).float().flatten(0, 1),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        *_, grad_w, grad_h = torch.autograd.grad(loss * scale, [*leaves.values(), x])
    else:
        loss, grads, grad_h = linear_cross_entropy(head, params, h, labels, loss_scale=scale)
        grad_w = grads["lm_head.weight"]
    wall_s = time.perf_counter() - t0
    return {
        "mode": mode,
        "peak_extra_bytes": _rss_bytes() - base,
        "wall_s": wall_s,
        "loss": float(loss),
        "grad_h_sum": float(grad_h.double().abs().sum()),
        "grad_w_sum": float(grad_w.double().abs().sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--worker", choices=["full", "chunked"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.vocab, a.hidden, a.tokens)))
        return
    shape = ["--vocab", str(a.vocab), "--hidden", str(a.hidden), "--tokens", str(a.tokens)]
    rows = []
    for mode in ("chunked", "full"):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", mode, *shape], capture_output=True, text=True
        )
        if out.returncode != 0:
            sys.exit(f"{mode} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    c = chunk_tokens(a.vocab)
    logits_gb = a.tokens * a.vocab * 4 / 1e9
    print(
        f"head: vocab {a.vocab:,} × {a.tokens} tokens, hidden {a.hidden}, fp32 on CPU; "
        f"fp32 logits {logits_gb:.2f} GB"
    )
    print(f"chunked: {c} tokens per chunk ({-(-a.tokens // c)} chunks)")
    print(f"{'mode':8} {'peak above inputs':>18} {'wall':>8} {'loss':>12}")
    for r in rows:
        print(f"{r['mode']:8} {r['peak_extra_bytes'] / 1e9:15.3f} GB {r['wall_s']:7.2f}s {r['loss']:12.4f}")
    full, chunked = rows[1], rows[0]
    print(f"peak ratio full / chunked: {full['peak_extra_bytes'] / max(chunked['peak_extra_bytes'], 1):.1f}×")
    for key in ("loss", "grad_h_sum", "grad_w_sum"):
        rel = abs(full[key] - chunked[key]) / max(abs(full[key]), 1e-30)
        print(f"{key}: relative difference {rel:.1e}")


if __name__ == "__main__":
    main()
