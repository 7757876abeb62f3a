"""Host store: the node's one copy of the training state, in a shared-memory file.

Owns: the byte layout (per unit, page-aligned flat buffers: fp32 master weights, fp32 gradient
accumulator, AdamW ``exp_avg`` / ``exp_avg_sq``, the compute-dtype transfer copy, and for a
tied embedding a second gradient accumulator for its use on another stage), creating the file
once per node, mapping it in every rank, page-locking (CUDA) only the transfer copies a rank
loads, and removing it on every exit path.
Does not own: what the numbers mean (optim/, model/).

Lifecycle: local rank 0 removes stores of dead runs and creates ``nodetrain-<run id>-<pid>.store``
at its full size without allocating its pages, the other ranks map it, each rank allocates the
pages of its own units (``posix_fallocate`` of their byte ranges: first touch, by a thread already
bound to the rank's NUMA node, so each stage's units live on its GPU's node), and as soon as all
have done so the creator unlinks the name. The memory then lives exactly as long as the processes
that map it, so even ``kill -9`` cannot leak it; a store left between creation and that unlink
carries the creator's pid and is found at the next start.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "FIELDS",
    "LEAN_FIELDS",
    "LEAN_FORMATS",
    "STATES",
    "StoreLayout",
    "HostStore",
    "pid_alive",
    "remove_stale_stores",
]

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
FIELDS = ("master", "grad", "exp_avg", "exp_avg_sq", "compute")
LEAN_FIELDS = ("grad", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax", "compute")
"""``optim.state=lean`` (optim/lean.py): bf16 master = transfer copy, block-quantized moments."""
LEAN_FORMATS = {"exp_avg": (4, 128, True), "exp_avg_sq": (8, 2048, False)}
"""Lean moments: (bits, block elements, signed map) — Li et al. 2023 B128/DE for the first moment,
Dettmers et al. 2021's 8-bit block-wise format for the second."""
LEAN_MOMENT_FIELDS = ("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax")
STATES = ("full", "lean")
_NAME = re.compile(r"^nodetrain-(?P<run>.+)-(?P<pid>\d+)\.store$")


