"""Speculative updates with clipping (``optim.speculative``, overlap.py; SuperOffload's
speculation-then-validation, arXiv:2509.21271).

Cheapest first: the mode rule (pure); the backup/rollback of :class:`StoreAdamW` and one step of
:class:`UnitUpdates` on a small host store in one process, against ``torch.optim.AdamW`` on the
clipped gradient (kept, rolled back and redone, held, rolled back for a NaN step), with a mutant
(no rollback before the redo) that must not match; then torchrun runs through ``parity_worker.py``
compared with plain ``transformers`` + ``clip_grad_norm_`` + ``torch.optim.AdamW`` (test_parity's
reference): clipping on every step (1 stage and 2 stages 1F1B), clipping never active (2 stages),
and a NaN step, skipped whole (test_update_in_backward's reference).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import shm_store_dir
from test_overlap import BINDINGS, BLOCKS, CFG, UNITS, store  # noqa: F401  (store: a fixture)
from test_parity import (
    ATOL_WEIGHT,
    RTOL,
    STEPS,
    Case,
    check_parity,
    check_run,
    launch_specs,
    make_batches,
    read_run,
    save_seeded_model,
    write_spec,
)
from test_plan import A_EMBED, A_HEAD, A_LAYER, _config_a
from test_update_in_backward import (
    NAN_AT,
    NAN_CASE,
    _adamw_one_step,
    _close,
    _in_backward_counts,
    _Launch,
    _reference_left_out,
    nan_spec,
    read_nan_run,
)

from nodetrain.config.schema import OptimConfig
from nodetrain.core.update import policy_for, update_mode
from nodetrain.engine.device.window import Window
from nodetrain.engine.host.overlap import UnitUpdates
from nodetrain.optim.adamw import StoreAdamW, clip_coef
from nodetrain.plan.planner import make_plan
from nodetrain.run.inject import Faults

# ----------------------------------------------------------------------------- pure rule


def test_update_mode_speculative_needs_clipping_overlap_and_in_backward() -> None:
    on, why = update_mode(OptimConfig(speculative=True))
    assert on and "optim.speculative=true" in why and "rolled back" in why
    assert not update_mode(OptimConfig(speculative=True, update_in_backward=False))[0]
    assert not update_mode(OptimConfig(speculative=True, overlap=False))[0]
    assert update_mode(OptimConfig(speculative=True, max_grad_norm=0.0))[1].startswith("no clipping")


def test_planner_counts_the_backups_in_host_memory() -> None:
    """config A of test_plan (112,448 parameters, counted by hand there): speculation adds 12 bytes
    per parameter to the node's host need, and nothing when clipping is off (no backups then)."""
    base = make_plan(_config_a())
    cfg = _config_a()
    cfg.optim.speculative = True
    assert A_EMBED + 2 * A_LAYER + A_HEAD == 112_448
    assert make_plan(cfg).host_need_bytes - base.host_need_bytes == 12 * 112_448
    cfg.optim.max_grad_norm = 0.0
    assert make_plan(cfg).host_need_bytes == base.host_need_bytes


# ----------------------------------------------------------------------------- one process

LR = 1e-2
FIELDS = ("master", "exp_avg", "exp_avg_sq", "compute")


