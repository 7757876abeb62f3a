"""A Hydra job's identity and life cycle, for single runs and ``--multirun`` sweeps under torchrun.

``torchrun --nproc_per_node 2 -m nodetrain.train --multirun optim.lr=1e-3,3e-4`` runs Hydra's basic
sweeper in every rank: each rank runs job 0, then job 1, in the same process, sharing one process
group (``run.process_group.init_distributed`` creates it once). The job directory,
``<sweep dir>/<job num>``, is resolved identically on all ranks (``hydra.sweep.dir`` uses
``${nt_run_id:}``, see config.run_id).

Owns: the :class:`Job` (run directory, an id unique per job for the host store's file name, the
wandb group and name), the failure policy of a sweep under torchrun (:func:`fail_fast`), and the
check that a finished job let go of its host store mapping and threads (:class:`Release`), and the
refusal of a launch into a live run's directory before Hydra writes there (:class:`LiveRunGuard`), and
the process's exit once its jobs are done (:func:`exit_process`). Does not own: the training
(train.py) or the wandb calls (metrics.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from nodetrain.checkpoint.state import CheckpointError
from nodetrain.config.checks import DataError
from nodetrain.config.disk import DiskFullError
from nodetrain.config.schema import ConfigError, LoggingConfig
from nodetrain.run.faults import record_failure
from nodetrain.run.metrics import to_log_files
from nodetrain.run.outputs import check_writable, refuse_if_held, refuse_overwrite

__all__ = [
    "REFUSALS",
    "Job",
    "current_job",
    "swept_name",
    "fail_fast",
    "refusals_of",
    "LiveRunGuard",
    "Release",
    "mapped",
]

REFUSALS: tuple[type[ValueError], ...] = (ConfigError, DataError, CheckpointError, DiskFullError)
"""Errors that refuse a run the user must fix (config, data, checkpoints, output directories, a full
disk mid-run): their message says what and how, so they are reported without a traceback. Anything
else is a bug and keeps its traceback."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One training job: a single run, or one job of a sweep.

    Attributes:
        run_dir: the job's output directory, shared by all its ranks.
        id: unique per job (names the host store file): the run directory's name, prefixed with its
            parent's name when it is a sweep's numbered job directory (``multirun_<id>_0``).
        group: wandb group (the sweep), or None.
        name: wandb run name.
    """

    run_dir: Path
    id: str
    group: str | None
    name: str

    @classmethod
    def plain(cls, run_dir: Path, logging_cfg: LoggingConfig | None = None) -> Job:
        """A job outside Hydra's multirun (a single run, or a sweep launcher's child run)."""
        run_dir = Path(run_dir)
        cfg = logging_cfg or LoggingConfig()
        job_id = f"{run_dir.parent.name}_{run_dir.name}" if run_dir.name.isdigit() else run_dir.name
        return cls(run_dir, job_id, cfg.group or None, cfg.name or run_dir.name)


def swept_name(job_overrides: Sequence[str], argv: Sequence[str] | None = None) -> str:
    """A sweep job's name from the overrides the sweep varies, e.g. ``optim.lr=0.001``.

    Args:
        job_overrides: the job's overrides (``hydra.overrides.task``: one value per key).
        argv: the command line that started the sweep (default ``sys.argv[1:]``); its sweep
            overrides (``key=a,b``, ``range(...)``, ...) name the keys that vary.

    Returns:
        The job's overrides of the swept keys joined by ``,``; "" when none is found.
    """
    parser, swept = OverridesParser.create(), set()
    for token in sys.argv[1:] if argv is None else argv:
        if "=" not in token or token.startswith("-"):
            continue
        try:
            override = parser.parse_override(token)
        except HydraException:  # not an override (the value of a --flag): ignore it
            continue
        if override.is_sweep_override():
            swept.add(override.key_or_group)
    return ",".join(o for o in job_overrides if parser.parse_override(o).key_or_group in swept)


def current_job(logging_cfg: LoggingConfig) -> Job:
    """The job Hydra is running now (call inside the ``@hydra.main`` task function).

    In a multirun the job directory is ``<sweep dir>/<num>``; its wandb group defaults to the sweep
    directory's name and its name to the job's values of the swept keys (``optim.lr=0.001``, see
    :func:`swept_name`), else Hydra's ``override_dirname``.
    """
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    if hc.mode != RunMode.MULTIRUN:
        return Job.plain(run_dir, logging_cfg)
    sweep = Path(hc.sweep.dir).name
    name = logging_cfg.name or swept_name(list(hc.overrides.task)) or hc.job.override_dirname
    return Job(run_dir, f"{sweep}_{hc.job.num}", logging_cfg.group or sweep, name or f"{sweep}/{hc.job.num}")


@contextlib.contextmanager
def refusals_of(kinds: tuple[type[BaseException], ...], as_kind: type[ValueError]):
    """Turn ``kinds`` raised inside the block into ``as_kind`` refusals (same message, the original
    chained), e.g. a missing data file (``FileNotFoundError``) into a ``DataError``."""
    try:
        yield
    except REFUSALS:
        raise
    except kinds as e:
        raise as_kind(str(e)) from e


REFUSAL_GRACE_S = 3.0
"""Seconds a rank other than 0 waits before it exits on a refusal that every rank makes (they all check
the same config): rank 0, which prints the message, then ends first, so torchrun's SIGTERM to the ranks
still running never cuts rank 0 off before it printed (torchrun stops the others once one exits)."""


def _let_rank0_end_first() -> None:
    """Before a refused rank exits: rank 0 goes at once, the others wait :data:`REFUSAL_GRACE_S`."""
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(REFUSAL_GRACE_S)


def _report_refusal(e: BaseException) -> None:
    """Rank 0 prints the refusal once, with a pointer; every rank keeps it (and the traceback, for
    whoever debugs nodetrain) in its own log file; torchrun's summary gets a pointer, not a traceback."""
    message = f"{type(e).__name__}: {e}"
    rank = int(os.environ.get("RANK", "0"))
    where = "its log"
    with contextlib.suppress(ValueError):  # outside a Hydra job: no run directory to name
        where = f"{HydraConfig.get().runtime.output_dir}/rank<N>.log"
    when = "the run stopped" if isinstance(e, DiskFullError) else "refused before training"
    if rank == 0:
        log.error("%s\n%s; fix it and launch again (logs: %s)", message, when, where)
    else:
        to_log_files(logging.ERROR, message, log)
    to_log_files(logging.INFO, "where it was raised:\n" + traceback.format_exc(), log)
    record_failure(e, callstack=f"{type(e).__name__}, a refusal: rank 0 printed the message above")


