"""A full filesystem, told apart from other write errors.

Owns: :class:`DiskFullError` (the refusal a run raises when a directory it writes fills up:
``checkpoint.dir``, ``data.dir``, the run directory's ``metrics.jsonl``) and :func:`is_disk_full`,
which recognises ENOSPC/EDQUOT however a library reports it. Does not own: the checks of free space
before a run (run/outputs.py) or what each writer keeps intact (their modules).
"""

from __future__ import annotations

import errno
import re

__all__ = ["DiskFullError", "is_disk_full"]


class DiskFullError(ValueError):
    """A filesystem the run writes to is full (or over its quota); the message names the key, the path,
    the bytes needed and free, and what was kept."""


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = re.compile(
    rf"os error ({'|'.join(str(n) for n in _FULL_ERRNOS)})\b|No space left|quota exceeded"
)
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile on a full disk (no errno)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says a write found no space: ``OSError`` with
    ENOSPC/EDQUOT, a safetensors error quoting that ``os error``, or numpy's short-write message."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if _FULL_TEXT.search(str(exc)) or (isinstance(exc, OSError) and _SHORT_WRITE.search(str(exc))):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