def _align(n: int) -> int:
    return (n + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


@dataclass(frozen=True)
class StoreLayout:
    """Byte offsets of every (unit, field) buffer; a pure function of unit sizes, so every rank
    computes the same layout without communication.

    Args:
        unit_numels: elements per unit.
        compute_dtype: dtype of the transfer copy (bf16 normally).
        tied_units: units used on two stages, which get a ``grad_tied`` accumulator.
        state: ``full`` (:data:`FIELDS`, 18 B/param with bf16) or ``lean`` (:data:`LEAN_FIELDS`, ~7.5).
    """

    unit_numels: tuple[int, ...]
    compute_dtype: torch.dtype
    tied_units: tuple[int, ...] = ()
    state: str = "full"

    def fields_of(self, unit: int) -> tuple[str, ...]:
        return (LEAN_FIELDS if self.state == "lean" else FIELDS) + (
            ("grad_tied",) if unit in self.tied_units else ()
        )

    def itemsize(self, name: str) -> int:
        return self.dtype(name).itemsize

    def dtype(self, name: str) -> torch.dtype:
        if name == "compute":
            return self.compute_dtype
        return torch.uint8 if self.state == "lean" and name in LEAN_FORMATS else torch.float32

    def numel(self, unit: int, name: str) -> int:
        """Elements of ``name``'s buffer of ``unit`` (a lean moment's codes and block scales are fewer)."""
        n = self.unit_numels[unit]
        if self.state == "lean":
            base = name.removesuffix("_absmax")
            if base in LEAN_FORMATS:
                bits, block, _ = LEAN_FORMATS[base]
                return -(-n // block) if name.endswith("_absmax") else -(-n * bits // 8)
        return n

    def field_nbytes(self, unit: int, name: str) -> int:
        """Bytes of ``name``'s buffer of ``unit``, before page alignment."""
        return self.numel(unit, name) * self.itemsize(name)

    @property
    def offsets(self) -> dict[tuple[int, str], int]:
        out, pos = {}, 0
        for u in range(len(self.unit_numels)):
            for name in self.fields_of(u):
                out[(u, name)] = pos
                pos += _align(self.field_nbytes(u, name))
        return out

    def unit_span(self, unit: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of ``unit``'s buffers in the file (page-aligned, contiguous)."""
        offsets = self.offsets
        start = offsets[(unit, self.fields_of(unit)[0])]
        last = self.fields_of(unit)[-1]
        return start, offsets[(unit, last)] + _align(self.field_nbytes(unit, last))

    @property
    def nbytes(self) -> int:
        """Total bytes of the store file."""
        return sum(
            _align(self.field_nbytes(u, f)) for u in range(len(self.unit_numels)) for f in self.fields_of(u)
        )


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (stale stores and run locks are a dead pid's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_stores(directory: str | Path, remove: bool = True) -> list[tuple[Path, int]]:
    """Find store files in ``directory`` whose creator process is dead; stores of live runs stay.

    A store file lives only between its creation and the moment every rank of its node has mapped
    it (then its creator unlinks the name), so a stale one is left by a run killed (``kill -9``, the
    OOM killer) during start-up. Each is logged with its path, size and dead pid.

    Args:
        remove: delete them (``store.cleanup_stale=true``); False = only report them.

    Returns:
        (path, size in bytes) of every stale store found.
    """
    found = []
    for path in Path(directory).glob("nodetrain-*.store"):
        m = _NAME.match(path.name)
        if m is None or pid_alive(int(m["pid"])):
            continue
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # another run's start-up removed it first
            continue
        if remove:
            path.unlink(missing_ok=True)
            log.warning(
                "removed stale host store %s (%.1f MB) of dead process %s", path, size / 1e6, m["pid"]
            )
        else:
            log.warning(
                "stale host store %s (%.1f MB) of dead process %s left in place (store.cleanup_stale=false); "
                "delete it to free its memory",
                path,
                size / 1e6,
                m["pid"],
            )
        found.append((path, size))
    return found


class HostStore:
    """One shared-memory file holding the layout's buffers, mapped without copies.

    Use :meth:`create` on local rank 0, :meth:`attach` on the others, then :meth:`unlink` on the
    creator once every rank has attached; :meth:`close` (or leaving a ``with`` block) ends this
    process's use of it: the name goes, the pinned ranges are released, and the store lets go of
    its mapping (the pages go once no view handed out, e.g. to a checkpoint writer, is alive).
    """

    def __init__(self, layout: StoreLayout, path: Path, owner: bool):
        self.layout = layout
        self.path = path
        self.owner = owner
        self._bytes = torch.from_file(str(path), shared=True, size=layout.nbytes, dtype=torch.uint8)
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        for (u, name), off in layout.offsets.items():
            raw = self._bytes[off : off + layout.field_nbytes(u, name)]
            self._views[(u, name)] = raw.view(layout.dtype(name))
        self._pinned: list[tuple[int, int]] = []  # (address, bytes) registered by this process

    @classmethod
    def create(
        cls,
        layout: StoreLayout,
        directory: str | Path,
        run_id: str,
        cleanup_stale: bool = True,
        populate: bool = True,
    ) -> HostStore:
        """Create the store file (zero-filled) and map it, after removing (or, with
        ``cleanup_stale=False``, reporting) the stale stores of dead runs in ``directory``.

        Args:
            populate: allocate every page now (one process uses the store); False = only size the
                file, and each rank then allocates its own units' pages with :meth:`populate`
                (first touch on its NUMA node). Pages never allocated are allocated at first access.

        Raises:
            OSError: the directory cannot hold ``layout.nbytes`` (e.g. /dev/shm too small; with
                ``populate=False`` :meth:`populate` raises it).
        """
        directory = Path(directory)
        remove_stale_stores(directory, remove=cleanup_stale)
        path = directory / f"nodetrain-{run_id}-{os.getpid()}.store"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _register_cleanup(path)
        try:
            if populate:
                os.posix_fallocate(fd, 0, layout.nbytes)
            else:
                os.ftruncate(fd, layout.nbytes)  # the size only: no page is allocated
        finally:
            os.close(fd)
        return cls(layout, path, owner=True)

    def populate(self, units, skip=()) -> None:
        """Allocate the pages of ``units``' buffers now, from this thread (``posix_fallocate`` of
        their byte ranges; the first touch, so the kernel places them on this thread's NUMA node
        under the default memory policy). Call before :meth:`unlink`, on the rank that owns them.

        Args:
            units: unit indices (a stage's own units).
            skip: field names whose pages are left unallocated (``store.tier=nvme``'s fields).

        Raises:
            OSError: the store's filesystem cannot hold them (e.g. /dev/shm too small).
        """
        spans = sorted(self.layout.unit_span(u) for u in set(units))
        if skip:
            offsets = self.layout.offsets
            spans = sorted(
                (offsets[(u, f)], offsets[(u, f)] + _align(self.layout.field_nbytes(u, f)))
                for u in set(units)
                for f in self.layout.fields_of(u)
                if f not in skip
            )
        fd = os.open(self.path, os.O_RDWR)
        try:
            for start, end in spans:
                try:
                    os.posix_fallocate(fd, start, end - start)
                except OSError as e:
                    raise OSError(
                        e.errno,
                        f"allocating {(end - start) / 1e6:.1f} MB of the host store {self.path} failed "
                        f"({os.strerror(e.errno)}): its filesystem needs {self.nbytes / 1e6:.1f} MB in all",
                    ) from e
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, layout: StoreLayout, path: str | Path) -> HostStore:
        """Map a store created by another rank of this node."""
        return cls(layout, Path(path), owner=False)

    def __enter__(self) -> HostStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unlink (the creator), unpin, and drop this object's mapping and views; idempotent. Any
        buffer access afterwards raises ``KeyError``."""
        self.unlink()
        self.unpin()
        self._views.clear()
        self._bytes = None

    @property
    def closed(self) -> bool:
        return self._bytes is None

    def unlink(self) -> None:
        """Remove the file name; the memory stays until the last rank unmaps it."""
        if self.owner:
            self.path.unlink(missing_ok=True)

    def pin(self, units) -> None:
        """Page-lock (``cudaHostRegister``) the transfer copy (``compute``) of ``units``: the only
        store bytes a rank's H2D copies read (its gradients land in page-locked staging buffers
        and are accumulated by the host, staging.py). One range per unit, page-aligned as stored;
        at 70B this is ~1/8 of the 140 GB transfer copy per rank of 8, instead of the whole 1.24 TB
        store in each. Released by :meth:`unpin` (cudaHostRegister'd pages stay locked until then).

        Args:
            units: unit indices (this rank's blocks' bindings, the tied embedding included).

        Raises:
            RuntimeError: a registration failed (the ranges registered so far are released first).
        """
        cudart = torch.cuda.cudart()
        for u in sorted(set(units)):
            view = self._views[(u, "compute")]
            addr, size = view.data_ptr(), _align(view.numel() * view.element_size())
            err = int(cudart.cudaHostRegister(addr, size, 0))
            if err != 0:
                self.unpin()
                raise RuntimeError(
                    f"cudaHostRegister of unit {u}'s transfer copy ({size / 1e6:.1f} MB at {addr:#x}) failed "
                    f"with CUDA error {err}: the host store must be page-locked for asynchronous copies; "
                    "check `ulimit -l` (locked memory) and free host memory"
                )
            self._pinned.append((addr, size))
        if self._pinned:
            log.info(
                "page-locked %.1f MB of the host store (%d ranges)",
                self.pinned_nbytes / 1e6,
                len(self._pinned),
            )

    def is_pinned(self, unit: int) -> bool:
        """Whether CUDA reports the transfer copy (``compute``) of ``unit`` as page-locked, asked at
        the view's own first and last byte. ``Tensor.is_pinned()`` of the view would ask about its
        storage's start, the store's whole mapping, which :meth:`pin` never registers. False
        without CUDA."""
        view = self._views[(unit, "compute")]
        last = view.numel() * view.element_size() - 1
        return all(_page_locked(view.data_ptr() + off) for off in (0, last))

    @property
    def pinned_nbytes(self) -> int:
        """Bytes this process has registered with :meth:`pin` and not yet released."""
        return sum(size for _, size in self._pinned)

    def unpin(self) -> None:
        """Release every range :meth:`pin` registered (``cudaHostUnregister``); idempotent."""
        while self._pinned:
            addr, _ = self._pinned.pop()
            torch.cuda.cudart().cudaHostUnregister(addr)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def buffer(self, unit: int, name: str) -> torch.Tensor:
        """Flat buffer ``[unit numel]`` of ``name`` (fp32, or the compute dtype for ``compute``)."""
        return self._views[(unit, name)]

    def master(self, unit: int) -> torch.Tensor:
        return self._views[(unit, "master")]

    def grad(self, unit: int) -> torch.Tensor:
        return self._views[(unit, "grad")]

    def compute(self, unit: int) -> torch.Tensor:
        return self._views[(unit, "compute")]


def _page_locked(addr: int) -> bool:
    """Whether CUDA reports the host byte at ``addr`` as page-locked (``cudaPointerGetAttributes``,
    through ``Tensor.is_pinned`` of a one-byte tensor whose storage starts there)."""
    return torch.frombuffer((ctypes.c_uint8 * 1).from_address(addr), dtype=torch.uint8).is_pinned()


_CLEANUP: list[Path] = []


def _cleanup() -> None:
    for path in _CLEANUP:
        path.unlink(missing_ok=True)


def _on_sigterm(signum, frame):  # unwind normally so finally-blocks and atexit run
    raise SystemExit(128 + signum)


def _register_cleanup(path: Path) -> None:
    if not _CLEANUP:
        atexit.register(_cleanup)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
    _CLEANUP.append(path)
