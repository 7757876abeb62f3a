"""Test-only fault injection: the one object through which the ``test.*`` and ``*.test_*`` knobs act.

Owns: :class:`Faults`, built once from the config (:meth:`Faults.from_config`) and passed to the
components that have a test knob, as ``Comm`` is passed its ``dist``: the copy workers
(:meth:`Faults.before_copy`, ``stream.test_copy_delay_s``; ``Faults.skip_compute_wait``), the optimizer thread
(:meth:`Faults.before_update`, ``optim.test_delay_s``), the checkpoint writer thread
(:meth:`Faults.before_write`, ``checkpoint.test_write_delay_s``), the engine's NaN gradient
(:meth:`Faults.nan_hook`, ``test.nan_*``), the training loop's failing rank
(:meth:`Faults.maybe_fail`, ``test.fail_*``) and ``metrics.jsonl``'s full disk
(:meth:`Faults.metrics_write`, ``test.metrics_full_step``). Production code holds :data:`NO_FAULTS`
(or one built from a config with every knob off), whose hooks do nothing; no component reads a test
knob or sleeps itself. Does not own what a slowed copy or a failed rank exposes (the tests say).
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nodetrain.config.schema import FaultInjectionConfig

__all__ = ["Faults", "NO_FAULTS", "poison_grads"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Faults:
    """The test knobs of one rank (all off by default).

    Attributes:
        copy_delay_s: seconds each H2D/D2H copy job sleeps first (exposes a missing wait).
        optim_delay_s: seconds each unit's AdamW update sleeps first (exposes a stale load).
        write_delay_s: seconds each checkpoint file write sleeps first (a save still in flight).
        test: the ``test.*`` knobs (a NaN gradient, a failing rank).
        skip_compute_wait: a planted bug, no config key: the copy workers do not wait for the compute
            queued before a job (CUDA; proves the slot-reuse test can fail, tests/test_gpu.py).
    """

    copy_delay_s: float = 0.0
    optim_delay_s: float = 0.0
    write_delay_s: float = 0.0
    test: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    _tier_writes: itertools.count = field(default_factory=itertools.count, compare=False, repr=False)
    skip_compute_wait: bool = False

    @classmethod
    def from_config(cls, cfg) -> Faults:
        """The knobs of a run config (``stream.test_copy_delay_s``, ``optim.test_delay_s``,
        ``checkpoint.test_write_delay_s``, ``test``); :data:`NO_FAULTS` when every one is off."""
        faults = cls(
            cfg.stream.test_copy_delay_s, cfg.optim.test_delay_s, cfg.checkpoint.test_write_delay_s, cfg.test
        )
        return NO_FAULTS if faults == NO_FAULTS else faults

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
        """The tier's ``os.pwrite`` (tier_files.py); ``test.tier_fail_rank`` / ``tier_fail_write``: from
        that rank's n-th tier write on, raise ``OSError(EIO)`` as a failing drive does.

        Raises:
            OSError: EIO when armed (as the kernel reports a failed write).
        """
        test = self.test
        if test.tier_fail_rank >= 0 and next(self._tier_writes) >= test.tier_fail_write >= 0:
            if dist.is_initialized() and dist.get_rank() == test.tier_fail_rank:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return os.pwrite(fd, data, offset)

    def tier_free_bytes(self, real: int) -> int:
        """Free bytes of ``store.tier_dir`` as the start-up check sees them (``test.tier_free_bytes``)."""
        return real if self.test.tier_free_bytes < 0 else self.test.tier_free_bytes

    def metrics_write(self, file, data, step: int) -> int:
        """``metrics.jsonl``'s write of the row of the 1-based ``step`` (``file.write(data)``);
        ``test.metrics_full_step``: from that step's row on, raise ``OSError(ENOSPC)`` as a full disk
        does.

        Raises:
            OSError: ENOSPC when armed.
        """
        if 0 <= self.test.metrics_full_step <= step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return file.write(data)

    def host_available_bytes(self, real: int) -> int:
        """Available host memory as the start-up fit check sees it (``test.host_available_bytes``)."""
        return real if self.test.host_available_bytes < 0 else self.test.host_available_bytes

    def maybe_fail(self, rank: int, step: int) -> None:
        """The training loop, at the start of the 1-based ``step``: fail (or hang) when ``rank`` and
        ``step`` are ``test.fail_rank`` and ``test.fail_step``.

        Raises:
            RuntimeError: ``test.fail_mode=raise`` on the configured rank and step.
        """
        test = self.test
        if rank != test.fail_rank or step != test.fail_step:
            return
        if test.fail_mode == "hang":  # the classic hang: ranks waiting in different collectives
            log.error(
                "test.fail_mode=hang: rank %d enters a barrier no other rank joins at step %d", rank, step
            )
            dist.barrier()  # fails after dist.timeout_s, as the other ranks' waits do
        raise RuntimeError(f"test.fail_rank={rank}, test.fail_step={step}: injected failure")

    def nan_hook(self, store, last_unit: int):
        """``test.nan_rank``/``nan_step``: None when off (nothing is called), else ``poison(step, *units)``
        (``step`` 0-based), which writes a NaN into the gradient of this stage's last unit
        (``store.grad(last_unit)``, flat fp32) if it is among ``units``, once that gradient is final:
        on the optimizer thread for an in-backward unit (``UnitUpdates``' ``on_final``), else on the
        training thread after the flush; before the norm in both cases. It holds the store, not the
        engine (an engine kept alive by its own optimizer's hook would keep the store mapped)."""
        test = self.test
        if test.nan_rank < 0 or test.nan_step < 0:
            return None

        def poison(step: int, *units: int) -> None:
            if last_unit in units:
                poison_grads(test, dist.get_rank(), step + 1, [store.grad(last_unit)])

        return poison


def poison_grads(test: FaultInjectionConfig, rank: int, step: int, grads: list[torch.Tensor]) -> None:
    """Write NaN into the first element of the last of ``grads`` (flat fp32 gradient accumulators in
    the host store) when ``rank`` and the 1-based ``step`` are ``test.nan_rank`` and ``test.nan_step``."""
    if rank == test.nan_rank and step == test.nan_step and grads:
        log.warning("test.nan_step=%d: NaN written into rank %d's gradient", step, rank)
        grads[-1][0] = math.nan


NO_FAULTS = Faults()
"""Nothing injected: every hook returns at once."""
