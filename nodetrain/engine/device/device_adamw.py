"""A resident unit's optimizer on the device (``optim.on_device``): its fp32 master weights, AdamW
moments and gradient live there, and it is updated there.

Owns: per unit of the stage's on-device blocks (core/placement.py decides which) its fp32 ``master``,
``exp_avg``, ``exp_avg_sq`` and gradient on the compute device and AdamW's update counts there; the
gradient views the window accumulates into instead of shipping (window.py); the norm², the fused
AdamW update (the kernel of the host's, ``torch._fused_adamw_``, same groups, decay and bias
correction) and the rewrite of the block's compute-dtype weights from the master; and the copies
between it and the host store, which stays the checkpoint's copy: :meth:`DeviceAdamW.load` reads the
store (and the host optimizer's update counts) before the first step of a process, :meth:`save`
writes everything back (before a checkpoint or an export reads it, and after the run's last step).
Does not own which units (placement.py), the all-reduce or the skip decision (engine.py).

On CPU the "device" is a set of tensors apart from the store, so the same arithmetic runs, bit for
bit as the host's: the same kernel over the same groups, the gradient summed in the same order.
"""

from __future__ import annotations

import torch

from nodetrain.optim.adamw import StoreAdamW
from nodetrain.store import HostStore

__all__ = ["DeviceAdamW"]

_STATE = ("master", "exp_avg", "exp_avg_sq")
"""The store's fp32 fields a device optimizer holds (the gradient starts each step on the device)."""


