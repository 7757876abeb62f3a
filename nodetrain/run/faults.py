"""What a run does when something goes wrong: signals, non-finite steps, failures.

Owns:
    :class:`StopRequest`  SIGINT/SIGTERM in every phase of a run. During set-up (data preparation,
        building the store) a signal ends the launch at once (:class:`Stopped`: nothing to save yet).
        In the training loop (``deferred()``) it sets a flag instead of killing the rank mid-step;
        the engine adds the flag to the step's one all-reduce (engine.py), an evaluation asks every
        rank between its batches (:meth:`StopRequest.agreed`), and a wait for a checkpoint write
        says at once that it finishes the write first (checkpoint/writer.py), so every rank stops
        after the same step (then saves, if ``checkpoint.on_signal=save``). A second signal more
        than ``FORCE_AFTER_S`` after the first ends the rank at once, saying what was not saved.
    :class:`BadSteps`  counts steps whose loss or gradient norm was NaN/inf (the engine skipped
        their update on every stage) and ends the run after ``train.max_bad_steps`` in a row.
    :func:`record_failure`  the failing rank's traceback into torchrun's error file, so torchrun's
        summary names it as the root cause.
    :func:`stop_with_launcher`  a rank whose torchrun launcher dies (``kill -9``) gets SIGTERM from
        the kernel and stops as on any SIGTERM, instead of training on unsupervised.

Does not own: the exit of the other ranks when one fails (torchrun's agent terminates them; every
collective and receive is bounded by ``dist.timeout_s``, train.py), the store's removal (store.py),
or the test-only faults (run/inject.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from nodetrain.checkpoint.collective import all_gather_json

__all__ = [
    "FORCE_AFTER_S",
    "BadSteps",
    "NonFiniteError",
    "StopRequest",
    "Stopped",
]
__all__ += ["record_failure", "stop_with_launcher"]

log = logging.getLogger(__name__)

FORCE_AFTER_S = 2.0
"""A signal this long after the first one ends the rank at once. Shorter gaps are the same request
delivered twice: Ctrl-C reaches every rank from the terminal and again from torchrun's agent."""

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class NonFiniteError(RuntimeError):
    """``train.max_bad_steps`` consecutive steps had a NaN/inf loss or gradient norm."""