def _grads(seed: int, nan: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = {
        block: {b.local_name: torch.randn(b.shape, generator=gen) for b in BINDINGS[block]}
        for block in BLOCKS
    }
    if nan:
        out[1]["a"][0, 0] = math.nan
    return out


def _one_step(store, max_norm: float, grads, scale: float | None, *, rollback: bool = False):  # noqa: F811
    """Offload ``grads`` (backward order 2, 1, 0), then validate as the engine does: the clip
    coefficient of the measured norm (or ``scale``, standing in for other stages' share), or
    :meth:`UnitUpdates.rollback` for a NaN step. Returns the updates object, its AdamW, Σ grads."""
    opt = StoreAdamW(store, UNITS, CFG)
    policy = policy_for(OptimConfig(max_grad_norm=max_norm, speculative=True))
    updates = UnitUpdates(opt, BINDINGS, BLOCKS, policy, threads=1, faults=Faults(optim_delay_s=0.002))
    window = Window(
        store, BINDINGS, BLOCKS, 2, "cpu", on_arrival=updates.arrived, faults=Faults(copy_delay_s=0.001)
    )
    total = {u.index: torch.zeros(u.numel) for u in UNITS}
    try:
        updates.begin_step(LR, [2, 1, 0])
        for block in (2, 1, 0):
            for b in BINDINGS[block]:
                total[b.unit][b.offset : b.offset + b.numel] += grads[block][b.local_name].reshape(-1)
            window.offload(block, grads[block])
        window.flush()
        updates.end_backward()
        sq = updates.grad_sq_sum()
        want = opt.grad_sq_sum()  # the deferred path's sum (a scale-1 update leaves gradients as they are)
        assert sq == want or (rollback and math.isnan(sq)), (sq, want)  # NaN: its unit's grads dropped
        norm = math.sqrt(sq)
        if rollback:
            updates.rollback()
        else:
            updates.finish_step(LR, clip_coef(norm, max_norm) if scale is None else scale, wait_all=True)
        updates.wait_all()
    finally:
        updates.close()
        window.close()
    return updates, opt, total


def _snapshot(store) -> dict:  # noqa: F811
    return {(u.index, f): store.buffer(u.index, f).clone() for u in UNITS for f in FIELDS}


@pytest.mark.parametrize("case", ["kept", "redo", "held", "mutant-no-rollback"], ids=lambda c: c)
def test_speculative_step_equals_adamw_on_the_clipped_gradient(store, case: str, monkeypatch) -> None:  # noqa: F811
    """kept: huge max norm, coefficient 1, the speculative updates stand (all 3 ran in the backward);
    redo: the same speculation, then a coefficient 0.3 (another stage's share made the step clip):
    every unit rolled back and redone; held: a max norm between the first final unit's norm and the
    next partial sum: unit 2 speculated and redone, units 1 and 0 held for the all-reduce. Each unit
    must equal one ``torch.optim.AdamW`` step on its clipped gradient (to 1 ulp: the fused pass
    divides by 1 / coef). The mutant skips the rollback (the redo lands on the speculative update)
    and must not match."""
    grads = _grads(3)
    before = _snapshot(store)
    sq = {b: sum(float(g.square().sum()) for g in grads[b].values()) for b in BLOCKS}
    max_norm, scale = 1e9, {"kept": 1.0}.get(case, 0.3)
    if case == "held":  # unit 2's norm² is block 2's minus the lm_head use of unit 0
        head_sq = float(grads[2]["w"].square().sum() + grads[2]["n"].square().sum())
        max_norm, scale = math.sqrt(head_sq + 0.1 * sq[1]), None
    if case.startswith("mutant"):
        monkeypatch.setattr(StoreAdamW, "rollback_unit", lambda self, unit, refresh=True: None)
    updates, opt, total = _one_step(store, max_norm, grads, scale)

    norm = math.sqrt(sum(float(t.square().sum()) for t in total.values()))
    coef = clip_coef(norm, max_norm) if scale is None else scale
    assert (coef < 1) == (case != "kept")
    counts = {u: [float(st["step"]) for st in opt._opts[u].state.values()] for u in (0, 1, 2)}
    n_rollbacks = {"kept": 0, "redo": 3, "held": 1, "mutant-no-rollback": 3}[case]
    assert updates.take_stats()["num_rollbacks"] == n_rollbacks
    diffs = []
    for u in UNITS:
        want = _adamw_one_step(before[(u.index, "master")], total[u.index] * coef, u, LR)
        diffs.append(float((store.master(u.index) - want).abs().max()))
        assert torch.equal(store.compute(u.index), store.master(u.index)), "stale transfer copy"
    one_step = {0: [1.0], 1: [1.0, 1.0], 2: [1.0, 1.0]}
    if case.startswith("mutant"):  # AdamW ran twice on every unit
        assert counts != one_step and max(diffs) > 1e-3, f"the mutant matched the reference: {diffs}"
    else:
        # the fused pass divides by 1 / coef (optim.step_unit): within 1 ulp of multiplying by coef
        assert counts == one_step and max(diffs) <= 1e-7, (counts, diffs)
    assert opt.backup_nbytes() == 12 * sum(u.numel for u in UNITS if case != "held" or u.index == 2)


def test_nan_step_rolls_back_every_speculative_update(store) -> None:  # noqa: F811
    """Block 1's gradient holds a NaN: unit 2 (final first) was updated speculatively, unit 1 left
    out by the per-unit guard, unit 0 updated speculatively; the rollback restores master weights,
    AdamW moments, step counts and transfer copies bit for bit (the step skipped whole)."""
    before = _snapshot(store)
    updates, opt, _ = _one_step(store, 1e9, _grads(4, nan=True), None, rollback=True)
    assert updates.nonfinite == [1]
    assert updates.take_stats()["num_rollbacks"] == 2
    for key, want in before.items():
        assert torch.equal(store.buffer(*key), want), key
    counts = {u: [float(st["step"]) for st in opt._opts[u].state.values()] for u in (0, 1, 2)}
    assert counts == {0: [0.0], 1: [0.0, 0.0], 2: [0.0, 0.0]}


# ----------------------------------------------------------------------------- torchrun runs

CLIP_CASES = [
    Case(
        "llama-1stage-tied-gpipe-slots2-accum2x2-clip-speculative-optdelay3ms",
        "LlamaForCausalLM",
        1,
        "gpipe",
        slots=2,
        grad_accum=2,
        microbatches=2,
        tied=True,
        delay_s=0.002,
        optim_delay_s=0.003,
    ),
    Case(
        "llama-2stage-tied-1f1b-slots1-accum1x4-clip-speculative-delay3ms",
        "LlamaForCausalLM",
        2,
        "1f1b",
        slots=1,
        grad_accum=1,
        microbatches=4,
        tied=True,
        delay_s=0.003,
        optim_delay_s=0.002,
    ),
]
"""Clipping at test_parity's 0.3 bites on every step (check_parity asserts it on the reference)."""


AUTO_CASE = replace(CLIP_CASES[1], id="llama-2stage-tied-1f1b-slots1-accum1x4-clip-auto", optim_delay_s=0.0)
"""The second clipping case without its optimizer delay, with ``optim.speculative=auto`` on two ranks:
the choice is collective (one all-reduce of the ranks' measured AdamW rates, their RAM verdicts and
resident blocks)."""


NEVER_CLIPS = {"optim.speculative": True, "optim.max_grad_norm": 1e9}
"""The NaN case's overrides: speculative updates under a clip threshold that never bites."""


@pytest.fixture(scope="module")
def two_stage_runs(tmp_path_factory) -> dict:
    """The 2-stage runs of this file, one after another in one launch (2 ranks): the 2-stage clipping
    case (``optim.speculative=true``), the NaN case never clipping (NEVER_CLIPS) and AUTO_CASE
    (``optim.speculative=auto``). Per case id: (run, model dir, inputs, labels, lengths, out dir);
    under ``"nan"``: read_nan_run's tuple and (model dir, inputs, labels, lengths)."""
    root, shm = tmp_path_factory.mktemp("two_stages"), shm_store_dir()
    cases = [(CLIP_CASES[1], {"optim.speculative": True}), (AUTO_CASE, {"optim.speculative": "auto"})]
    specs, runs = [], {}
    for case, overrides in cases:
        tmp = root / case.id
        model_dir = tmp / "hf"
        save_seeded_model(case, model_dir)
        inputs, labels, lengths = make_batches(case)
        specs.append(write_spec(case, tmp, shm, model_dir, inputs, labels, overrides))
        runs[case.id] = (model_dir, inputs, labels, lengths, tmp / "out")
    nan_file, nan_prepared = nan_spec(root / "nan", shm, {"speculative": NEVER_CLIPS})
    output = launch_specs(2, [specs[0], nan_file, specs[1]], shm, timeout_s=300)
    out = {c.id: (read_run(c, runs[c.id][-1]), *runs[c.id]) for c, _ in cases}
    out["nan"] = (*read_nan_run(root / "nan", "speculative", output), nan_prepared)
    return out


@pytest.mark.parametrize("case", CLIP_CASES, ids=lambda c: c.id)
def test_speculative_parity_clipping_every_step(
    case: Case, tmp_path: Path, shm_dir: Path, torchrun, request
) -> None:
    """The 1-stage case launches alone; the 2-stage one is read from ``two_stage_runs``' launch."""
    if case.stages == 1:
        launch = _Launch(torchrun, {"optim.speculative": True})
        check_parity(case, tmp_path, shm_dir, launch)
        steps = launch.steps()
    else:
        run, *prepared, _ = request.getfixturevalue("two_stage_runs")[case.id]
        check_run(case, run, *prepared)
        steps = run.steps
    rollbacks = [[s["breakdown"][f"stage{k}/num_rollbacks"] for k in range(case.stages)] for s in steps]
    # the redo path ran: some stage's own norm stayed under 0.3 while the global one did not
    # (measured: [[1], [1], [1], [2], [2]] and [[0, 1], [0, 1], [0, 1], [0, 2], [1, 2]])
    assert sum(map(sum, rollbacks)) > 0, f"no speculative update was rolled back: {rollbacks}"
    # every update that started during a clipped step's backward was speculative: all rolled back
    # (a speculative update may also start after the backward ends, so ≥, not =)
    in_backward = _in_backward_counts(steps, case.stages)
    kept = [
        (r, n)
        for rs, ns in zip(rollbacks, in_backward, strict=True)
        for r, n in zip(rs, ns, strict=True)
        if r < n
    ]
    assert not kept, f"a speculation kept in a clipped step: {rollbacks} vs {in_backward}"


def test_speculative_never_clipping_and_a_nan_step_skipped_whole(two_stage_runs: dict) -> None:
    """test_update_in_backward's NaN case (2 stages, 1F1B, tied embedding, slowed workers) with a
    clip threshold (1e9) that never bites: the speculative updates run in the backward and stand on
    every finite step (no rollback), and step NAN_AT, poisoned in the last stage's head, has them
    rolled back on both stages, so it is skipped whole: weights, AdamW moments and step counts equal
    the unclipped reference without step NAN_AT's update (and not the per-unit in-backward rule).
    The run (NEVER_CLIPS) is read from ``two_stage_runs``' launch."""
    run, state, counts, _, (model_dir, inputs, labels, lengths) = two_stage_runs["nan"]
    losses, norms, weights, ref_state, ref_counts = _reference_left_out(
        model_dir, inputs, labels, lengths, None
    )
    torch.testing.assert_close([s["loss"] for s in run.steps], losses, rtol=RTOL, atol=0)
    finite = [s for s in range(STEPS) if s + 1 != NAN_AT]
    torch.testing.assert_close(
        [run.steps[s]["grad_norm"] for s in finite], [norms[s] for s in finite], rtol=RTOL, atol=0
    )
    assert counts == ref_counts  # exact: STEPS - 1 for every parameter
    _close(run.weights, weights, ATOL_WEIGHT)
    _close(state, ref_state, atol=None)

    rollbacks = [[s["breakdown"][f"stage{k}/num_rollbacks"] for k in range(2)] for s in run.steps]
    in_backward = _in_backward_counts(run.steps, NAN_CASE.stages)
    for s in range(STEPS):
        if s + 1 == NAN_AT:  # stage 0's speculated units and stage 1's layers (its head left out)
            assert rollbacks[s][1] >= 1 and rollbacks[s][0] >= 1, rollbacks
        else:
            assert rollbacks[s] == [0, 0] and min(in_backward[s]) >= 1, (rollbacks, in_backward)


def test_speculative_auto_chooses_at_start_up_and_matches_the_reference(two_stage_runs: dict) -> None:
    """Each rank times its AdamW, and both log the same choice with the figures behind it; the run
    matches plain transformers + clip_grad_norm_ + AdamW whichever mode was chosen (both exact). The
    run is read from ``two_stage_runs``' launch."""
    run, *prepared, out = two_stage_runs[AUTO_CASE.id]
    check_run(AUTO_CASE, run, *prepared)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(AUTO_CASE.stages)]
    chosen = {r["speculative"] for r in reports}
    assert len(chosen) == 1, f"the ranks chose differently: {reports}"
    mode = "speculative" if chosen.pop() else "deferred"
    for r in reports:
        line = r["update_choice"]
        assert line.startswith("optim.speculative=auto: AdamW "), line
        for words in ("GB/s on 1 thread(s) (measured", "TFLOP/s", "deferred", "ms", "backups", "fit"):
            assert words in line, (words, line)
        assert line.endswith(f"→ {mode} updates"), line
    # the same figures on every rank (all but this rank's own free RAM): one all-reduce shared them
    assert len({r["update_choice"].split(" in the available RAM")[0] for r in reports}) == 1, reports
    rollbacks = sum(s["breakdown"][f"stage{k}/num_rollbacks"] for s in run.steps for k in range(2))
    assert (rollbacks > 0) == (mode == "speculative")  # every step clips: speculation rolls back
