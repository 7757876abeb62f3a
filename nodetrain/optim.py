"""CPU optimizer on the host store's flat per-unit buffers.

Owns: AdamW (``torch.optim.AdamW(fused=True)``, arXiv:1711.05101) over views of the store, with
its ``exp_avg`` / ``exp_avg_sq`` living in the store (one copy per node); the learning-rate
schedule; the global-norm gradient clip; and refreshing the compute-dtype transfer copy. Does
not own: computing gradients or reducing them across ranks (engine.py does the one all-reduce).

Each unit's flat buffer is laid out decay-first, so a unit is two parameter tensors: its
matrices (weight decay applies) and its norms/biases (no decay).
"""

from __future__ import annotations

import math

import torch

from nodetrain.config import OptimConfig
from nodetrain.model import Unit
from nodetrain.store import HostStore

__all__ = ["lr_at", "clip_coef", "StoreAdamW"]


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer update ``step`` (0-based): linear warmup, then cosine decay.

    ``lr · (step + 1) / warmup_steps`` during warmup, then
    ``min_lr + ½ (lr − min_lr)(1 + cos(π · progress))`` with progress running from 0 at the end
    of warmup to 1 at ``total_steps`` (SGDR, arXiv:1608.03983, without restarts).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    progress = min(progress, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def clip_coef(total_norm: float, max_norm: float) -> float:
    """Gradient scale for global-norm clipping, as ``torch.nn.utils.clip_grad_norm_``:
    ``min(1, max_norm / (total_norm + 1e-6))``; 1 when ``max_norm`` is 0 (no clipping)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class StoreAdamW:
    """AdamW over the units this stage owns, state kept in the host store.

    Args:
        store: the host store.
        units: the owned units.
        cfg: optimizer settings.
        threads: CPU threads for the update (``torch.set_num_threads`` is the caller's).
    """

    def __init__(self, store: HostStore, units: list[Unit], cfg: OptimConfig):
        self.store, self.units, self.cfg = store, units, cfg
        decay, no_decay = [], []
        self._params: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._names: list[list[str]] = []  # HF names of the tensors in each optimizer parameter
        for u in units:
            for lo, hi, group in ((0, u.num_decay, decay), (u.num_decay, u.numel, no_decay)):
                if hi > lo:
                    self._names.append([q.hf_name for q in u.params if lo <= q.offset < hi])
                    p = store.master(u.index)[lo:hi]
                    group.append(p)
                    p.grad = store.grad(u.index)[lo:hi]
                    self._params.append(
                        (
                            p,
                            store.buffer(u.index, "exp_avg")[lo:hi],
                            store.buffer(u.index, "exp_avg_sq")[lo:hi],
                            p.grad,
                        )
                    )
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
        for p, exp_avg, exp_avg_sq, _ in self._params:  # state lives in the store, not in private tensors
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def steps_by_name(self) -> dict[str, float]:
        """AdamW's update count of every owned HF tensor (all tensors of a parameter share it)."""
        return {
            name: float(self.opt.state[p]["step"])
            for (p, *_), names in zip(self._params, self._names, strict=True)
            for name in names
        }

    def load_steps(self, steps: dict[str, float]) -> None:
        """Restore update counts saved by :meth:`steps_by_name` (fp32 CPU scalars, as AdamW keeps them).

        Raises:
            ValueError: a tensor is missing from ``steps``, or one parameter's tensors disagree.
        """
        for (p, *_), names in zip(self._params, self._names, strict=True):
            counts = {steps.get(n) for n in names}
            if None in counts or len(counts) != 1:
                raise ValueError(
                    f"AdamW step counts of {names} are missing or disagree: {sorted(map(str, counts))}"
                )
            self.opt.state[p]["step"] = torch.tensor(counts.pop(), dtype=torch.float32)

    def grad_sq_sum(self) -> float:
        """Sum of squared fp32 gradients of the owned units (this stage's share of the norm²)."""
        return float(sum(torch.dot(g, g) for *_, g in self._params)) if self._params else 0.0

    def drop_grads(self) -> None:
        """Zero the gradient accumulators without an update: a skipped (non-finite) step leaves master
        weights, ``exp_avg``, ``exp_avg_sq`` and AdamW's step count as they were."""
        for u in self.units:
            for name in self.store.layout.fields_of(u.index):
                if name.startswith("grad"):
                    self.store.buffer(u.index, name).zero_()

    def step(self, lr: float, grad_scale: float) -> None:
        """Scale gradients by ``grad_scale`` (the clip coefficient), update master weights, refresh
        the transfer copy, and zero the gradient accumulators."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        if grad_scale != 1.0:
            for *_, g in self._params:
                g.mul_(grad_scale)
        self.opt.step()
        for u in self.units:
            self.store.compute(u.index).copy_(self.store.master(u.index))
            self.store.grad(u.index).zero_()
