"""A run's claim on its output directories: ownership locks, foreign checkpoints, writable and big enough.

Owns: before the host store exists, on global rank 0 —
    * a lock file (:data:`LOCK_NAME`) in the run directory and in ``checkpoint.dir``, held (``flock``)
      for the run's life and removed on every exit path (:meth:`RunOutputs.release` in a ``finally``);
      the kernel lets go of the lock of a process that dies (``kill -9``, the OOM killer), so such a
      stale file is taken over with a warning that names its dead pid (``store.pid_alive``, as the
      host store's stale files are reported); a live holder refuses the run, naming it;
    * refusing to write into a ``checkpoint.dir`` that holds another run's checkpoints, unless this
      run resumes them (``checkpoint.resume``);
    * refusing a launch from scratch into a run directory that holds an earlier run's results
      (:func:`refuse_overwrite`: its ``metrics.jsonl`` and ``.hydra/`` would be rewritten);
    * that every output directory can be created and written (the lock file is the probe; the
      host store's ``store.dir`` too, :func:`check_writable`), and that ``checkpoint.dir`` has free
      space for one checkpoint (:func:`checkpoint_bytes`).
Does not own: what a checkpoint holds (nodetrain/checkpoint/), the host store's own checks
(plan.preflight), or the data directory (nodetrain/data/datasets.py).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from nodetrain.checkpoint import state as st
from nodetrain.checkpoint.writer import EXPORT_DTYPES
from nodetrain.config.schema import Config, ConfigError
from nodetrain.model import HFModel
from nodetrain.run.metrics import METRICS_FILE, read_rows
from nodetrain.store import pid_alive

__all__ = [
    "LOCK_NAME",
    "RunOutputs",
    "checkpoint_bytes",
    "checkpoint_dir",
    "check_space",
    "check_writable",
    "refuse_if_held",
    "refuse_overwrite",
    "run_to_continue",
]

log = logging.getLogger(__name__)

LOCK_NAME = ".nodetrain.lock"
"""The lock file in an owned directory: JSON with the owner's pid, host, run dir, config hash, start."""


def checkpoint_dir(cfg: Config, run_dir: Path) -> Path:
    """``checkpoint.dir``, or ``<run_dir>/checkpoints`` when it is empty."""
    return Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def checkpoint_bytes(model: HFModel, export_dtype: str) -> int:
    """Bytes of one checkpoint's tensor files: per parameter the export copy, the fp32 master (unless
    the export is fp32: the export is then the master), ``exp_avg`` and ``exp_avg_sq`` (fp32), plus
    one fp32 update count per tensor; JSON files and safetensors headers (a few kB) are not counted."""
    numel = sum(u.numel for u in model.units)
    tensors = sum(len(u.params) for u in model.units)
    export = EXPORT_DTYPES[export_dtype].itemsize
    master = 0 if export == 4 else 4
    return numel * (export + master + 8) + tensors * 4


def refuse_if_held(key: str, directory: Path) -> None:
    """Refuse ``directory`` when a live process holds its lock file, creating and writing nothing
    (a shared, non-blocking ``flock`` on an existing lock file): the check of a launch's run directory
    before Hydra writes its ``.hydra/`` snapshot and rank logs there (jobs.LiveRunGuard).

    Raises:
        ConfigError: another live run holds ``directory`` (the refusal :meth:`RunOutputs.acquire`
            gives, naming that run).
    """
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file (or none readable): acquire() decides later
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        _refuse(key, path)
    finally:
        os.close(fd)  # also lets go of the shared lock, if taken


def refuse_overwrite(run_dir: Path, ckpt_dir: Path, resume: str) -> None:
    """Refuse a launch that would start from scratch in a run directory holding an earlier run's
    results (a non-empty ``metrics.jsonl``): it would rewrite that run's ``metrics.jsonl`` and
    ``.hydra/``. A launch that resumes a checkpoint (``checkpoint.resume=<step-N>``, or ``auto`` with
    a complete checkpoint in ``ckpt_dir``) continues it and may. Called before Hydra writes
    (jobs.LiveRunGuard) and again at :meth:`RunOutputs.acquire`.

    Raises:
        ConfigError: naming the run (its last step), why this launch starts from scratch, and the
            two ways on: a new run directory, or ``checkpoint.resume=auto`` where its checkpoints are.
    """
    metrics = Path(run_dir) / METRICS_FILE
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return
    if resume not in ("", "auto") or (resume == "auto" and st.complete_checkpoints(ckpt_dir)):
        return
    steps = [rec.get("step") for _, rec in read_rows(metrics) if isinstance(rec.get("step"), int)]
    what = f"{len(steps)} row(s) up to step {max(steps)}" if steps else "rows"
    why = (
        f"checkpoint.resume=auto finds no checkpoint in {ckpt_dir}"
        if resume == "auto"
        else "checkpoint.resume is empty"
    )
    raise ConfigError(
        f"hydra.run.dir={run_dir}: holds an earlier run ({METRICS_FILE}: {what}), and this launch would "
        f"start from scratch there ({why}), overwriting its {METRICS_FILE} and .hydra/; start fresh in a "
        "new run directory (leave hydra.run.dir unset, or name a new one), or continue that run with "
        "checkpoint.resume=auto (and checkpoint.dir=<the directory holding its step-N> if they moved)"
    )


