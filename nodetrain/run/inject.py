"""Test-only fault injection: the one place test knobs (delays, failures, a full disk) enter a run.

Owns: :class:`Faults`, read once at start-up from the ``NODETRAIN_FAULTS`` environment variable
(:meth:`Faults.from_env`; JSON or ``key=value,...``, validated) and passed to the components that have
a test hook, as ``Comm`` is passed its ``dist``: the copy workers (:meth:`Faults.before_copy`,
``copy_delay_s``; ``Faults.skip_compute_wait``), the optimizer thread (:meth:`Faults.before_update`,
``optim_delay_s``), the checkpoint writer thread (:meth:`Faults.before_write`, ``write_delay_s``), the
engine's NaN gradient (:meth:`Faults.nan_hook`, ``nan_*``), the training loop's failing rank
(:meth:`Faults.maybe_fail`, ``fail_*``), the NVMe tier's writes and free space (``tier_*``), the host
adds' chunk (``accum_chunk_per_thread``, the window), the host fit check (``host_available_bytes``)
and ``metrics.jsonl``'s full disk (:meth:`Faults.metrics_write`, ``metrics_full_step``). None of them
is a config key: a user's config cannot reach them. Production code holds :data:`NO_FAULTS` (the
variable unset), whose hooks do nothing; no component reads a test knob or sleeps itself. Does not
own what a slowed copy or a failed rank exposes (the tests say).

    NODETRAIN_FAULTS='fail_rank=1,fail_step=2' torchrun --nproc_per_node 2 -m nodetrain.train ...
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nodetrain.config.checks import ConfigError

__all__ = ["ENV", "FAIL_MODES", "Faults", "NO_FAULTS", "poison_grads"]

log = logging.getLogger(__name__)

ENV = "NODETRAIN_FAULTS"
"""The environment variable :meth:`Faults.from_env` reads (test-only; unset in real runs)."""

FAIL_MODES = ("raise", "hang")


@dataclass(frozen=True)
class Faults:
    """The test knobs of one rank (all off by default). Steps are 1-based, as in metrics.jsonl; -1 = off.

    Attributes:
        copy_delay_s: seconds each H2D/D2H copy job sleeps first (exposes a missing wait).
        optim_delay_s: seconds each unit's AdamW update sleeps first (exposes a stale load).
        write_delay_s: seconds each checkpoint file write sleeps first (a save still in flight).
        fail_rank, fail_step: the global rank that fails at the start of that step, as ``fail_mode``
            says: ``raise`` (a RuntimeError) or ``hang`` (a barrier no other rank joins, to exercise
            ``dist.timeout_s``).
        nan_rank, nan_step: the global rank whose gradient accumulators get a NaN in that step.
        tier_fail_rank, tier_fail_write: the rank whose ``store.tier=nvme`` writes fail with EIO from
            its ``tier_fail_write``-th (0-based, start-up fills included) on.
        tier_free_bytes: free bytes the start-up check sees in ``store.tier_dir``; -1 = real.
        host_available_bytes: host memory the start-up fit check sees as available; -1 = real.
        metrics_full_step: the step from whose row on every write to ``metrics.jsonl`` fails with
            ENOSPC (a full disk).
        accum_chunk_per_thread: elements per thread of a host add's chunk (0 = accumulate.py's
            ``CHUNK_PER_THREAD``): small, a tiny model's adds have many chunks for the idle optimizer
            thread to share (``stream.accum_help``).
        skip_compute_wait: a planted bug, not in the variable: the copy workers do not wait for the
            compute queued before a job (CUDA; proves the slot-reuse test can fail, tests/dist/test_gpu.py).
    """

    copy_delay_s: float = 0.0
    optim_delay_s: float = 0.0
    write_delay_s: float = 0.0
    fail_rank: int = -1
    fail_step: int = -1
    fail_mode: str = "raise"
    nan_rank: int = -1
    nan_step: int = -1
    tier_fail_rank: int = -1
    tier_fail_write: int = -1
    tier_free_bytes: int = -1
    host_available_bytes: int = -1
    metrics_full_step: int = -1
    accum_chunk_per_thread: int = 0
    skip_compute_wait: bool = False
    _tier_writes: itertools.count = field(default_factory=itertools.count, compare=False, repr=False)

    @classmethod
    def from_env(cls, world_size: int = 0, environ: Mapping[str, str] | None = None) -> Faults:
        """The knobs ``NODETRAIN_FAULTS`` sets (a JSON object or ``key=value,...``); :data:`NO_FAULTS`
        when it is unset or empty. ``world_size`` > 0 also checks the ranks against it.

        Raises:
            ConfigError: listing every unknown key, unreadable value, value out of range, key given
                twice and fault half set (a rank without its step, or a step without its rank), with
                the fix.
        """
        text = (os.environ if environ is None else environ).get(ENV, "").strip()
        if not text:
            return NO_FAULTS
        problems: list[str] = []
        pairs = _pairs(text, problems)
        values = _typed(pairs, problems)
        problems += _half_set(pairs, values)
        faults = cls(**values)
        problems += faults._range_problems(world_size)
        if problems:
            lines = "\n".join(f"  - {p}" for p in problems)
            raise ConfigError(
                f"{ENV}={text!r} (test-only fault injection): {len(problems)} problem(s):\n{lines}"
            )
        log.warning("%s: test-only faults injected: %s", ENV, values)
        return faults

    def _range_problems(self, world_size: int) -> list[str]:
        found = []
        for name in ("copy_delay_s", "optim_delay_s", "write_delay_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                found.append(f"{name}={value}: must be a finite number >= 0; use 0 for no delay")
        if self.fail_mode not in FAIL_MODES:
            found.append(f"fail_mode={self.fail_mode}: not one of {', '.join(FAIL_MODES)}; pick one")
        for kind in ("fail", "nan", "tier_fail"):
            rank = getattr(self, f"{kind}_rank")
            if rank < -1 or (world_size and rank >= world_size):
                of = f"a rank of {world_size}" if world_size else "a rank"
                found.append(f"{kind}_rank={rank}: not {of}; use -1 (off) or a global rank")
        for name in ("fail_step", "nan_step", "metrics_full_step"):
            step = getattr(self, name)
            if step == 0 or step < -1:
                found.append(f"{name}={step}: must be -1 (off) or a 1-based step; use -1")
        for name in ("tier_fail_write", "tier_free_bytes", "host_available_bytes"):
            if getattr(self, name) < -1:
                found.append(f"{name}={getattr(self, name)}: must be -1 (off) or >= 0; use -1")
        if self.accum_chunk_per_thread < 0:
            found.append(f"accum_chunk_per_thread={self.accum_chunk_per_thread}: must be >= 0; use 0")
        return found

    def before_copy(self) -> None:
        """A copy worker, before each job's copy."""
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)

    def before_update(self) -> None:
        """The optimizer thread, before each unit's update."""
        if self.optim_delay_s:
            time.sleep(self.optim_delay_s)

    def before_write(self) -> None:
        """The checkpoint writer thread, before each file it writes."""
        if self.write_delay_s:
            time.sleep(self.write_delay_s)

    def tier_pwrite(self, fd: int, data, offset: int) -> int:
        """The tier's ``os.pwrite`` (tier_files.py); ``tier_fail_rank`` / ``tier_fail_write``: from
        that rank's n-th tier write on, raise ``OSError(EIO)`` as a failing drive does.

        Raises:
            OSError: EIO when armed (as the kernel reports a failed write).
        """
        if self.tier_fail_rank >= 0 and next(self._tier_writes) >= self.tier_fail_write >= 0:
            if dist.is_initialized() and dist.get_rank() == self.tier_fail_rank:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return os.pwrite(fd, data, offset)

    def seen_tier_free_bytes(self, real: int) -> int:
        """Free bytes of ``store.tier_dir`` as the start-up check sees them (``tier_free_bytes``)."""
        return real if self.tier_free_bytes < 0 else self.tier_free_bytes

    def metrics_write(self, file, data, step: int) -> int:
        """``metrics.jsonl``'s write of the row of the 1-based ``step`` (``file.write(data)``);
        ``metrics_full_step``: from that step's row on, raise ``OSError(ENOSPC)`` as a full disk
        does.

        Raises:
            OSError: ENOSPC when armed.
        """
        if 0 <= self.metrics_full_step <= step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return file.write(data)

    def seen_host_available_bytes(self, real: int) -> int:
        """Available host memory as the start-up fit check sees it (``host_available_bytes``)."""
        return real if self.host_available_bytes < 0 else self.host_available_bytes

    def maybe_fail(self, rank: int, step: int) -> None:
        """The training loop, at the start of the 1-based ``step``: fail (or hang) when ``rank`` and
        ``step`` are ``fail_rank`` and ``fail_step``.

        Raises:
            RuntimeError: ``fail_mode=raise`` on the configured rank and step.
        """
        if rank != self.fail_rank or step != self.fail_step:
            return
        if self.fail_mode == "hang":  # the classic hang: ranks waiting in different collectives
            log.error("fail_mode=hang: rank %d enters a barrier no other rank joins at step %d", rank, step)
            dist.barrier()  # fails after dist.timeout_s, as the other ranks' waits do
        raise RuntimeError(f"fail_rank={rank}, fail_step={step}: injected failure")

    def nan_hook(self, store, last_unit: int, device_grads: dict | None = None):
        """``nan_rank``/``nan_step``: None when off (nothing is called), else ``poison(step, *units)``
        (``step`` 0-based), which writes a NaN into the gradient of this stage's last unit
        (``store.grad(last_unit)``, or ``device_grads[last_unit]`` when its optimizer is on the
        device; flat fp32) if it is among ``units``, once that gradient is final: on the optimizer
        thread for an in-backward unit (``UnitUpdates``' ``on_final``), else on the training thread
        after the flush; before the norm in both cases. It holds the store, not the engine (an engine
        kept alive by its own optimizer's hook would keep the store mapped)."""
        if self.nan_rank < 0 or self.nan_step < 0:
            return None
        on_device = device_grads or {}

        def poison(step: int, *units: int) -> None:
            if last_unit in units:
                grad = on_device.get(last_unit)
                poison_grads(
                    self, dist.get_rank(), step + 1, [store.grad(last_unit) if grad is None else grad]
                )

        return poison