@contextlib.contextmanager
def fail_fast():
    """Turn a refused or failed job into the end of the process.

    A refusal (:data:`REFUSALS`: the user's config, data or outputs) is printed once, by rank 0,
    without a traceback, and every rank exits with status 1. A bug keeps its traceback: under torchrun
    (world > 1) Hydra's multirun would catch a job's exception and start the next job, and ranks of a
    distributed job that failed on one rank would then meet in different collectives and wait forever
    (DESIGN invariant 7). So the traceback is logged and written to torchrun's error file (its summary
    names this rank as the root cause), and ``SystemExit(1)`` (not an ``Exception``, so Hydra lets it
    through) ends this rank; torchrun then stops the others. One process: the bug is re-raised.
    """
    try:
        yield
    except REFUSALS as e:
        _report_refusal(e)
        _let_rank0_end_first()
        raise SystemExit(1) from None
    except Exception as e:
        record_failure(e)  # torchrun's failure summary then shows this traceback as the root cause
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            raise
        log.error("job failed; ending this rank so that no rank waits:\n%s", traceback.format_exc())
        raise SystemExit(1) from None


class LiveRunGuard(Callback):
    """Hydra callback (``hydra.callbacks.live_run`` in conf/config.yaml): refuse a single run whose
    ``hydra.run.dir`` a live run holds (outputs.LOCK_NAME), or that would start from scratch in a run
    directory holding an earlier run (outputs.refuse_overwrite), or that cannot be created or
    written (a runs root that is a file or read-only), before Hydra overwrites that run's
    ``.hydra/`` snapshot and appends to its ``rank<N>.log`` files (``run_job`` does both before the
    task function, where outputs.RunOutputs would refuse it too late) or fails with an ``OSError``.

    Rank 0 (``RANK``) prints the refusal once to stderr, without a traceback; every rank exits 1
    (``SystemExit``: Hydra's callbacks turn an ``Exception`` into a warning)."""

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        run_dir, c = Path(config.hydra.run.dir), config.checkpoint
        try:
            refuse_if_held("hydra.run.dir", run_dir)
            refuse_overwrite(
                run_dir, Path(c.dir).expanduser() if c.dir else run_dir / "checkpoints", c.resume
            )
            check_writable("hydra.run.dir", run_dir)  # as Hydra would create it, with the reason if not
        except ConfigError as e:
            message = f"{type(e).__name__}: {e}"
            if int(os.environ.get("RANK", "0")) == 0:
                print(
                    f"{message}\nrefused before Hydra wrote to that directory; nothing was changed there",
                    file=sys.stderr,
                    flush=True,
                )
            record_failure(e, callstack=f"{type(e).__name__}, a refusal: rank 0 printed the message above")
            _let_rank0_end_first()
            raise SystemExit(1) from None


