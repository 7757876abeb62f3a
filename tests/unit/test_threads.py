"""One writer per piece of step state (DESIGN invariant 9), checked in debug mode (engine/threads.py).

- A one-rank engine runs two steps in each update mode (serial, deferred, in-backward, speculative)
  with every writer checked: nothing is written from a thread that does not own it, and the checks
  did run on the threads the thread table (engine.py) names.
- A planted write from the wrong thread goes red: the D2H worker counting an arrival in the
  optimizer thread's :class:`GradReadiness` itself (the old design: a callback mutating another
  object's state) instead of posting the message; and the optimizer thread starting a step.
- The readiness says "final" exactly at a unit's last arrival, in the schedule's order.
"""

from __future__ import annotations

import pytest
import torch
from test_overlap import BINDINGS, BLOCKS, CFG, TINY_VOCAB, UNITS, store, tiny_engine_config  # noqa: F401  (store: a fixture)

from nodetrain.config.schema import OptimConfig
from nodetrain.core.update import policy_for
from nodetrain.engine import threads
from nodetrain.engine.device.window import Window
from nodetrain.engine.host.overlap import UnitUpdates
from nodetrain.engine.host.readiness import GradReadiness
from nodetrain.optim.adamw import StoreAdamW

MODES = {
    "serial": {"overlap": False},
    "deferred": {"max_grad_norm": 1.0},
    "in_backward": {"max_grad_norm": 0.0},
    "speculative": {"max_grad_norm": 1e9, "speculative": True},
}


@pytest.fixture
def checking():
    was = threads.set_checking(True)
    threads.checked(reset=True)
    yield
    threads.set_checking(was)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_writes_state_from_its_owner_only(mode: str, checking, one_rank_world) -> None:
    from bench._engine import make_engine

    cfg = tiny_engine_config(steps=2, **MODES[mode])
    engine, _ = make_engine(cfg, f"threads-{mode}")
    try:
        assert engine.updates.policy.kind == mode
        gen = torch.Generator().manual_seed(0)
        for step in range(2):
            x = torch.randint(0, TINY_VOCAB, (engine.run.batch.global_microbatches, 1, 8), generator=gen)
            assert not engine.train_step(step, x, x).skipped
        engine.wait_optimizer()
    finally:
        engine.close()
    seen = threads.checked()
    owners = {owner for owner, _ in seen}
    assert {"training"} <= owners, seen
    assert seen[("training", "the window's sequence")] > 0, seen
    if mode != "serial":  # the optimizer thread's updates were checked on it
        assert any(o == "optimizer" and w.endswith("'s update") for o, w in seen), seen
    if mode in ("in_backward", "speculative"):
        assert seen[("optimizer", "a unit's readiness")] > 0, seen


def _in_backward_updates(store):  # noqa: F811
    policy = policy_for(OptimConfig(max_grad_norm=0.0))
    return UnitUpdates(StoreAdamW(store, UNITS, CFG), BINDINGS, BLOCKS, policy, threads=1)


@pytest.mark.parametrize("planted", [False, True], ids=["message", "planted-write-from-d2h"])
def test_an_arrival_counted_on_the_d2h_worker_goes_red(store, checking, planted: bool) -> None:  # noqa: F811
    """The D2H worker posts each arrival to the optimizer thread. Planted: it counts the arrival in
    the readiness itself, a write from the wrong thread, and the window re-raises the check."""
    updates = _in_backward_updates(store)
    on_arrival = updates._readiness.arrived if planted else updates.arrived
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", on_arrival=on_arrival)
    try:
        updates.begin_step(1e-2, [2, 1, 0])

        def backward() -> None:
            for block in (2, 1, 0):
                window.offload(block, {b.local_name: torch.ones(b.shape) for b in BINDINGS[block]})
            window.flush()

        if planted:  # an offload waiting for a staging buffer or the flush re-raises the D2H job's error
            with pytest.raises(AssertionError, match="readiness is written by the optimizer thread only"):
                backward()
            return
        backward()
        updates.end_backward()
        # units 1, 2: 20 ones each; unit 0: blocks 0 and 2 each add 1 to its 32 elements
        assert updates.grad_sq_sum() == 20 * 1**2 + 20 * 1**2 + 32 * (1 + 1) ** 2
        updates.wait_all()
    finally:
        updates.close()
        window.close()


def test_a_step_begun_on_the_optimizer_thread_goes_red(store, checking) -> None:  # noqa: F811
    updates = _in_backward_updates(store)
    try:
        with pytest.raises(AssertionError, match="written by the training thread only, not by the optimizer"):
            updates._pool.submit(updates.begin_step, 1e-2, [2, 1, 0]).result()
    finally:
        updates.close()


def test_readiness_says_final_at_the_last_arrival_in_schedule_order(checking) -> None:
    """Unit 0 is bound by blocks 0 and 2 (a tied head on one stage): final at block 0's second arrival;
    unit 1 at block 1's second. A count that is off shows as a missing unit after the flush."""
    threads.set_role("optimizer")  # this test's thread plays the owner
    try:
        r = GradReadiness({0: [0], 1: [1], 2: [0, 2]}, counted=[0, 1, 2], settled=[])
        r.arm([2, 1, 0, 2, 1, 0])
        assert [r.arrived(b) for b in (2, 1, 0)] == [[], [], []]
        assert [r.arrived(b) for b in (2, 1, 0)] == [[2], [1], [0]]
        assert r.missing() == []
        r.arm([2, 1, 0, 2, 1, 0])
        for b in (2, 1, 0):
            r.arrived(b)
        assert r.missing() == [0, 1, 2]
    finally:
        threads.set_role("training")