def poison_grads(faults: Faults, rank: int, step: int, grads: list[torch.Tensor]) -> None:
    """Write NaN into the first element of the last of ``grads`` (flat fp32 gradient accumulators in
    the host store) when ``rank`` and the 1-based ``step`` are ``nan_rank`` and ``nan_step``."""
    if rank == faults.nan_rank and step == faults.nan_step and grads:
        log.warning("nan_step=%d: NaN written into rank %d's gradient", step, rank)
        grads[-1][0] = math.nan


def _pairs(text: str, problems: list[str]) -> dict[str, object]:
    """``{"key": value}`` of a JSON object, or ``key=value,...`` (values as strings)."""
    if text.startswith("{"):
        try:
            pairs = json.loads(text, object_pairs_hook=lambda items: _once(items, problems))
        except ValueError as e:
            problems.append(f"not a JSON object ({e}); write key=value,... or valid JSON")
            return {}
        if not isinstance(pairs, dict):
            problems.append(f'{pairs!r}: not a JSON object; write e.g. {{"fail_rank": 1}}')
            return {}
        return pairs
    items = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            problems.append(f"{item}: not key=value; write e.g. fail_rank=1,fail_step=2")
            continue
        items.append((key.strip(), value.strip()))
    return _once(items, problems)


def _once(items: list[tuple[str, object]], problems: list[str]) -> dict[str, object]:
    """``dict(items)``, with a problem for every key given more than once (its first value kept)."""
    pairs: dict[str, object] = {}
    for key, value in items:
        if key in pairs:
            problems.append(f"{key}={value}: {key} is already given ({key}={pairs[key]}); give each key once")
            continue
        pairs[key] = value
    return pairs


