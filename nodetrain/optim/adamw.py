"""CPU optimizer on the host store's flat per-unit buffers.

Owns: AdamW (the kernel of ``torch.optim.AdamW(fused=True)``, arXiv:1711.05101) over views of the
store, unit by unit, with its ``exp_avg`` / ``exp_avg_sq`` living in the store (one copy per node);
the learning-rate schedule; the global-norm gradient clip; and refreshing the compute-dtype transfer
copy — clip scale, finiteness flag, update and refresh in one pass over a unit's memory.
Does not own: computing gradients or reducing them across ranks (engine.py does the one all-reduce),
or running updates in the background (overlap.py).

Each unit's flat buffer is laid out decay-first, so a unit is two parameter tensors: its
matrices (weight decay applies) and its norms/biases (no decay).
"""

from __future__ import annotations

import math

import torch

from nodetrain.config.schema import OptimConfig
from nodetrain.model import Unit
from nodetrain.store import HostStore

__all__ = ["lr_at", "clip_coef", "zero_grads", "chunk_numel", "StoreAdamW"]

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


def zero_grads(store: HostStore, unit: int) -> None:
    """Zero every gradient accumulator of ``unit`` in the store (``grad`` and, if bound, ``grad_tied``)."""
    for name in store.layout.fields_of(unit):
        if name.startswith("grad"):
            store.buffer(unit, name).zero_()


