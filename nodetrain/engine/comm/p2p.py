"""Point-to-point transfer of activations and their gradients between neighbouring stages.

Owns: posting each group of :func:`~nodetrain.core.schedule.p2p_groups` (paired send/receive, an
order that cannot deadlock under NCCL's in-order semantics) through :meth:`Comm.batch_p2p`, holding
sends until they are known complete, and counting the live buffers. Does not own the schedule or
its groups (core/schedule.py) or what a forward or backward does (stage.py).
"""

from __future__ import annotations

import time
import weakref

import torch

from nodetrain.core.schedule import Transfer
from nodetrain.engine.comm.comm import Comm, P2POp
from nodetrain.run.breakdown import NULL_TIMELINE

__all__ = ["P2P"]


class P2P:
    """Activations forward (stage s → s+1) and their gradients backward (s+1 → s), in paired groups.

    Each group of :func:`p2p_groups` is posted together through :meth:`Comm.batch_p2p`. A group
    with a receive is waited for (its data is needed next, in the ``bubble`` phase). A group of
    sends only is held until it is known complete: once a later group receiving from the same peer
    was waited (that peer posted the receive of every earlier send no later than it sent what
    arrived, true of ``p2p_groups``' order for every schedule, tests/dist/test_memory.py; so waiting the
    held send returns once its data is through), or as soon as ``is_completed()`` says so (NCCL; a
    gloo send reports completion only once waited), or at :meth:`wait_sends`. So each sent
    activation is let go during the step, not at its end. Tags (``2·mb`` activations,
    ``2·mb + 1`` gradients) match messages on gloo.

    The buffers it sends and the gradients it receives are counted while anything holds them (a
    weak reference each; received activations are the next block's saved inputs, not counted):
    :attr:`peak_buffers` and :attr:`peak_bytes` are their high-water mark since construction
    or :meth:`reset_peak`, which :func:`p2p_live_peak` predicts.

    Args:
        stage, num_stages: this rank's stage and the pipeline depth.
        shape: [B, T, D] of an activation; dtype: the compute dtype.
        comm: the rank's :class:`~nodetrain.engine.comm.Comm` (transfers on ``comm.device_of()``: the CPU
            for gloo, the CUDA device for NCCL).
        ranks: global rank of each stage of this pipeline (a replica, see replicas.py); default
            ``range(num_stages)`` (rank = stage).
        timeline: receives enter its ``bubble`` phase (breakdown.py); default: not timed.
    """

    def __init__(
        self,
        stage: int,
        num_stages: int,
        shape,
        dtype: torch.dtype,
        comm: Comm,
        ranks=None,
        timeline=NULL_TIMELINE,
    ):
        self.stage, self.num_stages = stage, num_stages
        self.ranks = list(range(num_stages)) if ranks is None else list(ranks)
        self.shape, self.dtype, self.comm = tuple(shape), dtype, comm
        self.device = comm.device_of()
        self._sends: list[tuple[int, list]] = []  # (peer rank, works) of groups of sends only
        self._live: list[tuple[weakref.ref, int]] = []  # counted buffers and their bytes
        self.peak_buffers = 0
        """Most counted buffers alive at once (on ``self.device``)."""
        self.peak_bytes = 0
        """Most bytes of counted buffers alive at once."""
        self.timeline = timeline
        self.wait_s = 0.0
        """Seconds spent blocked in receives (bubble + P2P) since :meth:`reset_timer`."""

    def exchange(
        self, group: tuple[Transfer, ...], out: torch.Tensor | None, mb_base: int, wave: int = 1
    ) -> torch.Tensor | None:
        """Post one group of :func:`p2p_groups`; returns the received tensor, if the group receives.

        Args:
            group: the transfers (item numbers within the round; an item is one micro-batch for W = 1).
            out: the previous action's output to send ([B, T, D], or an item's [W, B, T, D], compute
                dtype, any device).
            mb_base: index of the round's first item (tags are per step).
            wave: W, micro-batches per item (``pipeline.wave``): W > 1 receives [W, B, T, D].

        Returns:
            [B, T, D] (W = 1) or [W, B, T, D] in the compute dtype on ``self.device``, or None.
        """
        if not group:
            return None
        ops, buf, counted = [], None, []
        for t in group:
            tag = 2 * (mb_base + t.mb) + (t.what == "grad")
            if t.op == "send":
                data = out.to(self.device).contiguous()
                ops.append(P2POp("send", data, self.ranks[t.peer], tag))
                counted.append(data)
            else:
                shape = self.shape if wave == 1 else (wave, *self.shape)
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                ops.append(P2POp("recv", buf, self.ranks[t.peer], tag))
                counted += [buf] if t.what == "grad" else []
        self._count(counted)
        works = self.comm.batch_p2p(ops)
        if buf is None:
            self._keep(ops[0].peer, works)
            return None
        t0 = time.perf_counter()
        with self.timeline.phase("bubble"):
            for w in works:
                w.wait()
        self.wait_s += time.perf_counter() - t0
        self._release({o.peer for o in ops if o.op == "recv"})
        return buf

    def _count(self, tensors: list[torch.Tensor]) -> None:
        """Start counting ``tensors``; record the high-water mark of the buffers still alive."""
        self._live = [(r, n) for r, n in self._live if r() is not None]
        known = {id(r()) for r, _ in self._live}
        self._live += [(weakref.ref(x), x.nbytes) for x in tensors if id(x) not in known]
        self.peak_buffers = max(self.peak_buffers, len(self._live))
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self._live))

    def reset_peak(self) -> None:
        self.peak_buffers = self.peak_bytes = 0

    def _keep(self, peer: int, works: list) -> None:
        """Hold a group of sends only (to ``peer``), after letting go of those already complete."""
        self._sends = [(p, ws) for p, ws in self._sends if not self._done(ws)] + [(peer, works)]

    def _release(self, peers: set[int]) -> None:
        """A group receiving from ``peers`` completed: every held send to them is matched (see the
        class doc); wait for each (it raises a failed send's error) and let it go."""
        kept = []
        for peer, works in self._sends:
            if peer in peers:
                for w in works:
                    w.wait()
            elif not self._done(works):
                kept.append((peer, works))
        self._sends = kept

    @staticmethod
    def _done(works: list) -> bool:
        if not all(w.is_completed() for w in works):
            return False
        for w in works:
            w.wait()  # returns at once; raises the error of a failed send
        return True

    def wait_sends(self) -> None:
        for _, works in self._sends:
            for w in works:
                w.wait()
        self._sends.clear()

    def reset_timer(self) -> None:
        self.wait_s = 0.0