_PAIRS = (("fail_rank", "fail_step"), ("nan_rank", "nan_step"), ("tier_fail_rank", "tier_fail_write"))
"""Knobs that fire only together: a fault needs its rank and its step (or write)."""


def _half_set(pairs: dict[str, object], values: dict[str, object]) -> list[str]:
    """A problem for every pair of :data:`_PAIRS` with one knob on (not -1) and the other off (it
    would never fire), and for ``fail_mode`` without ``fail_rank``/``fail_step``; a pair with an
    unreadable value is left to that value's problem."""
    found = []
    for pair in _PAIRS:
        if any(k in pairs and k not in values for k in pair):
            continue
        on = [k for k in pair if values.get(k, -1) != -1]
        if len(on) == 1:
            (other,) = set(pair) - set(on)
            found.append(
                f"{on[0]}={values[on[0]]} without {other}: the fault never fires; set {other} too, "
                f"or drop {on[0]}"
            )
    if "fail_mode" in values and all(values.get(k, -1) == -1 for k in _PAIRS[0]):
        found.append(
            f"fail_mode={values['fail_mode']} without fail_rank and fail_step: nothing fails; set "
            "both, or drop fail_mode"
        )
    return found


_KNOBS = {f.name: f.type for f in dataclasses.fields(Faults) if not f.name.startswith("_")}
_KNOBS.pop("skip_compute_wait")  # a planted bug for one GPU test, not a knob of a run
_A = {"float": "a number", "int": "an integer", "str": "a string"}


def _typed(pairs: dict[str, object], problems: list[str]) -> dict[str, object]:
    """The known keys of ``pairs`` converted to their field's type; a problem for every other key
    and every value that does not convert."""
    values = {}
    for key, raw in pairs.items():
        kind = _KNOBS.get(key)
        if kind is None:
            problems.append(f"{key}={raw}: unknown key; use one of {', '.join(_KNOBS)}")
            continue
        convert = {"float": float, "int": int, "str": str}[kind]
        try:
            if isinstance(raw, bool) or (kind == "int" and isinstance(raw, float)):
                raise ValueError(raw)
            values[key] = convert(raw)
        except (TypeError, ValueError):
            problems.append(f"{key}={raw}: not {_A[kind]}; give {_A[kind]}")
    return values


NO_FAULTS = Faults()
"""Nothing injected: every hook returns at once."""
