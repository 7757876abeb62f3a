"""The tier's file: where ``store.tier=nvme`` keeps the fields only the optimizer update touches.

Owns: the file's byte layout (:class:`TierLayout`: per unit, the page-aligned extents of those fields
(cost/tier.py :data:`TIER_FIELDS`) in the host store, packed in unit order), the file's lifecycle (created and
fully allocated by local rank 0, opened by every rank, its name removed once all have opened it, as the
store's), and the checked I/O of one unit between the file and its store range (:class:`TierFile`). Does not
own when a unit is read or written back (tier.py), the config checks (config/tier_checks.py) or the store
(store.py).

The pool: ``store.tier_buffers`` slots of page-aligned host memory (a ``memfd``, allocated once, each
slot as large as the largest unit's tier fields). A unit's tier ranges in the store are never backed
by the store's own pages: while the unit holds a slot, the slot is mapped over them (``mmap
MAP_FIXED``), so every view of the store the optimizer built reads and writes the slot; otherwise
they are mapped ``PROT_NONE`` (a stray access faults instead of reading stale state). Re-mapping
costs a system call, not the allocation and zeroing of fresh pages.

I/O: ``os.preadv`` / ``os.pwrite`` straight between the file and the mapped slot, with ``O_DIRECT``
where the filesystem allows (tmpfs refuses it: then buffered I/O with ``posix_fadvise(DONTNEED)``
after each write, logged). Every read and write is checked: a short transfer or an errno raises
:class:`TierIOError` naming the file, the offset and the errno.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from nodetrain.cost.tier import TIER_FIELDS
from nodetrain.store import PAGE_BYTES, StoreLayout, pid_alive

__all__ = ["TIER_FIELDS", "TierIOError", "TierLayout", "TierFile", "remove_stale_tiers"]

log = logging.getLogger(__name__)

_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE, _MAP_POPULATE = 0, 0x10, 0x4000, 0x8000  # <sys/mman.h>, Linux
_NAME = re.compile(r"^nodetrain-(?P<run>.+)-(?P<pid>\d+)\.tier$")


class TierIOError(OSError):
    """A read or write of the tier failed or came up short (errno, file and offset in the message)."""


def _align(n: int) -> int:
    return (n + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


@dataclass(frozen=True)
class TierLayout:
    """Per unit, the extents ``(field names, store offset, bytes)`` of its tier fields (consecutive
    fields of the store merged, page-aligned) and where each lies in the file; pure arithmetic on the
    store layout, the same on every rank.

    Args:
        store: the host store's layout (``state`` picks :data:`TIER_FIELDS`).
    """

    store: StoreLayout

    @property
    def fields(self) -> tuple[str, ...]:
        return TIER_FIELDS[self.store.state]

    def extents(self, unit: int) -> list[tuple[tuple[str, ...], int, int]]:
        """``[(fields, store offset, bytes)]`` of ``unit``: runs of tier fields adjacent in the store."""
        offsets, out = self.store.offsets, []
        for name in self.store.fields_of(unit):
            if name not in self.fields:
                continue
            off, n = offsets[(unit, name)], _align(self.store.field_nbytes(unit, name))
            if out and out[-1][1] + out[-1][2] == off:
                names, start, size = out[-1]
                out[-1] = ((*names, name), start, size + n)
            else:
                out.append(((name,), off, n))
        return out

    def unit_nbytes(self, unit: int) -> int:
        return sum(n for _, _, n in self.extents(unit))

    def file_offset(self, unit: int) -> int:
        return sum(self.unit_nbytes(u) for u in range(unit))

    @property
    def nbytes(self) -> int:
        """Bytes of the tier file (every unit's tier fields, page-aligned)."""
        return sum(self.unit_nbytes(u) for u in range(len(self.store.unit_numels)))


def remove_stale_tiers(directory: str | Path) -> list[Path]:
    """Remove tier files in ``directory`` whose creator is dead (a run killed during start-up, before
    every rank had opened the file and its name went); logged with path and size."""
    found = []
    for path in Path(directory).glob("nodetrain-*.tier"):
        m = _NAME.match(path.name)
        if m is None or pid_alive(int(m["pid"])):
            continue
        size = path.stat().st_size if path.exists() else 0
        path.unlink(missing_ok=True)
        log.warning("removed stale tier file %s (%.1f MB) of dead process %s", path, size / 1e6, m["pid"])
        found.append(path)
    return found


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return libc


class TierFile:
    """One node's tier file, open in this rank, and the checked I/O of a unit's tier fields.

    Use :meth:`create` on local rank 0, :meth:`open` on the others, :meth:`unlink` on the creator once
    every rank has opened it, :meth:`close` at the end.

    Args:
        layout: the tier layout; store: the host store whose ranges the I/O reads into and writes from.
        path: the file; owner: this rank created it (and removes the name).
        pwrite: ``pwrite(fd, buffer, offset) -> bytes written`` (``Faults.tier_pwrite``: os.pwrite,
            or a failure a test injects).
    """

    def __init__(self, layout: TierLayout, store, path: Path, owner: bool, pwrite=os.pwrite):
        self.layout, self.store, self.path, self.owner = layout, store, Path(path), owner
        self._pwrite = pwrite
        self._libc = _libc()
        self._pool_fd, self.slot_bytes = (
            -1,
            max(layout.unit_nbytes(u) for u in range(len(layout.store.unit_numels))),
        )
        try:
            self.fd, self.direct = os.open(self.path, os.O_RDWR | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.fd, self.direct = os.open(self.path, os.O_RDWR), False
            log.warning(
                "store.tier_dir=%s refuses O_DIRECT (tmpfs?): the tier uses buffered I/O with "
                "posix_fadvise(DONTNEED) after each write",
                self.path.parent,
            )

    @classmethod
    def create(cls, layout: TierLayout, store, directory: str | Path, run_id: str, pwrite=os.pwrite):
        """Create the tier file with every byte allocated (``posix_fallocate``: a full disk is refused
        here, before the first step, and no write-back can run out of space later).

        Raises:
            TierIOError: the directory cannot hold ``layout.nbytes`` (ENOSPC) or another errno.
        """
        remove_stale_tiers(directory)
        path = Path(directory) / f"nodetrain-{run_id}-{os.getpid()}.tier"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if layout.nbytes:
                os.posix_fallocate(fd, 0, layout.nbytes)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise TierIOError(
                e.errno,
                f"allocating the tier file {path} ({layout.nbytes / 1e6:.1f} MB) failed: "
                f"{os.strerror(e.errno)} (errno {e.errno}); free space in store.tier_dir or use tier=ram",
            ) from e
        os.close(fd)
        return cls(layout, store, path, True, pwrite)

    @classmethod
    def open(cls, layout: TierLayout, store, path: str | Path, pwrite=os.pwrite):
        """Open a tier file another rank of this node created."""
        return cls(layout, store, Path(path), False, pwrite)

    def unlink(self) -> None:
        """Remove the name (the creator); the bytes stay until the last rank closes its descriptor."""
        if self.owner:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Close this rank's descriptors (and remove the name, the creator); idempotent. The pool's
        pages go when the store's mapping goes."""
        self.unlink()
        for name in ("fd", "_pool_fd"):
            if getattr(self, name) >= 0:
                os.close(getattr(self, name))
                setattr(self, name, -1)

    def open_pool(self, buffers: int, units) -> None:
        """Allocate the pool (``buffers`` slots) and map this rank's ``units``' tier ranges
        ``PROT_NONE``. Raises OSError: the pool cannot be allocated (host memory)."""
        self._pool_fd = os.memfd_create("nodetrain-tier-pool", 0)
        os.ftruncate(self._pool_fd, buffers * self.slot_bytes)
        os.posix_fallocate(self._pool_fd, 0, buffers * self.slot_bytes)
        for u in units:
            self.unmap_unit(u)

    def map_unit(self, unit: int, slot: int) -> None:
        """Map pool slot ``slot`` over ``unit``'s tier ranges of the store (its bytes are the slot's)."""
        at = slot * self.slot_bytes
        for _buf, addr, n, _pos in self._extents(unit):
            # populated: its page tables filled at once, not one fault per page during the read
            rw, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_POPULATE
            self._mmap(addr, n, rw, flags, self._pool_fd, at)
            at += n

    def unmap_unit(self, unit: int) -> None:
        """Map ``unit``'s tier ranges ``PROT_NONE`` (no pages; an access faults)."""
        for _buf, addr, n, _pos in self._extents(unit):
            self._mmap(addr, n, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)

    def _mmap(self, addr: int, n: int, prot: int, flags: int, fd: int, offset: int) -> None:
        got = self._libc.mmap(addr, n, prot, flags | _MAP_FIXED, fd, offset)
        if got != addr:
            e = ctypes.get_errno()
            raise OSError(e, f"mmap of {n} bytes of the tier's range at {addr:#x}: {os.strerror(e)}")

    def _extents(self, unit: int):
        """``(memoryview of the store range, file offset)`` per extent of ``unit``."""
        pos = self.layout.file_offset(unit)
        for names, _off, n in self.layout.extents(unit):
            addr = self.store.buffer(unit, names[0]).data_ptr()
            yield (ctypes.c_char * n).from_address(addr), addr, n, pos
            pos += n

    def read_unit(self, unit: int) -> None:
        """Read ``unit``'s tier fields from the file into their store ranges.

        Raises:
            TierIOError: an errno or a short read (file, offset and errno named).
        """
        for buf, _addr, _n, pos in self._extents(unit):
            self._read(memoryview(buf).cast("B"), pos, unit)

    def write_unit(self, unit: int) -> None:
        """Write ``unit``'s tier fields from their (mapped) store ranges to the file, then unmap them
        (:meth:`unmap_unit`: the slot is free).

        Raises:
            TierIOError: an errno or a short write (file, offset and errno named); the slot stays mapped.
        """
        for buf, _addr, n, pos in self._extents(unit):
            view, done = memoryview(buf).cast("B"), 0
            while done < n:
                try:
                    k = self._pwrite(self.fd, view[done:], pos + done)
                except OSError as e:
                    raise self._error("write", unit, pos + done, e.errno) from e
                if k <= 0:
                    raise self._error("write", unit, pos + done, errno.ENOSPC, short=True)
                done += k
            if not self.direct:
                os.posix_fadvise(self.fd, pos, n, os.POSIX_FADV_DONTNEED)
        self.unmap_unit(unit)

    def zero_unit(self, unit: int) -> None:
        """Zero ``unit``'s (mapped) tier ranges: a fresh unit's state (start-up, before it is filled)."""
        for buf, _addr, _n, _pos in self._extents(unit):
            ctypes.memset(buf, 0, len(buf))

    def read_copy(self, unit: int) -> dict[str, torch.Tensor]:
        """``unit``'s tier fields read from the file into private memory (checkpoint save): name ->
        flat tensor of the store's dtype and numel.

        Raises:
            TierIOError: as :meth:`read_unit`.
        """
        out, pos = {}, self.layout.file_offset(unit)
        layout = self.layout.store
        for names, _off, n in self.layout.extents(unit):
            raw = torch.empty(n + PAGE_BYTES, dtype=torch.uint8)  # aligned inside for O_DIRECT
            start = -raw.data_ptr() % PAGE_BYTES
            chunk = raw[start : start + n]
            self._read(memoryview(chunk.numpy()), pos, unit)
            at = 0
            for name in names:
                size = layout.field_nbytes(unit, name)
                out[name] = chunk[at : at + size].view(layout.dtype(name)).clone()
                at += _align(size)
            pos += n
        return out

    def _read(self, view: memoryview, pos: int, unit: int) -> None:
        done, n = 0, len(view)
        while done < n:
            try:
                k = os.preadv(self.fd, [view[done:]], pos + done)
            except OSError as e:
                raise self._error("read", unit, pos + done, e.errno) from e
            if k <= 0:
                raise self._error("read", unit, pos + done, errno.EIO, short=True)
            done += k

    def _error(self, what: str, unit: int, offset: int, code: int, short: bool = False) -> TierIOError:
        how = "came up short" if short else "failed"
        return TierIOError(
            code,
            f"tier {what} of unit {unit} {how}: file {self.path}, offset {offset}, errno {code} "
            f"({errno.errorcode.get(code, '?')}: {os.strerror(code)})",
        )