def check_writable(key: str, directory: Path, create: bool = True) -> None:
    """Refuse an output directory that cannot be created (``create``) or written: a file is created and
    removed in it.

    Raises:
        ConfigError: naming ``key``, the path and the system's reason (read-only, not a directory, ...).
    """
    directory = Path(directory).expanduser()
    if not create and not directory.is_dir():
        raise ConfigError(f"{key}={directory}: not a directory; create it or point {key} at one")
    _writable(key, directory)


def check_space(directory: Path, nbytes: int, key: str) -> None:
    """Raises:
    ConfigError: ``directory`` has less than ``nbytes`` free (``shutil.disk_usage``), naming ``key``,
        the path and both numbers.
    """
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise ConfigError(
            f"{key}={directory}: a checkpoint needs {nbytes / 1e6:,.1f} MB but the filesystem has "
            f"{free / 1e6:,.1f} MB free, so the first save would fail; free space there or point {key} "
            "at a larger filesystem"
        )


class RunOutputs:
    """The output directories one run writes: ``hydra.run.dir`` and ``checkpoint.dir``.

    Build it on every rank; :meth:`acquire` on global rank 0 only (it raises there, before any
    allocation), :meth:`release` on every rank in a ``finally`` (a no-op where nothing is held).

    Args:
        run_dir: the run directory.
        ckpt_dir: the checkpoint directory (:func:`checkpoint_dir`).
        resume: ``checkpoint.resume`` ("" = a fresh run).
        config_hash: this run's config hash (``state.config_hash`` of the resolved config).
    """

    def __init__(self, run_dir: Path, ckpt_dir: Path, resume: str, config_hash: str) -> None:
        self.run_dir, self.ckpt_dir = Path(run_dir), Path(ckpt_dir)
        self.resume, self.config_hash = resume, config_hash
        self._held: list[tuple[Path, int]] = []  # (lock file, its open, flock-ed descriptor)

    def _owned(self) -> list[tuple[str, Path]]:
        # checkpoint.dir is locked even inside the run directory: a run continuing this one
        # (resume=auto) locks only the checkpoints, and must meet this run's lock there
        return [("hydra.run.dir", self.run_dir), ("checkpoint.dir", self.ckpt_dir)]

    def acquire(self, resolved: dict[str, Any] | None = None, search: bool = False) -> str:
        """Create and lock every output directory, then check ``checkpoint.dir``'s contents.

        Args:
            resolved: this run's resolved config (to name what differs in another run's config).
            search: ``checkpoint.resume=auto`` with ``checkpoint.dir`` unset: when this run's directory
                holds no checkpoint, continue the newest run under the runs root (the run
                directory's parent) whose checkpoints have this config hash (:func:`run_to_continue`).

        Returns:
            The checkpoint directory this run reads and writes (another run's when it continues one).

        Raises:
            ConfigError: a directory cannot be created or written; another live run holds it;
                ``checkpoint.dir`` holds checkpoints this run would overwrite without resuming them; or
                the run directory holds an earlier run this launch would start over
                (:func:`refuse_overwrite`).
        """
        refuse_overwrite(self.run_dir, self.ckpt_dir, self.resume)
        if search and not st.complete_checkpoints(self.ckpt_dir):
            self.ckpt_dir = run_to_continue(self.run_dir, self.config_hash, resolved) or self.ckpt_dir
        if self.resume == "auto" and not st.complete_checkpoints(self.ckpt_dir):
            log.warning(
                "checkpoint.resume=auto: no checkpoint of this config (hash %s) in %s%s: starting from "
                "scratch",
                self.config_hash[:12],
                self.ckpt_dir,
                f" or under {self.run_dir.parent}" if search else "",
            )
        try:
            for key, path in self._owned():
                self._lock(key, path)
            self._check_foreign()
        except BaseException:
            self.release()
            raise
        return str(self.ckpt_dir)

    def release(self) -> None:
        """Remove the lock files this process holds and let go of them (idempotent)."""
        for path, fd in self._held:
            path.unlink(missing_ok=True)  # while still locked: no one takes the name in between
            os.close(fd)
        self._held.clear()

    def _lock(self, key: str, directory: Path) -> None:
        _writable(key, directory)
        path = directory / LOCK_NAME
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "run_dir": str(self.run_dir),
            "config_hash": self.config_hash,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        for _ in range(10):
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                _refuse(key, path)
            if not path.exists() or os.fstat(fd).st_ino != os.stat(path).st_ino:
                os.close(fd)  # its holder removed it meanwhile: lock the file now at that name
                continue
            _report_stale(key, path)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(mine).encode())
            self._held.append((path, fd))
            return
        raise ConfigError(f"{key}={directory}: could not take {path}; retry, or delete it if no run uses it")

    def _check_foreign(self) -> None:
        found = st.complete_checkpoints(self.ckpt_dir)
        if not found or self._resumes_them():
            return
        newest = found[-1][1]
        owner = _read_json(newest / st.TRAINER_STATE)
        other = owner.get("config_hash", "?")
        same = other == self.config_hash
        tag = " (the same config)" if same else ""
        names = ", ".join(p.name for _, p in found)
        # resume=auto fits only the same config ("does not fit this model" otherwise): offer it then only
        fix = (
            "continue that run with checkpoint.resume=auto, or set another checkpoint.dir"
            if same
            else "its config differs, so this run cannot resume it: set another checkpoint.dir"
        )
        raise ConfigError(
            f"checkpoint.dir={self.ckpt_dir}: holds {names} of another run (run dir "
            f"{owner.get('run_dir', 'unknown')}, config hash {other[:12]}{tag}), "
            f"which this run (config hash {self.config_hash[:12]}) would overwrite; {fix} (or move those "
            "checkpoints away)"
        )

    def _resumes_them(self) -> bool:
        if self.resume == "auto":
            return True
        if not self.resume:
            return False
        return Path(self.resume).expanduser().resolve().parent == self.ckpt_dir.resolve()


