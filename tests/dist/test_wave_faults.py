"""A NaN/inf step with waves (``pipeline.wave=2``): skipped on every stage, as without them.

The same launch and reference as test_faults.py's ``test_nan_gradient_is_skipped_on_every_stage`` (two
stages, the head's gradient poisoned on the last stage at step 2, weights against plain transformers +
AdamW without that step), with every unit streamed and its two micro-batches a step run as one wave:
each streamed unit's gradient reaches the store once per item (its fp32 wave sum), so the readiness
counts, the skip and the next steps' first arrivals (which overwrite the skipped step's sums) must
follow the items, not the micro-batches.
"""

from __future__ import annotations

from pathlib import Path

import test_faults


def test_nan_gradient_is_skipped_on_every_stage_with_waves(
    tmp_path: Path, corpus, shm_dir: Path, monkeypatch
) -> None:
    monkeypatch.setitem(test_faults.PLACEMENTS, "wave", ["pipeline.wave=2", "stream.device_budget=0"])
    test_faults.test_nan_gradient_is_skipped_on_every_stage(tmp_path, corpus, shm_dir, "wave")
    (run,) = (tmp_path / "runs").iterdir()
    assert "pipeline.wave=2: " in (run / "rank0.log").read_text(), "the start-up line of the wave"
