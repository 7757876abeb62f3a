"""Call the cost model the way the old keyword API did: a stage by its blocks, place and schedule.

The cost model prices what ``core.step_plan.StepPlan.work`` hands it; tests that price a stage by hand
describe it by blocks, stage, schedule and batch counts, built here through the same core rule.
"""

from __future__ import annotations

from nodetrain.core.step_plan import StepPlan, stage_works
from nodetrain.cost.memory import stage_memory
from nodetrain.cost.step_time import step_time
from nodetrain.cost.traffic import stage_traffic


def work(blocks, stage: int, num_stages: int, *, m: int, g: int, schedule: str = "1f1b", resident=()):
    """The ``StageWork`` of ``stage`` of ``num_stages`` owning ``blocks``, ``g`` rounds of ``m``."""
    plan = StepPlan.step(schedule, num_stages, stage, g, m, list(blocks), stage == num_stages - 1)
    return plan.work(resident)


def memory(shape, blocks, stage: int, num_stages: int, *, m, g, schedule="1f1b", resident=(), **kw):
    """``stage_memory`` of that stage (``kw``: b, t, slots, itemsize, on_cpu, offload_activations)."""
    return stage_memory(
        shape, work(blocks, stage, num_stages, m=m, g=g, schedule=schedule, resident=resident), **kw
    )


def traffic(shape, blocks, stage: int, num_stages: int, *, m, g, schedule="1f1b", resident=(), **kw):
    """``stage_traffic`` of that stage (``kw``: n, itemsize, offload_activations)."""
    return stage_traffic(
        shape, work(blocks, stage, num_stages, m=m, g=g, schedule=schedule, resident=resident), **kw
    )


def step(shape, stage_blocks, *, m, g, schedule="1f1b", resident=None, **kw):
    """``step_time`` of a pipeline of ``stage_blocks`` (``kw``: b, t, itemsize, rates, ...)."""
    return step_time(shape, stage_works(schedule, stage_blocks, g, m, resident), **kw)
