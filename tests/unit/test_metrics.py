"""MetricsLogger: metrics.jsonl, an offline wandb run under the run directory, and the no-op mode."""

from __future__ import annotations

import errno
import json
import logging
import math
from pathlib import Path

import pytest
from wandb_log import read_run

from nodetrain.config.disk import DiskFullError
from nodetrain.run import metrics
from nodetrain.run.jobs import REFUSALS
from nodetrain.run.metrics import METRICS_FILE, MetricsLogger, eta_seconds, format_progress

KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"}


def _record(step: int, **extra: float) -> dict:
    return {
        "step": step,
        "loss": 5.0 - step,
        "lr": 1e-3 * step,
        "grad_norm": 0.5,
        "tokens": 2048 * step,
        "tokens_per_s": 9000.0,
        **extra,
    }


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_records_go_to_jsonl_and_offline_wandb(tmp_path: Path, offline_wandb: None, capsys) -> None:
    run_dir = tmp_path / "run"
    logger = MetricsLogger(
        run_dir,
        {"model": {"name": "tiny"}},
        enabled=True,
        use_wandb=True,
        project="nodetrain-test",
        run_name="run",
        total_steps=3,
    )
    logger.log(_record(1))
    logger.log(_record(2, val_loss=3.5))
    logger.log(_record(3))
    logger.close()
    logger.close()  # idempotent

    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 3
    assert all(KEYS <= r.keys() for r in records)
    assert [r["step"] for r in records] == [1, 2, 3] and records[1]["val_loss"] == 3.5
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run under run_dir/wandb"
    out = capsys.readouterr().out
    assert "step 3/3" in out and "val 3.5000" in out


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with MetricsLogger(
        run_dir, {}, enabled=False, use_wandb=True, project="p", run_name="r", total_steps=3
    ) as logger:
        logger.log(_record(1))
        logger.log({})  # not even the step is looked at
    assert not run_dir.exists()


