"""The planner against the first GPU run (issue 33): ``bench/plan_gpu_runs.py`` on
tests/data/gpu-runs/2026-12-04-h200 (a copy of that run's metrics, start-up logs and summary), its
command line, and the per-block overlap model (``nodetrain/cost/blocks.py``) against closed forms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nodetrain.cost.blocks import BlockCost, pass_times

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "data" / "gpu-runs" / "2026-12-04-h200"
sys.path.insert(0, str(ROOT / "bench"))


def test_the_shared_h200_runs_are_predicted_within_the_issue_bounds() -> None:
    """Both runs (streamed and all-resident, M=4): the step within 15% of the measured median of
    steps 3-6, each phase within 25%, and the planned resident blocks as the run's log says."""
    from plan_gpu_runs import compare, read_runs

    runs = read_runs(RUN)
    assert runs["streamed"]["measured"]["step_s"] == pytest.approx(4.166, abs=1e-3)  # README's 4.17
    assert runs["auto"]["measured"]["step_s"] == pytest.approx(3.549, abs=1e-3)  # README's 3.55
    assert "optim.on_device=false" in runs["auto"]["overrides"]
    assert "stream.accum_threads=8" in runs["auto"]["overrides"]  # from the start-up log
    rows, problems = compare(RUN)
    assert not problems
    assert len(rows) == 12
    assert [r for r in rows if not r.ok] == []


