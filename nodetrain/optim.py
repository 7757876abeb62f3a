"""CPU optimizer on the host store's flat per-unit buffers.

Owns: AdamW (``torch.optim.AdamW(fused=True)``, arXiv:1711.05101) over views of the store, unit by
unit, with its ``exp_avg`` / ``exp_avg_sq`` living in the store (one copy per node); the
learning-rate schedule; the global-norm gradient clip; and refreshing the compute-dtype transfer
copy. Does not own: computing gradients or reducing them across ranks (engine.py does the one
all-reduce), or running updates in the background (overlap.py).

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

_STATE_FIELDS = ("master", "exp_avg", "exp_avg_sq")
"""The store fields an AdamW update writes (besides the transfer copy, rewritten from ``master``)."""


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

    One ``torch.optim.AdamW(fused=True)`` per unit (its decay and no-decay groups), so a unit can be
    updated on its own as soon as its gradient is final (overlap.py); AdamW is elementwise, so the
    per-unit split gives bit-for-bit the result of one optimizer over every unit.

    Args:
        store: the host store.
        units: the owned units.
        cfg: optimizer settings.
    """

    def __init__(self, store: HostStore, units: list[Unit], cfg: OptimConfig):
        self.store, self.units, self.cfg = store, units, cfg
        self._params: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # unit -> [(param, grad)]
        self._opts: dict[int, torch.optim.AdamW] = {}
        self._names: dict[int, list[list[str]]] = {}  # unit -> HF names of each parameter's tensors
        for u in units:
            self._params[u.index], self._names[u.index], groups, state = [], [], [], {}
            for lo, hi, decay in ((0, u.num_decay, cfg.weight_decay), (u.num_decay, u.numel, 0.0)):
                if hi > lo:
                    self._names[u.index].append([q.hf_name for q in u.params if lo <= q.offset < hi])
                    p = store.master(u.index)[lo:hi]
                    p.grad = store.grad(u.index)[lo:hi]
                    self._params[u.index].append((p, p.grad))
                    groups.append({"params": [p], "weight_decay": decay})
                    state[p] = {  # the state lives in the store, not in private tensors
                        "step": torch.tensor(0.0),
                        "exp_avg": store.buffer(u.index, "exp_avg")[lo:hi],
                        "exp_avg_sq": store.buffer(u.index, "exp_avg_sq")[lo:hi],
                    }
            opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
            opt.state.update(state)
            self._opts[u.index] = opt
        self._backups: dict[int, torch.Tensor] = {}  # unit -> [3, numel] fp32 (speculative updates)
        self._backup_steps: dict[int, list[torch.Tensor]] = {}

    def steps_by_name(self) -> dict[str, float]:
        """AdamW's update count of every owned HF tensor (all tensors of a parameter share it)."""
        return {
            name: float(self._opts[u.index].state[p]["step"])
            for u in self.units
            for (p, _), names in zip(self._params[u.index], self._names[u.index], strict=True)
            for name in names
        }

    def load_steps(self, steps: dict[str, float]) -> None:
        """Restore update counts saved by :meth:`steps_by_name` (fp32 CPU scalars, as AdamW keeps them).

        Raises:
            ValueError: a tensor is missing from ``steps``, or one parameter's tensors disagree.
        """
        for u in self.units:
            opt = self._opts[u.index]
            for (p, _), names in zip(self._params[u.index], self._names[u.index], strict=True):
                counts = {steps.get(n) for n in names}
                if None in counts or len(counts) != 1:
                    raise ValueError(
                        f"AdamW step counts of {names} are missing or disagree: {sorted(map(str, counts))}"
                    )
                opt.state[p]["step"] = torch.tensor(counts.pop(), dtype=torch.float32)

    def grad_sq_sum(self) -> float:
        """Sum of squared fp32 gradients of the owned units (this stage's share of the norm²)."""
        dots = [torch.dot(g, g) for u in self.units for _, g in self._params[u.index]]
        return float(sum(dots)) if dots else 0.0

    def drop_grads(self) -> None:
        """Zero the gradient accumulators without an update: a skipped (non-finite) step leaves master
        weights, ``exp_avg``, ``exp_avg_sq`` and AdamW's step count as they were."""
        for u in self.units:
            self.drop_unit_grads(u.index)

    def drop_unit_grads(self, unit: int) -> None:
        """:meth:`drop_grads` for one owned unit (a unit whose gradient is NaN/inf, overlap.py)."""
        for name in self.store.layout.fields_of(unit):
            if name.startswith("grad"):
                self.store.buffer(unit, name).zero_()

    def unit_grad_dots(self, unit: int) -> list[torch.Tensor]:
        """Σ gradient² of each of one owned unit's parameter groups: 0-dim fp32 tensors, the terms
        :meth:`grad_sq_sum` adds (so a caller summing them in unit order gets its result bit for bit)."""
        return [torch.dot(g, g) for _, g in self._params[unit]]

    def unit_grad_sq(self, unit: int) -> float:
        """Sum of squared fp32 gradients of one owned unit (float64 sum of its groups' fp32 dots)."""
        return sum(float(torch.dot(g, g)) for _, g in self._params[unit])

    def backup_unit(self, unit: int) -> None:
        """Save one owned unit's master weights, ``exp_avg``, ``exp_avg_sq`` (fp32, 12 B/param in a
        private buffer kept for the run) and AdamW step counts, so :meth:`rollback_unit` can undo
        the next update exactly (a speculative update, overlap.py)."""
        n = self.store.master(unit).numel()
        backup = self._backups.get(unit)
        if backup is None:
            backup = self._backups[unit] = torch.empty(3, n, dtype=torch.float32)  # [3, P] fp32
        for row, name in zip(backup, _STATE_FIELDS, strict=True):
            row.copy_(self.store.buffer(unit, name))
        opt = self._opts[unit]
        self._backup_steps[unit] = [opt.state[p]["step"].clone() for p, _ in self._params[unit]]

    def rollback_unit(self, unit: int, refresh: bool = True) -> None:
        """Undo the updates of one owned unit since its :meth:`backup_unit`, bit for bit (master
        weights, ``exp_avg``, ``exp_avg_sq``, step counts); the gradient is left as is. A copy, not
        AdamW's closed-form inverse: that inverse leaves an absolute error of ~1 ulp of the
        unclipped ``exp_avg_sq`` (and ``exp_avg``), which a redo with a clip coefficient c adds to
        c² times the same quantity, a relative error of ~6e-8/c² (0.06 at c = 1e-3).

        Args:
            unit: an owned unit with a backup.
            refresh: rewrite the unit's transfer copy from the restored master weights (False when
                :meth:`step_unit` follows and rewrites it anyway).

        Raises:
            KeyError: the unit has no backup.
        """
        backup, steps = self._backups[unit], self._backup_steps.pop(unit)
        for row, name in zip(backup, _STATE_FIELDS, strict=True):
            self.store.buffer(unit, name).copy_(row)
        opt = self._opts[unit]
        for (p, _), step in zip(self._params[unit], steps, strict=True):
            opt.state[p]["step"].copy_(step)
        if refresh:
            self.store.compute(unit).copy_(self.store.master(unit))

    def backup_nbytes(self) -> int:
        """Bytes of private host RAM held by the backups made so far (12 per parameter backed up)."""
        return sum(b.numel() * b.element_size() for b in self._backups.values())

    def step_unit(self, unit: int, lr: float, grad_scale: float) -> None:
        """Update one owned unit: scale its gradient by ``grad_scale`` (the clip coefficient), AdamW,
        refresh its transfer copy. The gradient accumulator is left as is: the next step's first
        offload into it overwrites it (stream.py)."""
        opt = self._opts[unit]
        for group in opt.param_groups:
            group["lr"] = lr
        if grad_scale != 1.0:
            for _, g in self._params[unit]:
                g.mul_(grad_scale)
        opt.step()
        self.store.compute(unit).copy_(self.store.master(unit))

    def step(self, lr: float, grad_scale: float) -> None:
        """Update every owned unit, in order (see :meth:`step_unit`)."""
        for u in self.units:
            self.step_unit(u.index, lr, grad_scale)