def mapped(path: str | Path) -> bool | None:
    """Whether this process maps ``path`` (an unlinked file shows as ``path (deleted)``); None where
    ``/proc/self/maps`` does not exist."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    target = str(path)
    return any(line.split(None, 5)[5:] and line.split(None, 5)[5].startswith(target) for line in maps.open())


_PROCESS_THREADS = ("wandb", "Otel", "tqdm_monitor")
"""Name prefixes of threads a library keeps for the whole process: not a job's leak."""


class Release:
    """Checks that a job let go of what it held, before the next job of a sweep starts.

    Create it when the job starts; call :meth:`check` with the host store's path once the engine
    is closed and dropped. A leak is logged as a warning (a sweep would otherwise hold one store per
    finished job). Threads a library keeps for the process (wandb's, tqdm's monitor; see
    ``_PROCESS_THREADS``) are not counted.
    """

    def __init__(self) -> None:
        self._threads = set(threading.enumerate())

    def check(self, store_path: str | Path) -> tuple[bool | None, list[str]]:
        """Returns (whether the store is still mapped, names of threads started by the job and alive)."""
        still = mapped(store_path)
        # wandb's service threads live as long as the process and serve the next job's run too.
        new = [t for t in threading.enumerate() if t not in self._threads and t.is_alive()]
        # so do the OpenTelemetry exporter threads wandb starts with its first run (Otel*), and tqdm's
        # process-wide monitor thread (tqdm_monitor), which `datasets` starts with its first bar.
        threads = sorted(t.name for t in new if not t.name.startswith(_PROCESS_THREADS))
        if still or threads:
            log.warning("job left behind: store %s mapped=%s, threads %s", store_path, still, threads)
        else:
            log.info("job released: host store %s unmapped, no threads left", store_path)
        return still, threads


def exit_process(code: int = 0) -> None:
    """End the process now, after its ``atexit`` handlers, without the interpreter's teardown.

    For the end of a command-line run whose jobs are done and released: the ``atexit`` handlers run
    as at a normal exit (logging's flush and close, the host store's unlink, wandb's, finalizers
    registered with ``weakref.finalize``), then the standard streams are flushed and ``os._exit``
    skips the teardown of every imported module, which after torch and transformers costs about
    0.8 s of one core per process (measured: 0.82 s of finalization after 0.014 s of ``atexit``
    handlers) and adds nothing a finished run needs.

    Args:
        code: the exit status.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