def test_the_command_line_prints_usage_and_refuses_a_missing_run_directory(tmp_path: Path, capsys) -> None:
    """No run directory: argparse's usage and exit 2; ``--help``: the usage, exit 0; a directory that
    is not there, or has no runs.json, or lacks a run's metrics: one line naming it, exit 2 (through
    ``plan_accuracy.py --run`` too, as a process: the scripts' own entry points), and no traceback."""
    from plan_gpu_runs import main

    with pytest.raises(SystemExit) as bare:
        main([], prog="plan_gpu_runs.py")
    err = capsys.readouterr().err
    assert bare.value.code == 2 and "usage: plan_gpu_runs.py" in err and "run_dir" in err
    with pytest.raises(SystemExit) as helped:
        main(["--help"], prog="plan_gpu_runs.py")
    out = capsys.readouterr().out
    assert helped.value.code == 0 and "usage: plan_gpu_runs.py" in out and "--warmup" in out
    gone = subprocess.run(
        [sys.executable, "bench/plan_accuracy.py", "--run", str(tmp_path / "nonexistent")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert gone.returncode == 2 and "Traceback" not in gone.stderr
    assert gone.stderr.strip().splitlines() == [
        f"plan_accuracy.py --run: error: run directory {tmp_path / 'nonexistent'}: no such directory; "
        "give one that holds runs.json (the planner's overrides), NAME_metrics.jsonl and "
        "NAME_rank0.log per run"
    ]
    assert main([str(tmp_path)]) == 2  # no runs.json
    (tmp_path / "runs.json").write_text(json.dumps({"overrides": [], "runs": {"a": []}}))
    assert main([str(tmp_path)]) == 2  # no a_metrics.jsonl


def test_a_figure_measured_near_zero_shows_and_is_judged_by_its_absolute_difference(capsys) -> None:
    """A bubble of 0 predicted and measured shows no relative error (it means nothing) but its
    absolute difference; a figure under the floor is within it when the difference is, and a large
    one still misses."""
    from plan_gpu_runs import FLOOR_S, Row, _within, report

    assert Row("r", "bubble", 0.0, 0.0, True).error is None
    assert Row("r", "bubble", 0.0, 0.0, True).shown_error == "0.000 s"
    assert Row("r", "bubble", 0.5, 0.001, False).shown_error == "+0.499 s"
    assert Row("r", "stall", 1.1, 1.0, True).shown_error == "+10.0%"
    assert _within("bubble", 0.004, 0.0, step=0.1) and not _within("bubble", 0.5, 0.0, step=4.0)
    assert _within("step", 0.003, 0.001, step=0.001) and not _within("step", FLOOR_S * 3, 0.0, step=0.0)
    assert report(RUN)
    bubbles = [x for x in capsys.readouterr().out.splitlines() if " bubble " in x]
    assert len(bubbles) == 2 and all("%" not in x and "0.000 s" in x for x in bubbles), bubbles


def test_a_forward_hides_each_load_behind_the_previous_block() -> None:
    """Two slots: block i's load crosses while block i − 1 computes (the first was prefetched), so a
    forward of F = (1, 1, 1) with loads (0.5, 0.5, 3) takes 5 s, not 3: the big load waits for
    block 0's slot and stalls block 2 by 2 s."""
    blocks = [BlockCost(1.0, 2.0, 0.5), BlockCost(1.0, 2.0, 0.5), BlockCost(1.0, 2.0, 3.0)]
    p = pass_times(blocks, slots=2)
    # block 1's load starts at 0 (the previous pass's slot), ready at 0.5 < 1; block 2's starts when
    # block 0's compute ends (1), ready at 4, where block 1 ended at 2: 2 s of stall
    assert p.forward_s == pytest.approx(5.0)
    # backward (2, 1, 0) with B = 2: block 2 prefetched, block 1's load ready at 0.5, block 0's
    # starts when block 2's compute ends (2), ready at 2.5 < 4: no stall
    assert p.backward_s == pytest.approx(6.0)
    assert p.stall_s == pytest.approx(2.0)
    assert p.d2h_wait_s == 0.0 and p.last_extra_s == 0.0


def test_offloads_in_flight_bound_the_backward_and_the_worker_keeps_pace() -> None:
    """Four blocks of B = 1 whose offloads take 2 s each, two slots: offload j waits for offload
    j − 2. Offloads end at 3, 5, 7, 9; block j's (j ≥ 2) is issued at max(its compute end, the end of
    offload j − 2): block 2 at 3 (its compute ends then: no wait), block 3 at 5 (computed at 4: waits
    1 s), so the pass ends at 5 and the worker at 9. The worker's 8 s of a micro-batch exceed forward
    (0) + backward (5): 3 s carry over; the last backward's flush (9 − 5 = 4) less that carry is 1 s."""
    blocks = [BlockCost(0.0, 1.0, 0.0, 2.0) for _ in range(4)]
    p = pass_times(blocks, slots=2)
    assert p.backward_s == pytest.approx(5.0 + 3.0)
    assert p.d2h_wait_s == pytest.approx(1.0 + 3.0)
    assert p.last_extra_s == pytest.approx(1.0)
    assert p.compute_s == pytest.approx(4.0)


def test_resident_blocks_ship_at_the_last_backward_only() -> None:
    """Resident blocks (no per-pass loads or offloads) ship once: an ordinary backward of B = 1 per
    block does not wait; the last one queues ships of 1.5 s after each block's backward, slots 2:
    ships end at 2.5, 4, 5.5 while the compute ends at 3 (block 2's ship waits for the first: issued
    at max(3, 2.5) = 3): last pass ends at 3, the worker at 5.5, so the edge is 2.5 s."""
    blocks = [BlockCost(0.5, 1.0, ship_s=1.5) for _ in range(3)]
    p = pass_times(blocks, slots=2)
    assert p.backward_s == pytest.approx(3.0)
    assert p.d2h_wait_s == 0.0
    assert p.last_extra_s == pytest.approx(2.5)


def test_block_traffic_sums_to_the_stage_traffic() -> None:
    """``traffic.block_traffic`` is ``stage_traffic`` block by block (the overlap model spreads it)."""
    from cost_cases import stage_works
    from test_step_time import SHAPE

    from nodetrain.cost.traffic import block_traffic, stage_traffic

    for resident in (None, [frozenset({1}), frozenset({3})]):
        for w in stage_works("1f1b", [range(0, 2), range(2, 4)], 2, 3, resident):
            x = stage_traffic(SHAPE, w, n=32, itemsize=2)
            parts = [block_traffic(SHAPE, w, i, n=32, itemsize=2) for i in w.blocks]
            assert tuple(map(sum, zip(*parts, strict=True))) == (x.h2d_bytes, x.d2h_bytes, x.accum_bytes)


def test_a_measured_profile_loads_as_a_hardware_config(tmp_path: Path) -> None:
    """``bench/host_rates.write_profile`` (cpu_profile.py --host, copy_bandwidth.py --write-profile)
    keeps the base profile's figures, sets the measured ones, and the result is a valid profile."""
    from host_rates import write_profile
    from omegaconf import OmegaConf

    from nodetrain.config.hardware import HardwareConfig

    out = tmp_path / "mine.yaml"
    figures = {
        "accum_gbps": 50.5,
        "optimizer_gbps": 110.0,
        "host_link_d2h_gbps": 40.0,
        "triad_1_threads_gbps": 9,
    }
    write_profile(out, "h200_1gpu", figures, "measured here")
    hw = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(out)))
    assert (hw.name, hw.accum_gbps, hw.optimizer_gbps, hw.host_link_d2h_gbps) == ("mine", 50.5, 110.0, 40.0)
    assert hw.peak_flops == 989.4e12 and hw.source.endswith("measured here")
