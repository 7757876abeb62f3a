"""Lean AdamW (``optim.state=lean``): 7.53 host bytes per parameter instead of 18, same update rule.

Owns: AdamW over the lean host store layout (store.py ``LEAN_FIELDS``: bf16 master weights, 4-bit
``exp_avg`` in blocks of 128, 8-bit ``exp_avg_sq`` in blocks of 2048, each with fp32 absmax block
scales, and an fp32 gradient), unit by unit, with the same interface as
:class:`nodetrain.optim.adamw.StoreAdamW` (overlap.py, engine.py and checkpointing call either).
Each chunk's update decodes to fp32, runs ``torch._fused_adamw_`` as ``full`` does, re-encodes
the moments (``exp_avg`` stochastically, ``exp_avg_sq`` to nearest) and rounds the weights to bf16
with random bits seeded by (seed, unit, step), so a resumed run repeats it bit for bit. Does not
own: the number formats (quant.py) or the layout (store.py).

Why, the byte table and the papers: docs/optimizer.md#lean-host-state.
"""

from __future__ import annotations

import hashlib

import torch

from nodetrain.config.schema import OptimConfig
from nodetrain.model import Unit
from nodetrain.optim.adamw import CHUNK_NUMEL, zero_grads
from nodetrain.optim.quant import dequantize_blockwise, quantize_blockwise, stochastic_round_bf16
from nodetrain.store import LEAN_FORMATS, HostStore

__all__ = ["LeanAdamW", "FullScratch", "init_lean"]


_STOCHASTIC = ("exp_avg",)
"""Moments re-encoded by stochastic rounding after each update: the first, which must decay
geometrically when its gradient stops (to nearest it stays on its code, see quant.py). The second
keeps round to nearest: its map has no 0 (a floor on the denominator), and noise in ``sqrt(v)``
would bias ``1/sqrt(v)`` upward (Jensen)."""


