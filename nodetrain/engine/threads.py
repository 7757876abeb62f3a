"""Who a thread is, and the debug check that a piece of step state is written by its one owner.

Owns: the role of each of a rank's threads (``training``, ``h2d``, ``d2h``, ``optimizer``, ``tier``: the
thread table in engine.py says what each alone writes), :func:`check_writer`, which in debug mode
asserts that the calling thread is the owner of the state it writes, and :class:`Tally`, the one
kind of state several threads add to (busy seconds, bytes), behind a lock. Does not own the threads
(window.py's copy workers, overlap.py's optimizer thread) or what they run.

Debug mode: ``NODETRAIN_CHECK_THREADS=1`` in the environment at import (the test suite sets it,
tests/conftest.py), or :func:`set_checking`. Off, :func:`check_writer` is one global read.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

__all__ = ["ROLES", "Tally", "check_writer", "checked", "checking", "role", "set_checking", "set_role"]

ROLES = ("training", "h2d", "d2h", "optimizer", "tier")
"""Every thread of a rank that writes step state; any thread without a role is the training thread."""

_local = threading.local()
_checking = os.environ.get("NODETRAIN_CHECK_THREADS", "") == "1"
_checked: Counter = Counter()  # debug mode: (owner, what) -> writes checked
_checked_lock = threading.Lock()


def set_role(name: str) -> None:
    """Name the calling thread's role (a worker's initializer calls it once)."""
    assert name in ROLES, name
    _local.role = name


def role() -> str:
    """The calling thread's role (``training`` unless :func:`set_role` named another)."""
    return getattr(_local, "role", "training")


def set_checking(on: bool) -> bool:
    """Turn the writer check on or off; returns the previous setting."""
    global _checking
    previous, _checking = _checking, on
    return previous


def checking() -> bool:
    return _checking


def check_writer(owner: str, what: str) -> None:
    """Debug mode: assert that the calling thread is ``owner``, the one thread that writes ``what``.

    Raises:
        AssertionError: in debug mode, another thread is writing ``what``.
    """
    if not _checking:
        return
    if role() != owner:
        raise AssertionError(f"{what} is written by the {owner} thread only, not by the {role()} thread")
    with _checked_lock:
        _checked[(owner, what)] += 1


def checked(reset: bool = False) -> Counter:
    """Debug mode: how many writes of each (owner, what) were checked (and passed) so far."""
    with _checked_lock:
        out = Counter(_checked)
        if reset:
            _checked.clear()
    return out


class Tally:
    """Counters any thread adds to (each add under the lock) and the training thread takes."""

    def __init__(self, *names: str) -> None:
        self._names = names
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name] += value

    def take(self) -> dict[str, float]:
        """The counts since the last take, reset to 0."""
        check_writer("training", "a tally's take")
        with self._lock:
            out, self._values = self._values, dict.fromkeys(self._names, 0)
        return out
