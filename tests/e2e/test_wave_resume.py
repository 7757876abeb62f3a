"""Exact resume with waves (``pipeline.wave=2``, DESIGN invariant 6): a checkpoint of step 3 resumed
ends bit for bit where the uninterrupted run ends (records, master weights, AdamW moments).

test_checkpoint_runs.py's family Q (Qwen3, tied, two stages, 2 micro-batches a step: one wave of 2),
every unit streamed: each streamed unit's gradient is its wave's fp32 sum, shipped once per item.
"""

from __future__ import annotations

from pathlib import Path

from test_checkpoint_runs import (
    RECORD_KEYS,
    STEPS,
    Q,
    _assert_same_tensors,
    master,
    optimizer,
    records,
    train,
    work,  # noqa: F401  (the module's corpus and store directory, a fixture)
)

WAVE = ["pipeline.wave=2", "stream.device_budget=0"]


def test_resume_with_waves_is_bitwise(work: Path) -> None:  # noqa: F811
    full = work / "wave_full"
    said = train(work, 2, full, [*Q, *WAVE, "checkpoint.every=3", "checkpoint.keep_last=0"])
    assert "pipeline.wave=2: 1 item of 2 micro-batches per step" in said, said[-3000:]
    want = records(full)
    assert {want[s]["wave"] for s in want} == {2}, "metrics.jsonl's wave"
    resumed = work / "wave_resumed"
    ckpt = full / "checkpoints" / "step-3"
    train(work, 2, resumed, [*Q, *WAVE, f"checkpoint.resume={ckpt}"])
    got = records(resumed)
    assert all(got[s][k] == want[s][k] for s in range(4, STEPS + 1) for k in RECORD_KEYS)
    end, last = full / "checkpoints" / f"step-{STEPS}", resumed / "checkpoints" / f"step-{STEPS}"
    _assert_same_tensors(master(last), master(end))
    _assert_same_tensors(optimizer(last), optimizer(end))