class DeviceAdamW:
    """AdamW on the device for the units of a stage's on-device blocks.

    Args:
        store: the host store (the checkpoint's copy of every unit's state).
        optimizer: the stage's host AdamW (its groups, decay, betas, eps and update counts); its
            :meth:`~nodetrain.optim.adamw.StoreAdamW.hand_to_device` is called for these units.
        bindings: per block, the parameters it binds (``HFModel.bindings``).
        blocks: the on-device blocks (resident; every unit they bind is owned by this stage).
        device: the compute device.

    Memory: per unit ``numel × 16`` bytes on the device (fp32 master, moments, gradient), plus, on one
    stage with a tied embedding, an fp32 gradient of the head's use of it (``numel`` of the embedding × 4).
    """

    def __init__(self, store: HostStore, optimizer: StoreAdamW, bindings, blocks, device) -> None:
        self.store, self.opt, self.device = store, optimizer, torch.device(device)
        self.blocks = sorted(blocks)
        self.units = sorted({b.unit for i in self.blocks for b in bindings[i]})
        self._bindings = {i: bindings[i] for i in self.blocks}
        fp32 = dict(dtype=torch.float32, device=self.device)
        numel = {u: store.layout.unit_numels[u] for u in self.units}
        self._state = {u: {f: torch.empty(numel[u], **fp32) for f in (*_STATE, "grad")} for u in self.units}
        # a binding of unit u by another block (the head's use of the tied embedding): its own gradient
        self._tied = {
            (i, b.local_name): torch.empty(b.numel, **fp32)
            for i in self.blocks
            for b in bindings[i]
            if b.unit != i
        }
        self._steps = {u: [torch.zeros((), **fp32) for _ in optimizer.unit_groups(u)] for u in self.units}
        self._weights: list[tuple[torch.Tensor, int, int, int]] = []  # (compute view, unit, lo, hi)
        self.loaded = False
        if self.units:  # (only a full-state host AdamW has it: the placement keeps none otherwise)
            optimizer.hand_to_device(self.units)

    @property
    def nbytes(self) -> int:
        """Device bytes held: master, moments and gradients (and the tied use's gradient)."""
        held = [t for s in self._state.values() for t in s.values()] + list(self._tied.values())
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def grads(self) -> list[torch.Tensor]:
        """Every unit's flat fp32 gradient on the device, in unit order (the replica sum's)."""
        return [self._state[u]["grad"] for u in self.units]

    def grad_views(self, block: int) -> dict[str, torch.Tensor]:
        """Where ``block``'s gradients accumulate (the window's device accumulator for it): local name ->
        flat fp32 view on the device."""
        out = {}
        for b in self._bindings[block]:
            tied = self._tied.get((block, b.local_name))
            out[b.local_name] = (
                tied if tied is not None else self._state[b.unit]["grad"][b.offset : b.offset + b.numel]
            )
        return out

    def bind_weights(self, views) -> None:
        """Take the on-device blocks' compute-dtype weights (``views(block)``: local name -> flat view of
        its resident buffer, ``Window.resident_views``): rewritten from the master after each update."""
        self._weights = [
            (views(i)[b.local_name], b.unit, b.offset, b.offset + b.numel)
            for i in self.blocks
            for b in self._bindings[i]
        ]

    def load(self) -> None:
        """Read every unit's master weights, moments and update counts from the host store and the host
        optimizer, and write the blocks' weights from the master, once (later calls do nothing): before
        the first step or evaluation of a process, when a resume has restored the store."""
        if self.loaded:
            return
        for u in self.units:
            for f in _STATE:
                self._state[u][f].copy_(self.store.buffer(u, f))
            for step, (*_, host) in zip(self._steps[u], self.opt.unit_groups(u), strict=True):
                step.copy_(host)
        self._write_weights()
        self.loaded = True

    def save(self) -> None:
        """Write every unit's master weights, moments, update counts and transfer copy back into the host
        store (bit for bit what the host optimizer would hold); a no-op before :meth:`load`."""
        if not self.loaded:
            return
        for u in self.units:
            for f in _STATE:
                self.store.buffer(u, f).copy_(self._state[u][f])
            self.store.compute(u).copy_(self.store.master(u))
            for step, (*_, host) in zip(self._steps[u], self.opt.unit_groups(u), strict=True):
                host.copy_(step)

    def sum_tied(self) -> None:
        """One stage's tied embedding: the head's use's gradient added into the embedding's, on the device."""
        for (block, name), g in self._tied.items():
            (b,) = [b for b in self._bindings[block] if b.local_name == name]
            self._state[b.unit]["grad"][b.offset : b.offset + b.numel].add_(g)

    def grad_sq(self) -> torch.Tensor:
        """Σ gradient² of these units: a 0-d fp32 tensor on the device (no host sync), the sum of each
        group's fp32 dot in unit order (the host's terms: ``StoreAdamW.unit_grad_dots``)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for u in self.units:
            g = self._state[u]["grad"]
            for lo, hi, *_ in self.opt.unit_groups(u):
                total += torch.dot(g[lo:hi], g[lo:hi])
        return total

    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW update of every unit, then its blocks' weights rewritten from the master.

        Args:
            lr: learning rate of this update; grad_scale: the clip coefficient (``clip_coef``); 1: none.
        """
        cfg = self.opt.cfg
        scale = None
        if grad_scale != 1.0:  # the kernel divides by its grad_scale, as the host's (StoreAdamW.step_unit)
            scale = torch.tensor(1.0 / grad_scale, dtype=torch.float32, device=self.device)
        for u in self.units:
            st = self._state[u]
            for step, (lo, hi, decay, _) in zip(self._steps[u], self.opt.unit_groups(u), strict=True):
                step += 1
                torch._fused_adamw_(
                    [st["master"][lo:hi]],
                    [st["grad"][lo:hi]],
                    [st["exp_avg"][lo:hi]],
                    [st["exp_avg_sq"][lo:hi]],
                    [],
                    [step],
                    amsgrad=False,
                    lr=lr,
                    beta1=cfg.beta1,
                    beta2=cfg.beta2,
                    weight_decay=decay,
                    eps=cfg.eps,
                    maximize=False,
                    grad_scale=scale,
                    found_inf=None,
                )
        self._write_weights()

    def _write_weights(self) -> None:
        for view, u, lo, hi in self._weights:
            view.copy_(self._state[u]["master"][lo:hi])