class Stopped(SystemExit):
    """A signal ended the launch (exit status 128 + the signal number); the log says what was saved."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class StopRequest:
    """A context manager that turns SIGINT/SIGTERM into a stop request, in every phase of a run.

    Inside the ``with`` block, outside :meth:`deferred`: the first signal raises :class:`Stopped`
    at once (set-up: nothing to save yet, finally-blocks run). Inside :meth:`deferred` (the training
    loop, evaluations, checkpoint waits): the first signal only sets :attr:`signum`; the loop passes
    :attr:`requested` to ``Engine.train_step``, whose all-reduce tells every rank, and the loop ends
    after that step; an evaluation asks :meth:`agreed` between batches. A second signal more than
    ``FORCE_AFTER_S`` after the first raises :class:`Stopped` at once, logging ``unsaved()`` (what is
    lost). Outside the block the previous handlers apply. Only the main thread can install handlers;
    elsewhere the block does nothing.

    Args:
        unsaved: called on a second signal: what ending now loses, for the log line.
    """

    def __init__(self, unsaved=None) -> None:
        self.signum: int | None = None
        """The first signal received, or None."""
        self.group = None
        """The gloo group :meth:`agreed` asks on (set by the caller once the process group exists)."""
        self.unsaved = unsaved or (lambda: "nothing saved after the newest checkpoint")
        """Called on a second signal: what ending now loses (the caller sets it once it knows)."""
        self._first_s = 0.0
        self._deferring = False
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        del frame
        now, name = time.monotonic(), signal.Signals(signum).name
        if self.signum is None:
            self.signum, self._first_s = signum, now
            if not self._deferring:
                log.warning("%s: stopping before training started (nothing to save)", name)
                raise Stopped(signum)
            log.warning("%s: stop requested; every rank stops after a step they agree on", name)
        elif now - self._first_s > FORCE_AFTER_S:  # asked twice: stop now, without the clean stop
            log.warning(
                "%s again: ending this rank now, without the clean stop: no checkpoint of the step in "
                "progress is written (%s)",
                name,
                self.unsaved(),
            )
            raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self):
        """Inside: a first signal only sets the flag (see the class docstring)."""
        self._deferring = True
        try:
            yield self
        finally:
            self._deferring = False

    def agreed(self) -> bool:
        """Whether any rank of :attr:`group` was asked to stop (collective; every rank calls it at the
        same point). Without a group: this rank's own flag."""
        if self.group is None:
            return self.requested
        return any(all_gather_json(self.requested, self.group))

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in _SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class BadSteps:
    """Consecutive and total counts of skipped (non-finite) steps.

    Args:
        max_in_a_row: ``train.max_bad_steps``; :meth:`check` raises when this many steps in a row
            were skipped.
    """

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.in_a_row = 0

    def count(self, skipped: bool) -> None:
        self.total += int(skipped)
        self.in_a_row = self.in_a_row + 1 if skipped else 0

    def check(self, step: int) -> None:
        """Raises:
        NonFiniteError: the last ``max_in_a_row`` steps up to ``step`` (1-based) were all skipped.
        """
        if self.in_a_row >= self.max_in_a_row:
            first = step - self.in_a_row + 1
            raise NonFiniteError(
                f"train.max_bad_steps={self.max_in_a_row}: steps {first}-{step} all had a NaN/inf loss or "
                "gradient norm, so their updates were skipped (the weights are those after step "
                f"{first - 1}, except that with optim.update_in_backward and no clipping the finite units "
                "of those steps were updated); fix: lower optim.lr, use optim.max_grad_norm > 0, "
                "train.dtype=bfloat16 instead of float16, or check the data"
            )


_PEER_FAILED = re.compile(r"(closed|reset) by peer|Broken pipe|Connection refused|remote process exited")
"""Communication errors that only say another rank went away (gloo and NCCL wording)."""


def record_failure(exc: BaseException, callstack: str | None = None) -> None:
    """Write ``exc`` and its traceback (or ``callstack`` in its place) to torchrun's error file
    (``TORCHELASTIC_ERROR_FILE``; nothing outside torchrun), which torchrun's failure summary prints,
    naming the earliest as root cause.

    torchrun orders failures by whole seconds, and the ranks that lose their connection to a failed
    rank fail within milliseconds of it. Such a consequence is stamped one second later so that the
    rank that failed first stays the root cause.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = int(time.time()) + (1 if _PEER_FAILED.search(str(exc)) else 0)
    callstack = callstack or "".join(traceback.format_exception(exc))
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(stamp)},
        }
    }  # the layout of torch.distributed.elastic's ErrorHandler.record_exception
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:  # the summary is a convenience: never let it hide the real error
        log.exception("could not write torchrun's error file %s", path)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def stop_with_launcher() -> bool:
    """Under torchrun on Linux: have the kernel send this rank SIGTERM when its parent (the torchrun
    agent) dies, e.g. by ``kill -9``, which forwards nothing. The rank then stops as on any SIGTERM:
    inside the training loop every rank stops after the same step (and saves, with
    ``checkpoint.on_signal=save``); before it, the process ends and its store goes with it.

    ``prctl(PR_SET_PDEATHSIG)`` fires when the thread that started the rank exits; torchrun starts
    its ranks from its main thread, which lives as long as the agent. A parent that died before this
    call is caught by ``getppid() == 1`` (the rank was re-parented to init).

    Returns:
        True when the death signal is armed (False outside torchrun or Linux, or if prctl failed).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): this rank outlives its launcher", ctypes.get_errno()
        )
        return False
    if os.getppid() == 1:
        log.error("the torchrun launcher is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)
    return True
