"""The engine's collectives and P2P transfers, each tensor checked against the device its group serves.

Owns: the one place where the training path calls ``torch.distributed`` with a tensor (all-reduce,
paired send/receive), and the rule that every such tensor lives on the device the process group
serves: the rank's CUDA device for NCCL (which has no CPU backend: a CPU tensor fails with "No
backend type associated with device type cpu"), the CPU for gloo. A wrong device raises here, on
every backend, so the CPU test suite catches what would only fail on a GPU node. Does not own:
object collectives (``*_object``: torch moves their bytes to the current device itself), barriers,
or checkpointing's JSON exchange (its own gloo group, CPU tensors, checkpoint/collective.py).

P2P goes through ``dist.batch_isend_irecv`` only: the sends and receives of one group are posted
together, as ``torch.distributed.pipelining`` and Megatron-LM's ``p2p_communication`` do, so that a
stage's "send my activation, receive the next gradient" cannot wait on its own order (NCCL ignores
tags and runs a rank pair's operations in order; see pipeline.p2p_groups).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

__all__ = ["Comm", "P2POp", "WrongDevice"]


class WrongDevice(RuntimeError):
    """A tensor handed to a collective or P2P is not on the device its process group serves."""


@dataclass(frozen=True)
class P2POp:
    """One half of a transfer: ``op`` is "send" or "recv"; ``peer`` a global rank; ``tensor`` the
    data (send) or the buffer it lands in (recv); ``tag`` separates messages on gloo (NCCL ignores it)."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


class Comm:
    """Collectives and P2P of one rank, on the device each group serves.

    Args:
        device: the rank's compute device (``cuda:<local rank>`` on a GPU node, else CPU).
        dist: the ``torch.distributed`` module (tests pass a recorder).

    Attributes:
        calls: when not ``None``, each call appends ``(name, group, thread name)`` (tests).
    """

    def __init__(self, device: torch.device, dist=torch_dist):
        self.device = torch.device(device)
        self.dist = dist
        self.calls: list[tuple[str, object, str]] | None = None

    def device_of(self, group=None) -> torch.device:
        """The device whose tensors ``group`` (``None``: the default group) reduces and transfers.

        Raises:
            WrongDevice: an NCCL group on a rank whose compute device is not a CUDA device.
        """
        backend = str(self.dist.get_backend(group)).lower()
        if backend == "nccl":
            if self.device.type != "cuda":
                raise WrongDevice(
                    f"an NCCL process group serves CUDA tensors, but this rank computes on {self.device}"
                )
            return self.device
        return torch.device("cpu")

    def _check(self, name: str, tensors: Sequence[torch.Tensor], group) -> None:
        want = self.device_of(group)
        for t in tensors:
            if t.device != want:
                raise WrongDevice(
                    f"{name}: tensor on {t.device}, but its process group ({self.dist.get_backend(group)}) "
                    f"serves {want}: allocate it with Comm.device_of(group)"
                )
        if self.calls is not None:
            self.calls.append((name, group, threading.current_thread().name))

    def tensor(self, values: Sequence[float], dtype: torch.dtype = torch.float64, group=None) -> torch.Tensor:
        """``values`` as a 1-D tensor on the device ``group`` serves (for :meth:`all_reduce`)."""
        return torch.tensor(list(values), dtype=dtype, device=self.device_of(group))

    def all_reduce(self, t: torch.Tensor, group=None) -> None:
        """Sum ``t`` over ``group`` in place (blocking).

        Raises:
            WrongDevice: ``t`` is not on ``device_of(group)``.
        """
        self._check("all_reduce", [t], group)
        self.dist.all_reduce(t, group=group)

    def batch_p2p(self, ops: Sequence[P2POp]) -> list:
        """Post ``ops`` together (``dist.batch_isend_irecv`` on the default group); returns their works.

        Raises:
            WrongDevice: a tensor is not on the default group's device.
            ValueError: an op other than "send"/"recv".
        """
        if not ops:
            return []
        self._check("batch_p2p", [o.tensor for o in ops], None)
        fns = {"send": self.dist.isend, "recv": self.dist.irecv}
        bad = [o.op for o in ops if o.op not in fns]
        if bad:
            raise ValueError(f"P2P op {bad[0]!r}: use 'send' or 'recv'")
        return self.dist.batch_isend_irecv(
            [self.dist.P2POp(fns[o.op], o.tensor, o.peer, tag=o.tag) for o in ops]
        )