def _sr_seed(seed: int, unit: int, step: int) -> int:
    digest = hashlib.sha256(f"nodetrain.lean:{seed}:{unit}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class LeanAdamW:
    """AdamW over the units this stage owns, on the lean store layout (see the module docstring).

    Args:
        store: the host store, laid out with ``state="lean"`` (bf16 ``compute``).
        units: the owned units.
        cfg: optimizer settings.
        seed: the run's seed (stochastic rounding's random bits).

    Raises:
        ValueError: the store is not a lean one.
    """

    def __init__(self, store: HostStore, units: list[Unit], cfg: OptimConfig, seed: int = 0):
        if store.layout.state != "lean" or store.layout.compute_dtype != torch.bfloat16:
            raise ValueError(
                f"LeanAdamW needs a lean store with bf16 weights, got state={store.layout.state!r}, "
                f"compute dtype {store.layout.compute_dtype}; set optim.state=lean and train.dtype=bfloat16"
            )
        self.store, self.units, self.cfg, self.seed = store, units, cfg, seed
        self._groups = {  # unit -> [(lo, hi, weight decay, HF names)], decay-first as the store lays it out
            u.index: [
                (lo, hi, wd, [q.hf_name for q in u.params if lo <= q.offset < hi])
                for lo, hi, wd in ((0, u.num_decay, cfg.weight_decay), (u.num_decay, u.numel, 0.0))
                if hi > lo
            ]
            for u in units
        }
        self._steps = {u.index: [torch.tensor(0.0) for _ in self._groups[u.index]] for u in units}

    def close(self) -> None:
        """Nothing to let go: the store's buffers are looked up at each use, none is kept."""

    def steps_by_name(self) -> dict[str, float]:
        """AdamW's update count of every owned HF tensor (all tensors of a parameter share it)."""
        return {
            name: float(step)
            for u in self.units
            for (*_, names), step in zip(self._groups[u.index], self._steps[u.index], strict=True)
            for name in names
        }

    def load_steps(self, steps: dict[str, float]) -> None:
        """Restore update counts saved by :meth:`steps_by_name`.

        Raises:
            ValueError: a tensor is missing from ``steps``, or one parameter's tensors disagree.
        """
        for u in self.units:
            for i, (*_, names) in enumerate(self._groups[u.index]):
                counts = {steps.get(n) for n in names}
                if None in counts or len(counts) != 1:
                    raise ValueError(
                        f"AdamW step counts of {names} are missing or disagree: {sorted(map(str, counts))}"
                    )
                self._steps[u.index][i] = torch.tensor(counts.pop(), dtype=torch.float32)

    def grad_sq_sum(self) -> float:
        """Sum of squared fp32 gradients of the owned units (this stage's share of the norm²)."""
        return sum(self.unit_grad_sq(u.index) for u in self.units)

    def unit_grad_sq(self, unit: int) -> float:
        """Sum of squared fp32 gradients of one owned unit (float64 sum of its groups' fp32 dots)."""
        g = self.store.grad(unit)
        return sum(float(torch.dot(g[lo:hi], g[lo:hi])) for lo, hi, *_ in self._groups[unit])

    def drop_grads(self) -> None:
        """Zero the gradient accumulators without an update (a skipped step)."""
        for u in self.units:
            self.drop_unit_grads(u.index)

    def drop_unit_grads(self, unit: int) -> None:
        """:meth:`drop_grads` for one owned unit."""
        zero_grads(self.store, unit)

    def step_unit(
        self, unit: int, lr: float, grad_scale: float = 1.0, found_inf: torch.Tensor | None = None
    ) -> None:
        """Update one owned unit chunk by chunk (see the module docstring).

        Args:
            unit: an owned unit's index.
            lr: learning rate of this update.
            grad_scale: the clip coefficient, multiplied into the gradient; 1: none.
            found_inf: optional 0-d fp32 CPU tensor; nonzero: nothing changes (weights, moments, count).
        """
        if found_inf is not None and bool(found_inf):
            return
        scale = None if grad_scale == 1.0 else torch.tensor(1.0 / grad_scale, dtype=torch.float32)
        for step in self._steps[unit]:
            step += 1
        gen = torch.Generator().manual_seed(_sr_seed(self.seed, unit, int(self._steps[unit][0])))
        numel = self.store.layout.unit_numels[unit]
        for lo in range(0, numel, CHUNK_NUMEL):
            self._step_chunk(unit, lo, min(lo + CHUNK_NUMEL, numel), lr, scale, gen)

    def _step_chunk(self, unit: int, lo: int, hi: int, lr: float, scale, gen: torch.Generator) -> None:
        weights = self.store.compute(unit)[lo:hi]
        w = weights.float()  # [hi - lo] fp32 scratch of the bf16 master
        g = self.store.grad(unit)[lo:hi]
        moments = {name: self._moment(unit, name, lo, hi) for name in LEAN_FORMATS}
        m, v = (dequantize_blockwise(*args, out=torch.empty(hi - lo)) for args in moments.values())
        for (a, b, wd, _), step in zip(self._groups[unit], self._steps[unit], strict=True):
            a, b = max(a, lo) - lo, min(b, hi) - lo
            if b > a:
                torch._fused_adamw_(
                    [w[a:b]],
                    [g[a:b]],
                    [m[a:b]],
                    [v[a:b]],
                    [],
                    [step],
                    amsgrad=False,
                    lr=lr,
                    beta1=self.cfg.beta1,
                    beta2=self.cfg.beta2,
                    weight_decay=wd,
                    eps=self.cfg.eps,
                    maximize=False,
                    grad_scale=scale,
                    found_inf=None,
                )
        for x, name in zip((m, v), moments, strict=True):
            codes, absmax, _n, block, bits, signed = moments[name]
            quantize_blockwise(x, codes, absmax, block, bits, signed, gen if name in _STOCHASTIC else None)
        stochastic_round_bf16(w, weights, gen)

    def _moment(self, unit: int, name: str, lo: int, hi: int) -> tuple:
        """(codes, absmax, n, block, bits, signed) of elements [lo, hi) of ``name`` (lo block-aligned)."""
        bits, block, signed = LEAN_FORMATS[name]
        per_byte = 8 // bits
        codes = self.store.buffer(unit, name)[lo // per_byte : -(-hi // per_byte)]
        absmax = self.store.buffer(unit, name + "_absmax")[lo // block : -(-hi // block)]
        return codes, absmax, hi - lo, block, bits, signed

    def step(self, lr: float, grad_scale: float) -> None:
        """Update every owned unit, in order (see :meth:`step_unit`)."""
        for u in self.units:
            self.step_unit(u.index, lr, grad_scale)

    def load_unit(self, unit: int, weights: torch.Tensor, exp_avg=None, exp_avg_sq=None) -> None:
        """Set one unit's state from fp32 values (initialisation, import, resume from a ``full``
        checkpoint): weights rounded to nearest bf16, moments quantized (zero when not given).

        Args:
            weights, exp_avg, exp_avg_sq: ``[unit numel]`` fp32.
        """
        self.store.compute(unit).copy_(weights)
        numel = weights.numel()
        for name, x in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            codes, absmax, _n, block, bits, signed = self._moment(unit, name, 0, numel)
            quantize_blockwise(torch.zeros(numel) if x is None else x, codes, absmax, block, bits, signed)


class FullScratch:
    """A ``full`` store's fields for one unit in private fp32 memory, so the loaders written for ``full``
    (HF import, a ``full`` checkpoint) fill a lean store one unit at a time (12 B/param of that unit,
    freed after it). Fields never written read as None (:meth:`written`)."""

    def __init__(self, unit: Unit):
        self._unit, self._bufs = unit, {}

    def buffer(self, unit: int, name: str) -> torch.Tensor:
        assert unit == self._unit.index, (unit, self._unit.index)
        if name not in self._bufs:
            self._bufs[name] = torch.zeros(self._unit.numel)
        return self._bufs[name]

    def master(self, unit: int) -> torch.Tensor:
        return self.buffer(unit, "master")

    def written(self, name: str) -> torch.Tensor | None:
        return self._bufs.get(name)


def init_lean(optimizer: LeanAdamW, model, units: list[Unit], init_from, seed: int) -> None:
    """Fill a lean store's owned units: from ``init_from(store, units)`` (HF import or a checkpoint;
    called unit by unit with a :class:`FullScratch`, whose fp32 master and moments are then rounded
    and quantized), else the model's random init. A lean checkpoint's loader (``lean_loader``) writes
    the store directly."""
    if getattr(init_from, "lean_loader", False):
        init_from(optimizer.store, units)
        return
    for u in units:
        scratch = FullScratch(u)
        if init_from is not None:
            init_from(scratch, [u])
        else:
            model.init_unit(u, scratch.master(u.index), seed)
        optimizer.load_unit(
            u.index, scratch.master(u.index), scratch.written("exp_avg"), scratch.written("exp_avg_sq")
        )
