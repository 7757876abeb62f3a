"""Where a run's numbers go: ``metrics.jsonl``, wandb and a progress line, on one rank only.

Owns: the record sink (one JSON object per logged step, flushed line by line; a row the disk had no
room for is cut back, never left torn, reported as :attr:`MetricsLogger.failed` and kept in
:attr:`MetricsLogger.unwritten`, which the next checkpoint carries (``rows_to_carry``) and a resume
from it writes back (``carried``); a torn last row an older crash left is dropped with a warning
when a launch resumes), the wandb run's life cycle
(init with project/entity/group/name/tags/notes and the resolved config, log, finish; resume by id)
and the progress line (console, and the run's ``rank<N>.log``). Does not own: computing the numbers
(throughput, MFU and the stall/bubble/optimizer breakdown are measured by breakdown.py and passed in
as record fields), or deciding which rank logs (the caller passes ``enabled``, normally ``rank == 0``).

    with MetricsLogger(run_dir, cfg_dict, enabled=rank == 0, use_wandb=True, project="nodetrain",
                       run_name=run_dir.name, total_steps=300) as metrics:
        metrics.log({"step": 1, "loss": 8.3, "lr": 1.5e-4, "grad_norm": 2.1,
                     "tokens": 2048, "tokens_per_s": 9100.0})
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from rich.console import Console

from nodetrain.config.disk import DiskFullError, is_disk_full

__all__ = ["METRICS_FILE", "MetricsLogger", "eta_seconds", "format_progress", "read_rows", "to_log_files"]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
"""Name of the per-run record file under the run directory."""


def _jsonable(value: Any) -> Any:
    """A JSON-safe copy: tensors/numpy values to Python numbers or lists, NaN/inf to null, paths to str."""
    if hasattr(value, "tolist") and callable(value.tolist):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def format_progress(
    record: dict[str, Any], total_steps: int, elapsed_s: float | None = None, eta_s: float | None = None
) -> str:
    """One progress line, e.g. ``step  10/300   3% | 0:00:41 elapsed | ETA 0:19:49 | loss 4.1234 |
    lr 3.00e-03 | 9,100 tok/s | mfu 31.0% | cmp 80% stall 5% d2h 1% opt 2% bub 12%`` (the last part:
    the shares of ``step_s`` of the breakdown's phases).

    Args:
        record: a logged record; ``step`` is required, the other fields are shown when present.
        total_steps: steps of the whole run, shown after the slash and as the percentage done.
        elapsed_s: wall seconds since the first step of this run (or of its resume) began; shown when
            given.
        eta_s: wall seconds the remaining steps are expected to take; shown when given.
    """
    width = len(str(total_steps))
    parts = [f"step {record['step']:>{width}}/{total_steps} {record['step'] / max(total_steps, 1):>4.0%}"]
    for seconds, label in ((elapsed_s, "{} elapsed"), (eta_s, "ETA {}")):
        if _is_number(seconds) and math.isfinite(seconds):
            parts.append(label.format(datetime.timedelta(seconds=round(seconds))))
    fields = (
        ("loss", "loss {:.4f}"),
        ("val_loss", "val {:.4f}"),
        ("lr", "lr {:.2e}"),
        ("grad_norm", "gnorm {:.3f}"),
        ("tokens_per_s", "{:,.0f} tok/s"),
        ("mfu", "mfu {:.1%}"),
    )
    for key, fmt in fields:
        value = record.get(key)
        if _is_number(value):
            parts.append(fmt.format(value))
    step_s = record.get("step_s")
    shares = [(name, record.get(f"{key}_s")) for name, key in _SHARES]
    if _is_number(step_s) and step_s > 0 and all(_is_number(v) for _, v in shares):
        parts.append(" ".join(f"{name} {v / step_s:.0%}" for name, v in shares))
    return " | ".join(parts)


def eta_seconds(elapsed_s: float, steps_done: int, steps_left: int) -> float:
    """Seconds the ``steps_left`` remaining steps take at the mean wall time of the ``steps_done``
    steps of ``elapsed_s`` (evaluation and checkpoint stalls included); NaN before the first step."""
    return elapsed_s / steps_done * steps_left if steps_done > 0 else math.nan


_SHARES = (("cmp", "compute"), ("stall", "stall"), ("d2h", "d2h_wait"), ("opt", "optim"), ("bub", "bubble"))
"""Progress-line label and breakdown phase (``<phase>_s`` keys) of each share of the step time."""


def to_log_files(level: int, message: str, logger: logging.Logger = log) -> None:
    """Log ``message`` to this process's log files only (Hydra's ``rank<N>.log``), not the console."""
    record = logger.makeRecord(logger.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _open_history(run_dir: Path, history: Path | None, start_step: int | None, carried) -> Path:
    """The run's ``metrics.jsonl`` ready to append to: copied from ``history`` (a resumed run's) when
    the run directory has none, cut after ``start_step``, the rows a checkpoint ``carried`` written back."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / METRICS_FILE
    new = not path.exists()
    if history is not None and Path(history).is_file() and new:
        shutil.copyfile(history, path)  # truncated to start_step just below
        new = False
    if start_step is not None and path.is_file():
        _truncate_after(path, start_step)
    if start_step is not None and carried:
        _restore(path, carried, start_step, new)
    return path


