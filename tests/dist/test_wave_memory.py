"""Device memory with waves (``pipeline.wave=2``): the planner's stage model against the engine's own
high-water marks, as test_memory.py checks them without waves.

Three gloo ranks run the real engine (``memory_worker.py``) for a 1F1B step of one round of 4
micro-batches (2 items) and a GPipe step of two rounds of 4: each stage's micro-batches whose inputs
its runner kept at once (W per item in flight), its live P2P bytes (an item's message is one
[W, B, T, D] tensor) and its window's bytes (slots plus one fp32 wave-sum buffer per slot) must be
what ``cost.memory.stage_memory`` reserves for the stage's ``StepPlan.work`` with that wave.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import run_torchrun
import test_memory
from test_memory import HF, WORKER, B, T

from nodetrain.config.schema import ModelConfig
from nodetrain.core.step_plan import StepPlan
from nodetrain.cost.memory import stage_memory
from nodetrain.cost.shape import shape_of
from nodetrain.model import HFModel, build_hf_config

WAVE = 2
CASES = [("1f1b", 4, 1), ("gpipe", 4, 2)]
"""(schedule, micro-batches M, accumulation rounds G), each with W = 2."""


def _spec(out: Path, store_dir: Path, schedule: str, m: int, g: int) -> Path:
    return test_memory._spec(out, store_dir, schedule, m, g, {"pipeline.wave": WAVE}, "wave-memory")


@pytest.fixture(scope="module")
def engine_reports(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("wave_memory")
    store_dir = Path(tempfile.mkdtemp(prefix="nt-test-", dir="/dev/shm"))
    try:
        specs = [_spec(tmp / schedule, store_dir, schedule, m, g) for schedule, m, g in CASES]
        run_torchrun(3, WORKER, *map(str, specs), timeout_s=240)
        left = sorted(p.name for p in store_dir.iterdir())
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    assert not left, f"files left in the store directory: {left}"
    return {c[0]: [json.loads((tmp / c[0] / f"rank{r}.json").read_text()) for r in range(3)] for c in CASES}


@pytest.mark.parametrize(("schedule", "m", "g"), CASES)
def test_the_model_reserves_what_the_engine_holds_with_waves(engine_reports, schedule, m, g) -> None:
    shape = shape_of(HFModel(build_hf_config(ModelConfig(name="memory", arch="LlamaForCausalLM", hf=HF))))
    last = len(shape.unit_numels) - 1
    for r in engine_reports[schedule]:
        blocks = range(r["blocks"][0], r["blocks"][-1] + 1)
        plan = StepPlan.step(schedule, 3, r["stage"], g, m, blocks, last in blocks, WAVE)
        mem = stage_memory(shape, plan.work(), b=B, t=T, slots=2, itemsize=4, on_cpu=True)
        assert mem.in_flight == r["in_flight_peak"], (r, mem)
        assert mem.p2p_bytes == r["p2p_peak_bytes"], (r, mem)
        assert mem.window_bytes == r["window_bytes"], (r, mem)
        assert mem.wave_bytes == 2 * 4 * max(shape.load_numels[i] for i in blocks if i != 0), mem