def run_to_continue(run_dir: Path, config_hash: str, resolved: dict[str, Any] | None = None) -> Path | None:
    """The ``checkpoints`` directory of the newest other run under ``run_dir``'s parent whose newest
    complete checkpoint has ``config_hash``, or None (then the newest run with checkpoints of another
    config is named, with what differs, at WARNING)."""
    found, others = [], []
    for ckpts in Path(run_dir).parent.glob(f"*/{_CHECKPOINTS}"):
        done = st.complete_checkpoints(ckpts)
        if not done or ckpts.parent.resolve() == Path(run_dir).resolve():
            continue
        state_file = done[-1][1] / st.TRAINER_STATE
        state = _read_json(state_file)
        (found if state.get("config_hash") == config_hash else others).append(
            (state_file.stat().st_mtime, ckpts, state)
        )
    if found:
        _, ckpts, state = max(found, key=lambda f: f[0])
        log.warning(
            "checkpoint.resume=auto: continuing run %s from its step %s (same config hash %s); its "
            "checkpoints go on in %s, this launch's logs and metrics are in %s",
            ckpts.parent,
            state.get("step"),
            config_hash[:12],
            ckpts,
            run_dir,
        )
        return ckpts
    if others and resolved is not None:
        _, ckpts, state = max(others, key=lambda f: f[0])
        diff = "; ".join(st.config_differences(state.get("config", {}), resolved)) or "?"
        log.warning(
            "checkpoint.resume=auto: the newest run with checkpoints, %s, has another config (%s); to "
            "continue it anyway pass hydra.run.dir=%s",
            ckpts.parent,
            diff,
            ckpts.parent,
        )
    return None


_CHECKPOINTS = "checkpoints"


def _writable(key: str, directory: Path) -> None:
    """Raises ConfigError when ``directory`` cannot be created or a file written in it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".nodetrain-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{key}={directory}: cannot write there ({type(e).__name__}: {e.strerror or e}); "
            f"point {key} at a writable directory"
        ) from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _report_stale(key: str, path: Path) -> None:
    """Warn about a lock file left with content by a run that did not remove it (``kill -9``, OOM)."""
    owner = _read_json(path)
    pid = owner.get("pid")
    if isinstance(pid, int):
        dead = "dead " if owner.get("host") == socket.gethostname() and not pid_alive(pid) else ""
        log.warning(
            "%s=%s: taking over the lock of %sprocess %d (run dir %s, started %s), which did not release it",
            key,
            path.parent,
            dead,
            pid,
            owner.get("run_dir"),
            owner.get("started"),
        )


def _refuse(key: str, path: Path) -> None:
    """Raise the refusal of a directory whose lock a live process holds, naming that run."""
    owner = _read_json(path)
    pid, host = owner.get("pid"), owner.get("host")
    if not owner:  # its holder is writing it right now
        raise ConfigError(
            f"{key}={path.parent}: another run is starting there ({path}); use another directory"
        )
    raise ConfigError(
        f"{key}={path.parent}: another run is writing there (run dir {owner.get('run_dir')}, pid {pid} on "
        f"{host}, config hash {str(owner.get('config_hash'))[:12]}, started {owner.get('started')}); wait "
        "for it to end or use another directory"
    )