class MetricsLogger:
    """Appends each record to ``<run_dir>/metrics.jsonl``, sends it to wandb and prints a progress line.

    Every method is a cheap no-op when ``enabled`` is False, so all ranks can hold one and only
    the logging rank (rank 0) pays for files, wandb and printing. Usable as a context manager;
    ``close`` is idempotent.

    Args:
        run_dir: the run directory (created if missing); wandb writes under ``run_dir/wandb``.
        config: the resolved config as a plain dict, stored as the wandb run's config.
        enabled: whether this process logs at all (normally ``rank == 0``).
        use_wandb: also log to wandb; the mode comes from env ``WANDB_MODE``, else ``offline``.
        project: wandb project.
        run_name: wandb run name (normally the run directory's name).
        total_steps: steps of the whole run, for the progress line.
        print_every: print the progress line every this many steps (and whenever the record has a
            ``val_loss`` or is the last step); records are always written.
        group: wandb group (a sweep's jobs share one), or None.
        tags, notes, entity: wandb run tags, free-text notes and entity ("" = the account's default).
        resume_id: continue the wandb run with this id (``resume="allow"``: created if it does not
            exist), e.g. the :attr:`run_id` kept in a checkpoint; None = a new run.
        start_step: the step this launch starts after (a resume's checkpoint step; 0 = from
            scratch): rows an earlier launch wrote for later steps (or, from scratch, any row) are
            dropped, so the file holds one row per step; None = append to the file as it is.
        history: the ``metrics.jsonl`` of the run this launch continues from another directory
            (``checkpoint.resume=auto`` finding an earlier run, see outputs.py): when this run has
            no file yet, its rows up to ``start_step`` start this run's file, so one file holds
            the whole curve; None = none.
        carried: rows the checkpoint this launch resumes carried (:meth:`rows_to_carry`): those of
            steps up to ``start_step`` the file lacks (a full disk refused them, the launch ended
            before writing them, or this is a new run directory) are written first.
        write: ``write(file, data, step) -> bytes written`` (``Faults.metrics_write``: the file's
            write, or a full disk a test injects); None = the file's.
    """

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        *,
        enabled: bool,
        use_wandb: bool,
        project: str,
        run_name: str,
        total_steps: int,
        print_every: int = 1,
        group: str | None = None,
        tags: list[str] | tuple[str, ...] = (),
        notes: str = "",
        entity: str = "",
        resume_id: str | None = None,
        start_step: int | None = None,
        history: Path | None = None,
        carried: list[dict[str, Any]] = (),
        write=None,
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.print_every = max(1, print_every)
        self.path: Path | None = None
        self._file: IO[bytes] | None = None
        self._run: Any = None
        self.run_id: str | None = None
        """The wandb run's id (keep it in a checkpoint to continue the run), or None without wandb."""
        self._console: Console | None = None
        self.failed: str | None = None
        """Why a row could not be written (the filesystem is full), or None; no row is written after."""
        self.unwritten: list[dict[str, Any]] = []
        """The rows of trained steps a full disk refused (JSON-safe), for the next checkpoint to carry."""
        self._write = write or (lambda file, data, step: file.write(data))
        self._start_s = time.monotonic()
        self._first_step: int | None = None  # the step before the first logged training step
        if not enabled:
            return
        self.path = _open_history(Path(run_dir), history, start_step, carried)
        self._file = self.path.open("ab", buffering=0)  # unbuffered: a failed row is cut back exactly
        self._console = Console(highlight=False, soft_wrap=True)
        if use_wandb:
            self._run = _init_wandb(
                run_dir,
                config,
                project=project,
                name=run_name,
                group=group or None,
                tags=list(tags) or None,
                notes=notes or None,
                entity=entity or None,
                id=resume_id or None,
                resume="allow" if resume_id else None,
            )
        self.run_id = getattr(self._run, "id", None)

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (at least ``step``; normally also loss, lr, grad_norm, tokens,
        tokens_per_s, and val_loss when evaluated; with a router auxiliary loss, ``loss`` includes
        ``router_aux_loss_coef · aux_loss`` and ``aux_loss`` is a field of its own, as transformers'
        ``outputs.loss`` and ``outputs.aux_loss``: see ``train._record``).

        Raises:
            KeyError: the record has no ``step``.
        """
        if self._file is None:
            return
        step = int(record["step"])
        clean = _jsonable(record)
        if self.failed is not None or not self._append(
            (json.dumps(clean, allow_nan=False) + "\n").encode(), step
        ):
            self.unwritten.append(clean)
            return
        if self._run is not None:
            self._run.log({k: v for k, v in clean.items() if v is not None}, step=step)
        now_s = time.monotonic()
        if self._first_step is None and step > 0:  # a resumed run's ETA counts only its own steps
            self._first_step, self._start_s = step - 1, now_s - float(clean.get("step_s") or 0)
        if step % self.print_every == 0 or step == self.total_steps or clean.get("val_loss") is not None:
            assert self._console is not None
            elapsed_s = eta_s = None  # none before the first training step (an evaluation at step 0)
            if self._first_step is not None:
                elapsed_s = now_s - self._start_s
                eta_s = eta_seconds(elapsed_s, step - self._first_step, self.total_steps - step)
            line = format_progress(clean, self.total_steps, elapsed_s, eta_s)
            self._console.print(line)
            to_log_files(logging.INFO, line)  # rank0.log holds the progress lines too

    def _append(self, row: bytes, step: int) -> bool:
        """Write one row whole or not at all: on a full disk, cut the file back to where the row began
        and set :attr:`failed` (the caller stops the run). Returns whether the row was written."""
        assert self._file is not None
        start = os.lseek(self._file.fileno(), 0, os.SEEK_END)
        try:
            view = memoryview(row)
            while view:
                view = view[self._write(self._file, view, step) :]
        except OSError as e:
            os.ftruncate(self._file.fileno(), start)
            if not is_disk_full(e):
                raise
            free = shutil.disk_usage(self.path.parent).free
            left = self.total_steps - step + 1
            self.failed = (
                f"hydra.run.dir={self.path.parent}: the filesystem is full: the row of step {step} in "
                f"{METRICS_FILE} needs {len(row):,} bytes ({free:,} free; the {left} remaining steps' rows "
                f"need about {left * len(row) / 1e6:,.2f} MB, and the logs and wandb more), so the run "
                "stopped after it (the rows before it are intact); free space there and relaunch with "
                "checkpoint.resume=auto"
            )
            log.error("%s", self.failed)
            return False
        return True

    def rows_to_carry(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """What a checkpoint saved after ``record``'s step carries of ``metrics.jsonl`` (JSON-safe): the
        rows a full disk refused and ``record``'s own, not yet written when the checkpoint is, so a
        resume from it loses no trained step's row (``carried``)."""
        return [*self.unwritten, _jsonable(record)] if self.enabled else []

    def raise_if_failed(self, kept: str = "") -> None:
        """Raise the refusal of a row that could not be written, adding ``kept`` (e.g. the newest
        checkpoint) to its message.

        Raises:
            DiskFullError: a row could not be written (:attr:`failed`), naming the path and the bytes.
        """
        if self.failed is not None:
            raise DiskFullError(f"{self.failed}; {kept}" if kept else self.failed)

    def close(self, exit_code: int = 0) -> None:
        """Close ``metrics.jsonl`` and finish the wandb run; later calls do nothing.

        Args:
            exit_code: reported to wandb (non-zero marks the run failed).
        """
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=exit_code)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def read_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a ``metrics.jsonl`` as (line, parsed record). A last line that does not parse (a
    write cut short: a full disk, a crash) is torn: dropped with a warning; so is any other line that
    does not parse, naming its line number."""
    lines, rows = path.read_text(encoding="utf-8", errors="replace").splitlines(), []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError:
            what = "a torn last row (a write cut short)" if n == len(lines) else "a row that is not JSON"
            log.warning("%s: dropping line %d, %s: %.80r", path, n, what, line)
            continue
        rows.append((line, rec))
    return rows


def _restore(path: Path, carried: list[dict[str, Any]], start_step: int, new: bool = False) -> None:
    """Append the ``carried`` rows of steps up to ``start_step`` that ``path`` lacks, in step order.
    ``new``: the run directory had no ``metrics.jsonl`` (a resume into a new run directory), so the
    rows are missing for that reason, not because a full disk refused them."""
    present = {rec.get("step") for _, rec in read_rows(path)} if path.is_file() else set()
    wanted = [r for r in carried if r.get("step", 0) <= start_step and r.get("step") not in present]
    missing = sorted(wanted, key=lambda r: r["step"])
    if not missing:
        return
    why = (
        "a resume into a new run directory, whose metrics.jsonl starts with them; the checkpoint "
        "carries no earlier step's row"
        if new
        else "the file lacks them: a full disk refused them, or the launch ended before writing them"
    )
    log.warning(
        "%s: writing the row(s) of step(s) %s the checkpoint of step %d carried (%s)",
        path,
        ", ".join(str(r["step"]) for r in missing),
        start_step,
        why,
    )
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in missing))


def _truncate_after(path: Path, start_step: int) -> None:
    """Keep only rows of steps <= ``start_step`` (none when 0: a run from scratch logs step 0
    again), and no torn or unreadable line; rewritten atomically (temp file, rename)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = read_rows(path)
    keep = [ln for ln, rec in rows if start_step > 0 and rec.get("step", 0) <= start_step]
    if (len(keep) == len(lines) and path.read_bytes().endswith(b"\n")) or not lines:
        return
    dropped = len(rows) - len(keep)
    if dropped:
        where = f"the checkpoint of step {start_step}" if start_step else "scratch (step 0)"
        log.warning(
            "%s: this launch starts from %s; dropping %d row(s) an earlier launch wrote after it",
            path,
            where,
            dropped,
        )
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
    os.replace(tmp, path)


def _init_wandb(run_dir: Path, config: dict[str, Any], **kwargs: Any) -> Any:
    """Start a wandb run writing under ``run_dir/wandb``; imported lazily (slow import, rank 0 only).

    ``kwargs`` go to ``wandb.init`` (project, name, group, tags, notes, entity, id, resume). With
    ``WANDB_MODE=disabled`` (wandb's own switch for "no wandb at all") returns None, as
    ``logging.wandb=false`` does, without importing wandb (about 0.6 s of one core per launch).
    """
    mode = os.environ.get("WANDB_MODE") or "offline"
    if mode == "disabled":
        return None
    import wandb

    settings = wandb.Settings(console="off", quiet=True)
    # A run started earlier in this process (the previous job of a sweep) must not be continued.
    return wandb.init(
        dir=str(run_dir), mode=mode, config=config, settings=settings, reinit="finish_previous", **kwargs
    )