def clip_coef(total_norm: float, max_norm: float) -> float:
    """Gradient scale for global-norm clipping, as ``torch.nn.utils.clip_grad_norm_``:
    ``min(1, max_norm / (total_norm + 1e-6))``; 1 when ``max_norm`` is 0 (no clipping)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


CHUNK_NUMEL = 1 << 18
"""Elements per chunk of :meth:`StoreAdamW.step_unit` on a one-thread OpenMP team: 1 MiB of fp32
master weights (~4.5 MiB with its gradient, moments and bf16 copy), so the chunk's master is still
in cache when its transfer copy is written (bench/cpu_optimizer.py, 1 thread: 0.74 → 0.80 of torch's
fused AdamW alone on an idle 2-core EPYC)."""


def chunk_numel() -> int | None:
    """Elements per chunk of one fused update on the calling thread, or ``None``: one chunk per group.

    Chunks only on a one-thread OpenMP team (``torch.get_num_threads()``, which the optimizer thread
    sets for itself). A larger team meets at a barrier after every parallel region, two per chunk:
    measured on the shared 2-core machine, 2 threads gained nothing from chunks when idle (12.3 vs
    12.8 ms for 32M elements) and lost 4-6x when another job held a core (each barrier waited out
    a scheduler time slice), so there the update and the refresh each run once per group.
    """
    return CHUNK_NUMEL if torch.get_num_threads() == 1 else None


class StoreAdamW:
    """AdamW over the units this stage owns, state kept in the host store.

    One ``torch.optim.AdamW(fused=True)`` per unit (its decay and no-decay groups) holds the
    hyper-parameters and state; :meth:`step_unit` calls its kernel on chunks of them, so a unit can be
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
        self._all = list(units)  # every owned unit: its step counts are saved, whoever updates it
        self._chunk_views: dict[tuple[int, int], list[list[tuple[torch.Tensor, ...]]]] = {}
        self._backups: dict[int, torch.Tensor] = {}  # unit -> [3, numel] fp32 (speculative updates)
        self._backup_steps: dict[int, list[torch.Tensor]] = {}

    def hand_to_device(self, units) -> None:
        """Stop updating ``units`` (indices) here: their optimizer runs on the device
        (engine/device/device_adamw.py), which reads and writes back their state in the store and
        their step counts here (:meth:`unit_groups`); they stay in :meth:`steps_by_name`."""
        self.units = [u for u in self.units if u.index not in set(units)]

    def unit_groups(self, unit: int) -> list[tuple[int, int, float, torch.Tensor]]:
        """One owned unit's parameter groups as ``(lo, hi, weight_decay, step)``: its flat range
        ``[lo, hi)`` in the store's buffers, the group's decay and AdamW's update count (a 0-d fp32
        CPU tensor, the live one: a device optimizer copies it in and back)."""
        out, lo = [], 0
        for group in self._opts[unit].param_groups:
            (p,) = group["params"]
            out.append((lo, lo + p.numel(), group["weight_decay"], self._opts[unit].state[p]["step"]))
            lo += p.numel()
        return out

    def steps_by_name(self) -> dict[str, float]:
        """AdamW's update count of every owned HF tensor (all tensors of a parameter share it)."""
        return {
            name: float(self._opts[u.index].state[p]["step"])
            for u in self._all
            for (p, _), names in zip(self._params[u.index], self._names[u.index], strict=True)
            for name in names
        }

    def load_steps(self, steps: dict[str, float]) -> None:
        """Restore update counts saved by :meth:`steps_by_name` (fp32 CPU scalars, as AdamW keeps them).

        Raises:
            ValueError: a tensor is missing from ``steps``, or one parameter's tensors disagree.
        """
        for u in self._all:
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
        zero_grads(self.store, unit)

    def unit_grad_dots(self, unit: int) -> list[torch.Tensor]:
        """Σ gradient² of each of one owned unit's parameter groups: 0-dim fp32 tensors, the terms
        :meth:`grad_sq_sum` adds (so a caller summing them in unit order gets its result bit for bit)."""
        return [torch.dot(g, g) for _, g in self._params[unit]]

    def unit_grad_sq(self, unit: int) -> float:
        """Sum of squared fp32 gradients of one owned unit (float64 sum of its groups' fp32 dots)."""
        return sum(float(torch.dot(g, g)) for _, g in self._params[unit])

    def step_unit(
        self, unit: int, lr: float, grad_scale: float = 1.0, found_inf: torch.Tensor | None = None
    ) -> None:
        """Update one owned unit in one pass over its memory: clip scale, finiteness flag, AdamW and
        the transfer-copy refresh, chunk by chunk (one chunk per group on a larger OpenMP team, see
        :func:`chunk_numel`).

        Each chunk is one ``torch._fused_adamw_`` call (the kernel of ``torch.optim.AdamW(fused=True)``)
        given the gradient scale and the flag, then that chunk's ``compute.copy_(master)`` while the
        chunk is still in cache. The kernel *divides* gradients by its ``grad_scale``, so it gets
        ``1 / grad_scale`` (≤ 1 ulp from multiplying; none when ``grad_scale`` is a power of two), and
        writes the scaled gradient back, as ``g.mul_(grad_scale)`` did. The gradient accumulator is
        otherwise left as is: the next step's first offload into it overwrites it (engine/device/window.py).

        Args:
            unit: an owned unit's index.
            lr: learning rate of this update.
            grad_scale: the clip coefficient (``clip_coef``), multiplied into the gradient; 1: none.
            found_inf: optional 0-d fp32 CPU tensor; nonzero: the kernel skips the update and AdamW's
                step count is restored (torch's ``found_inf`` semantics), so master weights,
                ``exp_avg``, ``exp_avg_sq``, the step count and the transfer copy stay as they were.
        """
        scale = None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, dtype=torch.float32)
        skipped = found_inf is not None and bool(found_inf)
        opt, numel = self._opts[unit], chunk_numel() or self.store.master(unit).numel()
        for group, chunks in zip(opt.param_groups, self._chunks(unit, numel), strict=True):
            step = opt.state[group["params"][0]]["step"]
            step += 1
            beta1, beta2 = group["betas"]
            for master, grad, exp_avg, exp_avg_sq, compute in chunks:
                torch._fused_adamw_(
                    [master],
                    [grad],
                    [exp_avg],
                    [exp_avg_sq],
                    [],
                    [step],
                    amsgrad=False,
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                    grad_scale=scale,
                    found_inf=found_inf,
                )
                if not skipped:
                    compute.copy_(master)
            if found_inf is not None:
                step -= found_inf

    def _chunks(self, unit: int, numel: int) -> list[list[tuple[torch.Tensor, ...]]]:
        """Per parameter group of ``unit``, its (master, grad, exp_avg, exp_avg_sq, compute) views cut
        into chunks of ``numel`` elements (built once per chunk size: slicing costs µs per view)."""
        key = (unit, numel)
        if key not in self._chunk_views:
            views, offset = [], 0
            compute = self.store.compute(unit)
            for group in self._opts[unit].param_groups:
                (p,) = group["params"]
                state = self._opts[unit].state[p]
                whole = (
                    p,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    compute[offset : offset + p.numel()],
                )
                offset += p.numel()
                views.append([tuple(t[lo : lo + numel] for t in whole) for lo in range(0, p.numel(), numel)])
            self._chunk_views[key] = views
        return self._chunk_views[key]

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

    def close(self) -> None:
        """Let go of the store's views (parameters, gradients, AdamW's state, chunks, backups), so the
        store's mapping can go with ``HostStore.close``; the optimizer is unusable afterwards."""
        self._params.clear()
        self._opts.clear()
        self._chunk_views.clear()
        self._backups.clear()

    def step(self, lr: float, grad_scale: float) -> None:
        """Update every owned unit, in order (see :meth:`step_unit`)."""
        for u in self.units:
            self.step_unit(u.index, lr, grad_scale)