def test_context_manager_and_odd_values(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with MetricsLogger(
        tmp_path, {}, enabled=True, use_wandb=False, project="p", run_name="r", total_steps=10, print_every=5
    ) as logger:
        logger.log(_record(1, loss=math.nan, grad_norm=torch.tensor(0.25)))
    (record,) = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert record["loss"] is None and record["grad_norm"] == 0.25
    logger.close()


def test_format_progress() -> None:
    line = format_progress(_record(7, val_loss=2.25), total_steps=300)
    assert line.startswith("step   7/300   2% | loss -2.0000 | val 2.2500 | lr 7.00e-03")
    assert line.endswith("9,000 tok/s")
    timed = format_progress(_record(150), total_steps=300, elapsed_s=61.4, eta_s=3725.0)
    assert timed.startswith("step 150/300  50% | 0:01:01 elapsed | ETA 1:02:05 | loss")


def test_progress_line_eta_is_the_mean_step_time_of_this_run(tmp_path: Path, monkeypatch, capsys) -> None:
    clock = iter([100.0, 112.0, 130.0])  # init, step 11 logged (10 s since step 10 ended), step 13
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    logger = MetricsLogger(
        tmp_path, {}, enabled=True, use_wandb=False, project="p", run_name="r", total_steps=20
    )
    logger.log(_record(11, step_s=2.0))  # a resumed run: its first step is 11
    logger.log(_record(13, step_s=2.0))
    logger.close()
    first, second = capsys.readouterr().out.splitlines()
    # step 11: 2 s (its step_s) for 1 step -> 9 left take 18 s
    assert first.startswith("step 11/20  55% | 0:00:02 elapsed | ETA 0:00:18 | ")
    # step 13: 130 - (112 - 2) = 20 s for 3 steps -> 7 left take 46.7 s
    assert second.startswith("step 13/20  65% | 0:00:20 elapsed | ETA 0:00:47 | ")
    assert eta_seconds(0.0, 0, 5) != eta_seconds(0.0, 0, 5)  # NaN before the first step


def _offline_runs(run_dir: Path) -> list[Path]:
    """The run files under ``run_dir/wandb``, once wandb's service has written them out: ``finish``
    hands the records to the service process, which writes them asynchronously; ``teardown`` (run
    at exit in a real run) waits for it."""
    import wandb

    wandb.teardown()
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_run_carries_config_group_name_tags_and_the_step_breakdown(
    tmp_path: Path, offline_wandb
) -> None:
    config = {"optim": {"lr": 3e-4}, "model": {"name": "tiny"}}
    with MetricsLogger(
        tmp_path,
        config,
        enabled=True,
        use_wandb=True,
        project="nodetrain-test",
        run_name="optim.lr=0.0003",
        total_steps=2,
        group="multirun_x",
        tags=["sweep", "lr"],
        notes="a test run",
    ) as logger:
        run_id = logger.run_id
        logger.log(_record(1, step_s=0.5, stall_s=0.1, p2p_wait_s=0.2, optim_s=0.05))
        logger.log(_record(2, step_s=0.4, stall_s=0.0, p2p_wait_s=0.1, optim_s=0.05))
    (path,) = _offline_runs(tmp_path)
    run = read_run(path)
    assert run.run_id == run_id and run_id
    assert (run.name, run.group, run.project, run.tags, run.notes) == (
        "optim.lr=0.0003",
        "multirun_x",
        "nodetrain-test",
        ["sweep", "lr"],
        "a test run",
    )
    assert run.config["optim"] == {"lr": 3e-4} and run.config["model"] == {"name": "tiny"}
    steps = [h for h in run.history if "step" in h]
    assert [h["_step"] for h in steps] == [1, 2] and [h["stall_s"] for h in steps] == [0.1, 0.0]
    assert {"loss", "step_s", "p2p_wait_s", "optim_s", "tokens_per_s"} <= steps[0].keys()
    assert run.exit_code == 0, "the run was not finished"


def test_resume_id_continues_the_same_wandb_run(tmp_path: Path, offline_wandb) -> None:
    kwargs = {"enabled": True, "use_wandb": True, "project": "p", "run_name": "r", "total_steps": 4}
    with MetricsLogger(tmp_path / "a", {}, **kwargs) as first:
        first.log(_record(1))
    with MetricsLogger(tmp_path / "b", {}, resume_id=first.run_id, **kwargs) as second:
        second.log(_record(2))
    assert second.run_id == first.run_id
    (a,), (b,) = _offline_runs(tmp_path / "a"), _offline_runs(tmp_path / "b")
    assert read_run(a).run_id == read_run(b).run_id == first.run_id
    assert [h["step"] for h in read_run(b).history if "step" in h] == [2]


def test_wandb_disabled_mode_logs_records_only(tmp_path: Path, offline_wandb, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with MetricsLogger(
        tmp_path, {}, enabled=True, use_wandb=True, project="p", run_name="r", total_steps=1
    ) as m:
        m.log(_record(1))
    assert m.run_id is None  # no run, as with logging.wandb=false: no id for a checkpoint to continue
    assert [json.loads(x)["step"] for x in (tmp_path / METRICS_FILE).read_text().splitlines()] == [1]
    assert not _offline_runs(tmp_path) and not list(tmp_path.glob("wandb/*run-*"))


@pytest.mark.parametrize(("start_step", "kept"), [(None, [0, 1, 2, 3, 4, 5]), (3, [0, 1, 2, 3]), (0, [])])
def test_a_resumed_launch_drops_the_rows_after_its_start(tmp_path: Path, start_step, kept) -> None:
    """An earlier launch logged steps 0-5 and crashed; a launch resuming after step 3 keeps rows
    0-3 (it logs 4, 5, ... again), one from scratch keeps none, and None appends as before."""
    path = tmp_path / METRICS_FILE
    path.write_text("".join(json.dumps(_record(s)) + "\n" for s in range(6)))
    with MetricsLogger(
        tmp_path,
        {},
        enabled=True,
        use_wandb=False,
        project="p",
        run_name="r",
        total_steps=9,
        start_step=start_step,
    ):
        pass
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == kept


class _FillingFile:
    """A file on a filesystem with ``room`` bytes left: a write past it writes what fits, then fails
    with ENOSPC, as write(2) on a full disk does."""

    def __init__(self, real, room: int) -> None:
        self.real, self.room = real, room

    def write(self, data) -> int:
        n = min(len(data), self.room)
        self.real.write(data[:n])
        self.real.flush()
        self.room -= n
        if n < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return n

    def __getattr__(self, name):  # flush, fileno, close: the real file's
        return getattr(self.real, name)


def _logger(run_dir: Path, **kwargs) -> MetricsLogger:
    return MetricsLogger(
        run_dir, {}, enabled=True, use_wandb=False, project="p", run_name="r", total_steps=9, **kwargs
    )


def test_a_full_disk_leaves_no_torn_row_and_stops_with_a_refusal(tmp_path: Path) -> None:
    """The row that does not fit is cut back (the file ends with the last whole row), later rows are
    not attempted, and the run's end raises the refusal naming the directory and the bytes."""
    logger = _logger(tmp_path)
    first = json.dumps(_record(1)) + "\n"
    logger._file = _FillingFile(logger._file, room=len(first) + 20)  # a second row does not fit
    logger.log(_record(1))
    logger.log(_record(2))  # no exception here: the loop stops every rank after the next step
    logger.log(_record(3))
    logger.close()
    assert (tmp_path / METRICS_FILE).read_text() == first
    row = len(json.dumps(_record(2)) + "\n")
    want = (
        f"hydra.run.dir={tmp_path}: the filesystem is full: the row of step 2 in metrics.jsonl needs {row:,}"
    )
    assert logger.failed is not None and logger.failed.startswith(want), logger.failed
    with pytest.raises(DiskFullError, match="the newest checkpoint is step-1") as info:
        logger.raise_if_failed("the newest checkpoint is step-1")
    assert isinstance(info.value, REFUSALS) and "checkpoint.resume=auto" in str(info.value)


@pytest.mark.parametrize(("start_step", "kept"), [(3, [0, 1, 2, 3]), (9, [0, 1, 2, 3, 4])])
def test_a_resume_reads_a_torn_last_row_as_torn(tmp_path: Path, caplog, start_step, kept) -> None:
    """A row a full disk or a crash cut short is dropped with a warning, not a JSONDecodeError."""
    path = tmp_path / METRICS_FILE
    whole = "".join(json.dumps(_record(s)) + "\n" for s in range(5))
    path.write_text(whole + json.dumps(_record(5))[:17])
    with caplog.at_level(logging.WARNING):
        _logger(tmp_path, start_step=start_step).close()
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == kept
    assert path.read_text().endswith("\n")
    assert "dropping line 6, a torn last row" in caplog.text


def test_progress_lines_also_go_to_the_rank_log(tmp_path: Path) -> None:
    """README: rank0.log holds the per-step progress lines the console shows (Hydra's file handler)."""
    handler = logging.FileHandler(tmp_path / "rank0.log")
    logging.getLogger().addHandler(handler)
    try:
        with _logger(tmp_path / "run", print_every=1) as logger:
            logger.log(_record(1))
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert "step 1/9  11% |" in (tmp_path / "rank0.log").read_text()


def test_rows_a_full_disk_refused_go_with_the_checkpoint_and_come_back_on_resume(tmp_path: Path) -> None:
    """Issue 32, item 6: the rows of trained steps are never lost. Step 2's row does not fit, so the
    run stops after step 3; the checkpoint of step 3 carries rows 2 and 3 (``rows_to_carry``); once
    space is freed, the launch resuming from it writes them back before its own rows."""
    logger = _logger(tmp_path)
    first = json.dumps(_record(1)) + "\n"
    logger._file = _FillingFile(logger._file, room=len(first) + 20)
    logger.log(_record(1))
    logger.log(_record(2))
    carried = logger.rows_to_carry(_record(3))  # the loop, before step 3's save
    logger.log(_record(3))
    logger.close()
    assert [r["step"] for r in carried] == [2, 3] and [r["step"] for r in logger.unwritten] == [2, 3]
    assert json.loads(json.dumps(carried)) == [_record(2), _record(3)], "JSON-safe, as trainer_state.json"
    with _logger(tmp_path, start_step=3, carried=carried) as resumed:
        resumed.log(_record(4))
    assert [json.loads(ln)["step"] for ln in (tmp_path / METRICS_FILE).read_text().splitlines()] == [
        1,
        2,
        3,
        4,
    ]
    with _logger(tmp_path, start_step=3, carried=carried):  # a second resume adds nothing twice
        pass
    assert [json.loads(ln)["step"] for ln in (tmp_path / METRICS_FILE).read_text().splitlines()] == [1, 2, 3]


def test_the_carried_rows_warning_says_why_the_file_lacks_them(tmp_path: Path, caplog) -> None:
    """An explicit ``checkpoint.resume=<path>`` into a new run directory has no metrics.jsonl: the
    carried rows start it, and the warning says so (no full disk); a file of this run's that lacks
    them says they were refused or never written."""
    carried = [_record(3)]
    with caplog.at_level(logging.WARNING), _logger(tmp_path / "new", start_step=3, carried=carried):
        pass
    assert "step(s) 3 the checkpoint of step 3 carried (a resume into a new run directory" in caplog.text
    assert "full disk" not in caplog.text
    assert [json.loads(ln)["step"] for ln in (tmp_path / "new" / METRICS_FILE).read_text().splitlines()] == [
        3
    ]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / METRICS_FILE).write_text("".join(json.dumps(_record(s)) + "\n" for s in (1, 2)))
    caplog.clear()
    with caplog.at_level(logging.WARNING), _logger(tmp_path / "old", start_step=3, carried=carried):
        pass
    assert (
        "step(s) 3 the checkpoint of step 3 carried (the file lacks them: a full disk refused them, or "
        "the launch ended before writing them)" in caplog.text
    )
    assert "new run directory" not in caplog.text
