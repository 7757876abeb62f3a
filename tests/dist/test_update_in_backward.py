"""AdamW during the backward (``optim.update_in_backward``, overlap.py) and its NaN/inf rule.

Cheapest first: the mode rule and the final-order function (pure); the per-unit guard on a real
small host store in one process (a NaN unit left untouched, the others equal to
``torch.optim.AdamW``; hooks called on the optimizer thread in the schedule's order); then torchrun
runs through ``parity_worker.py`` compared with plain ``transformers`` + ``torch.optim.AdamW``
(test_parity.py's reference and launcher, with extra overrides put into its spec):

- parity with updates in the backward (1 stage, GPipe, tied embedding), with the copy workers
  and the optimizer thread slowed so that a missing wait gives wrong numbers, and the step
  breakdown showing that AdamW of some unit started before the stage's backward ended;
- a NaN injected into the last stage's gradient at step 2 (2 stages, 1F1B, tied embedding, slowed
  workers): in-backward, exactly the poisoned unit (and the tied embedding, updated after the
  all-reduce) is left out of step 2 and every other unit matches the reference in weights, AdamW
  moments and step counts; deferred (``optim.update_in_backward=false``), the whole step is
  skipped and no update runs during the backward; each rule's result is far from the other's;
- two torchrun "nodes" (``--nnodes 2``, 2 stages, GPipe): per-unit cross-replica sums issued from
  the optimizer thread during the backward (gloo, while the training thread runs P2P) give the
  reference result, identical on both nodes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import shm_store_dir
from safetensors.torch import load_file
from test_overlap import BINDINGS, BLOCKS, CFG, UNITS, store  # noqa: F401  (store: a fixture)
from test_parity import (
    ATOL_WEIGHT,
    IGNORE,
    OPTIM,
    RTOL,
    SEQ_LEN,
    STEPS,
    Case,
    check_parity,
    launch_specs,
    lr_schedule,
    make_batches,
    read_run,
    run_output,
    run_reference,
    save_seeded_model,
    write_spec,
)
from test_replicas import _launch_two_nodes

from nodetrain.config.schema import OptimConfig
from nodetrain.core.step_plan import final_order
from nodetrain.core.update import policy_for, update_mode
from nodetrain.engine.device.window import Window
from nodetrain.engine.host.overlap import UnitUpdates
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.run.inject import Faults

# ----------------------------------------------------------------------------- pure rules


def test_update_mode_needs_overlap_no_clipping_and_the_switch() -> None:
    assert update_mode(OptimConfig(max_grad_norm=0.0))[0] is True
    assert update_mode(OptimConfig())[0] is False  # the default clips at 1.0
    off, why = update_mode(OptimConfig(max_grad_norm=0.0, update_in_backward=False))
    assert not off and "optim.update_in_backward=false" in why and "skipped whole" in why
    assert not update_mode(OptimConfig(max_grad_norm=0.0, overlap=False))[0]
    assert "optim.max_grad_norm=1.0" in update_mode(OptimConfig())[1]


def test_final_order_is_the_last_offload_of_each_unit() -> None:
    units_of = {0: [0], 1: [1], 2: [0, 2]}  # block 2 binds unit 0 too (a tied head)
    assert final_order([2, 1, 0], units_of) == [2, 1, 0]
    assert final_order([2, 1, 0, 2, 1, 0], units_of) == [2, 1, 0]  # two micro-batches
    assert final_order([0, 1, 2], units_of) == [1, 0, 2]  # unit 0's last offload is block 2's


# ----------------------------------------------------------------------------- the guard, one process


def _adamw_one_step(master: torch.Tensor, grad: torch.Tensor, unit, lr: float) -> torch.Tensor:
    """One ``torch.optim.AdamW(fused=True)`` step of a unit's flat weights (decay group, then the rest)."""
    p = master.clone()
    groups = [{"params": [p[: unit.num_decay]], "weight_decay": CFG.weight_decay}]
    if unit.numel > unit.num_decay:
        groups.append({"params": [p[unit.num_decay :]], "weight_decay": 0.0})
    for g, lo in zip(groups, (0, unit.num_decay), strict=False):
        (t,) = g["params"]
        t.grad = grad[lo : lo + t.numel()].clone()
    torch.optim.AdamW(groups, lr=lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, fused=True).step()
    return torch.cat([g["params"][0] for g in groups])


@pytest.mark.parametrize("order", ["schedule", "wrong"], ids=["schedule-order", "mutant-wrong-order"])
def test_nonfinite_unit_is_left_out_and_hooks_run_in_final_order(store, order: str) -> None:  # noqa: F811
    """Blocks offloaded in backward order 2, 1, 0 (unit 0 bound by blocks 0 and 2); block 1's gradient
    holds a NaN. Unit 1 must keep its weights, AdamW state and step count (gradient zeroed); units 0
    and 2 equal one AdamW step; the hooks see the units on the optimizer thread, in final order. A
    wrong expected order must fail the step (the order assertion is live)."""
    calls = []

    def on_final(step: int, unit: int) -> None:
        calls.append(("final", unit, threading.current_thread().name))

    def grad_sum(grads: list[torch.Tensor]) -> None:
        (g,) = grads
        unit = next(u.index for u in UNITS if store.grad(u.index).data_ptr() == g.data_ptr())
        calls.append(("sum", unit, threading.current_thread().name))

    opt = StoreAdamW(store, UNITS, CFG)
    policy = policy_for(OptimConfig(max_grad_norm=0.0))
    updates = UnitUpdates(opt, BINDINGS, BLOCKS, policy, threads=1, grad_sum=grad_sum, on_final=on_final)
    window = Window(
        store, BINDINGS, BLOCKS, 2, "cpu", on_arrival=updates.arrived, faults=Faults(copy_delay_s=0.002)
    )
    before = {
        (u.index, f): store.buffer(u.index, f).clone()
        for u in UNITS
        for f in ("master", "exp_avg", "exp_avg_sq")
    }
    gen = torch.Generator().manual_seed(7)
    total = {u.index: torch.zeros(u.numel) for u in UNITS}
    try:
        # the step's arrivals, as StepPlan gives them; the mutant expects the blocks in the wrong order
        updates.begin_step(1e-2, [2, 1, 0] if order == "schedule" else [0, 1, 2])
        for block in (2, 1, 0):
            grads = {b.local_name: torch.randn(b.shape, generator=gen) for b in BINDINGS[block]}
            if block == 1:
                grads["a"][1, 2] = math.nan
            for b in BINDINGS[block]:
                total[b.unit][b.offset : b.offset + b.numel] += grads[b.local_name].reshape(-1)
            window.offload(block, grads)
        window.flush()
        if order == "wrong":
            with pytest.raises(AssertionError, match="became final where the schedule puts"):
                updates.grad_sq_sum()
            return
        assert math.isnan(updates.grad_sq_sum())
        updates.wait_all()
    finally:
        updates.close()
        window.close()
    assert updates.nonfinite == [1]
    for f in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(store.buffer(1, f), before[(1, f)]), f
    assert not store.grad(1).any(), "the NaN gradient was not dropped"
    counts = {u: [float(st["step"]) for st in opt._opts[u].state.values()] for u in (0, 1, 2)}
    assert counts == {0: [1.0], 1: [0.0, 0.0], 2: [1.0, 1.0]}, "AdamW's step count of the NaN unit moved"
    for u in (UNITS[0], UNITS[2]):
        want = _adamw_one_step(before[(u.index, "master")], total[u.index], u, 1e-2)
        assert torch.equal(store.master(u.index), want), u.name
    assert [c[:2] for c in calls] == [(k, u) for u in (2, 1, 0) for k in ("final", "sum")]
    assert {c[2] for c in calls} == {"optim_0"}, "hooks ran off the optimizer thread"


# ----------------------------------------------------------------------------- torchrun runs


class _Launch:
    """The ``torchrun`` fixture, with ``overrides``, test-only ``faults`` (run/inject.py) and
    ``export_state`` added to the spec that ``test_parity.run_nodetrain`` writes; keeps the last
    launch's spec and output."""

    def __init__(self, torchrun, overrides: dict | None = None, export_state: bool = False, faults=None):
        self.torchrun, self.overrides, self.export_state = torchrun, overrides or {}, export_state
        self.faults = faults or {}
        self.spec: dict = {}
        self.output = ""

    def __call__(self, nproc: int, script: Path, spec_file: str, timeout_s: float = 180) -> str:
        spec = json.loads(Path(spec_file).read_text())
        spec["overrides"].update(self.overrides)
        spec["faults"].update(self.faults)
        spec["export_state"] = self.export_state
        Path(spec_file).write_text(json.dumps(spec))
        self.spec = spec
        self.output = self.torchrun(nproc, script, spec_file, timeout_s=timeout_s)
        return self.output

    def steps(self) -> list[dict]:
        return json.loads((Path(self.spec["out_dir"]) / "steps.json").read_text())


def _in_backward_counts(steps: list[dict], num_stages: int) -> list[list[int]]:
    """Per step, per stage: AdamW updates that started before the stage's last backward ended."""
    return [[s["breakdown"][f"stage{k}/num_updates_in_backward"] for k in range(num_stages)] for s in steps]


PARITY_CASE = Case(
    "llama-1stage-tied-gpipe-slots2-accum2x2-noclip-delay3ms-optdelay5ms",
    "LlamaForCausalLM",
    1,
    "gpipe",
    slots=2,
    grad_accum=2,
    microbatches=2,
    max_grad_norm=0.0,
    tied=True,
    delay_s=0.003,
    optim_delay_s=0.005,
)
"""One stage, GPipe, the tied embedding bound by two blocks of the stage (final at the second). Two
stages with 1F1B are the NaN case below (every unit but the poisoned one against the reference),
two stages with GPipe the two-node case."""


def test_in_backward_parity_and_overlap(tmp_path: Path, shm_dir: Path, torchrun) -> None:
    case = PARITY_CASE
    launch = _Launch(torchrun)
    check_parity(case, tmp_path, shm_dir, launch)  # loss, grad norm, every weight vs transformers + AdamW
    counts = _in_backward_counts(launch.steps(), case.stages)
    # ordering, not speed: on every stage, in every step, some unit's AdamW began before the stage's
    # backward ended (with the updates deferred this is 0, see the deferred NaN case below)
    assert all(n >= 1 for row in counts for n in row), f"no update ran during the backward: {counts}"


NAN_AT = 2
"""1-based step whose gradient ``nan_rank`` (NODETRAIN_FAULTS; the last stage) poisons, in its last
unit (the head)."""
NAN_CASE = Case(
    "llama-2stage-tied-1f1b-slots1-accum1x4-noclip-delay5ms-optdelay2ms-5layers-nan",
    "LlamaForCausalLM",
    2,
    "1f1b",
    slots=1,
    grad_accum=1,
    microbatches=4,
    max_grad_norm=0.0,
    tied=True,
    delay_s=0.005,
    optim_delay_s=0.002,
    hf={"num_hidden_layers": 5},
)
"""5 layers: 3 or 4 blocks a stage; one slot and slowed copies make the rest of a backward outlast the
D2H and the slowed update of the first unit that becomes final. Without clipping, lr 1e-2 and the
tied embedding, fp32 noise grows over the steps and how much depends on the seed (the case id):
for this one two correct references (one batch vs 4 accumulated micro-batches) end ≤ 4.4e-7 apart
in the weights and 1.6e-6 in the norm, either NaN rule (measured; 6 layers with another seed gave
4e-6, past ATOL_WEIGHT)."""
LEFT_OUT_IN_BACKWARD = {"model.norm.weight", "model.embed_tokens.weight"}
"""The head (the poisoned unit: the final norm; lm_head is the tied embedding) and the tied embedding,
whose update waits for the step's all-reduce."""


def _reference_left_out(model_dir: Path, inputs, labels, lengths, left_out: set[str] | None):
    """test_parity's reference (same model, loss, AdamW groups, schedule; no clipping), except that
    step NAN_AT's update leaves out the parameters named in ``left_out`` (None: all of them, the
    step skipped whole) by setting their gradient to None: ``torch.optim.AdamW`` then moves neither
    them nor their ``exp_avg``/``exp_avg_sq`` nor their step count.

    Returns:
        losses, grad norms (per step), weights (state dict), AdamW state {name.exp_avg/.exp_avg_sq},
        step counts {name: count}.
    """
    model = getattr(transformers, NAN_CASE.arch).from_pretrained(model_dir, dtype=torch.float32)
    named = list(model.named_parameters())  # the tied lm_head appears once, as the embedding
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": OPTIM["weight_decay"]},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])
    losses, norms = [], []
    for step in range(STEPS):
        ids, lab = inputs[step].flatten(0, 1), labels[step].flatten(0, 1)  # [N·B, T]
        mask = (torch.arange(SEQ_LEN) < lengths[step].flatten()[:, None]).long()  # [N·B, T]
        logits = model(input_ids=ids, attention_mask=mask).logits  # [N·B, T, V]
        loss_sum = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="sum")
        loss = loss_sum / int((lab != IGNORE).sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item())
        if step + 1 == NAN_AT:
            for name, p in named:
                if left_out is None or name in left_out:
                    p.grad = None
        for g in opt.param_groups:
            g["lr"] = lr_schedule(step, STEPS)
        opt.step()
    state = {f"{n}.{k}": opt.state[p][k].clone() for n, p in named for k in ("exp_avg", "exp_avg_sq")}
    counts = {n: float(opt.state[p]["step"]) for n, p in named}
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, state, counts


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float | None) -> None:
    """Every tensor finite and close; ``atol=None``: 1e-4 × the largest element of each tensor."""
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert torch.isfinite(got[name]).all(), f"{name} holds a non-finite value"
        tol = 1e-4 * float(w.abs().max()) if atol is None else atol
        torch.testing.assert_close(got[name], w, rtol=RTOL, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def nan_spec(root: Path, shm: Path, variants: dict[str, dict]) -> tuple[Path, tuple]:
    """NAN_CASE's spec (its seeded model and batches under ``root``, its host stores in ``shm``) with a
    NaN injected into the last stage at step NAN_AT and AdamW's state exported: one run per entry
    ``name: overrides`` of ``variants``, one after another in one launch, its files in ``root/<name>``.

    Returns:
        the spec file, (model dir, inputs, labels, lengths).
    """
    model_dir = root / "hf"
    save_seeded_model(NAN_CASE, model_dir)
    inputs, labels, lengths = make_batches(NAN_CASE)
    runs = [{"out_dir": str(root / n), "run_id": f"nan-{n}", "overrides": o} for n, o in variants.items()]
    spec_file = write_spec(NAN_CASE, root, shm, model_dir, inputs, labels, export_state=True, variants=runs)
    spec = json.loads(spec_file.read_text())
    spec["faults"].update({"nan_rank": 1, "nan_step": NAN_AT})
    spec_file.write_text(json.dumps(spec))
    return spec_file, (model_dir, inputs, labels, lengths)


def read_nan_run(root: Path, name: str, output: str):
    """The run ``name`` of nan_spec's spec (under ``root``) from a launch whose output was ``output``:
    returns (run, exported AdamW state, AdamW step counts, the part of the output this run printed);
    checks that exactly step NAN_AT was reported skipped."""
    run = read_run(NAN_CASE, root / name)
    state, counts = {}, {}
    for rank in range(NAN_CASE.stages):
        state.update(load_file(str(root / name / f"state_rank{rank}.safetensors")))
        counts.update(json.loads((root / name / f"rank{rank}.json").read_text())["adamw_steps"])
    assert [s["skipped"] for s in run.steps] == [s + 1 == NAN_AT for s in range(STEPS)]
    return run, state, counts, run_output(output, f"nan-{name}")


NAN_MODES = {"in-backward": True, "deferred": False}
"""The NaN case's runs: ``optim.update_in_backward`` of each."""


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory) -> dict:
    """NAN_CASE with the updates in the backward and deferred: both runs one after another in one
    launch (2 ranks); per mode, read_nan_run's tuple and (model dir, inputs, labels, lengths)."""
    root, shm = tmp_path_factory.mktemp("nan"), shm_store_dir()
    variants = {mode: {"optim.update_in_backward": on} for mode, on in NAN_MODES.items()}
    spec_file, prepared = nan_spec(root, shm, variants)
    output = launch_specs(NAN_CASE.stages, [spec_file], shm, timeout_s=300)
    return {mode: (*read_nan_run(root, mode, output), prepared) for mode in NAN_MODES}


@pytest.mark.parametrize("in_backward", [True, False], ids=["in-backward", "deferred"])
def test_nan_gradient_leaves_out_the_unit_or_the_step(in_backward: bool, nan_runs: dict) -> None:
    """Both modes' runs share one launch (``nan_runs``); each is checked on its own files and on the
    part of the output it printed."""
    run, state, counts, output, (model_dir, inputs, labels, lengths) = nan_runs[
        "in-backward" if in_backward else "deferred"
    ]
    assert math.isnan(run.steps[NAN_AT - 1]["grad_norm"])
    left_out = LEFT_OUT_IN_BACKWARD if in_backward else None
    losses, norms, weights, ref_state, ref_counts = _reference_left_out(
        model_dir, inputs, labels, lengths, left_out
    )
    torch.testing.assert_close([s["loss"] for s in run.steps], losses, rtol=RTOL, atol=0)
    finite = [s for s in range(STEPS) if s + 1 != NAN_AT]
    got_norms = [run.steps[s]["grad_norm"] for s in finite]
    torch.testing.assert_close(got_norms, [norms[s] for s in finite], rtol=RTOL, atol=0)
    assert counts == ref_counts  # exact: STEPS - 1 for the left-out parameters, STEPS for the others
    assert {n for n, c in counts.items() if c < STEPS} == (left_out or set(counts))
    _close(run.weights, weights, ATOL_WEIGHT)
    # AdamW's moments, to a part in 10^4 of each tensor's largest element: fp32 summation order
    # leaves ≤ 1e-5 of it (measured: the tied embedding, a sum of two uses), while a moment that
    # missed (or wrongly took) step 2 is off by ~10% of it
    _close(state, ref_state, atol=None)
    # the other mode's result is far away: the comparison tells the two rules apart
    *_, other, _, _ = _reference_left_out(
        model_dir, inputs, labels, lengths, None if in_backward else LEFT_OUT_IN_BACKWARD
    )
    gap = max(float((run.weights[n] - other[n]).abs().max()) for n in other)
    assert gap > 100 * ATOL_WEIGHT, f"within {gap:.2e} of the other NaN rule"

    if in_backward:
        assert "rank 1 left out ['head'] (NaN/inf gradient) and []" in output
        assert "rank 0 left out [] (NaN/inf gradient) and ['embed'] (updated only after" in output
        assert "set optim.update_in_backward=false to skip whole steps" in output
        # ordering, not speed (step NAN_AT aside: its first final unit, the head, is not updated)
        counts = [c for s, c in enumerate(_in_backward_counts(run.steps, NAN_CASE.stages)) if s + 1 != NAN_AT]
        assert all(n >= 1 for row in counts for n in row), f"no update ran during the backward: {counts}"
    else:
        assert f"step {NAN_AT}: loss or gradient norm is NaN/inf; update skipped on every stage" in output
        assert _in_backward_counts(run.steps, NAN_CASE.stages) == [[0, 0]] * STEPS


REPLICA_CASE = Case(
    "llama-2stage-tied-gpipe-slots2-accum2x4-noclip-2nodes",
    "LlamaForCausalLM",
    2,
    "gpipe",
    slots=2,
    grad_accum=2,
    microbatches=4,
    max_grad_norm=0.0,
    tied=True,
    delay_s=0.002,
    optim_delay_s=0.002,
)
"""As a single node: 2 rounds × 4 micro-batches a step; as two nodes: 1 round × 4 micro-batches each."""
REPLICA_CASE_SPECULATIVE = dataclasses.replace(
    REPLICA_CASE, id="llama-2stage-tied-gpipe-slots2-accum2x4-clip-speculative-2nodes", max_grad_norm=0.3
)
"""The same with clipping that bites on every step and ``optim.speculative`` (tests/dist/test_speculative.py):
the per-unit cross-node sums still run on the optimizer thread, in the schedule's order."""


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory) -> dict:
    """Both replica cases in one pair of launches: each case's single-node spec (write_spec) turned
    into the two nodes' specs (the global batch in ``train.batch_size``, no accumulation, a store
    directory per node), and ``torchrun --nnodes 2 --nproc_per_node 2`` started twice, each node
    running the two cases one after another, writing into each case's ``out_dir``. Per case id:
    (node 0's run, model dir, inputs, labels, lengths, the case's directory)."""
    root, shm = tmp_path_factory.mktemp("two_nodes"), shm_store_dir()
    runs, node_specs = {}, [[], []]
    for num, case in enumerate((REPLICA_CASE, REPLICA_CASE_SPECULATIVE)):
        tmp = root / case.id
        model_dir = tmp / "hf"
        save_seeded_model(case, model_dir)
        inputs, labels, lengths = make_batches(case)  # [steps, 8, B, T]
        base = json.loads(write_spec(case, tmp, shm, model_dir, inputs, labels).read_text())
        for node in range(2):
            overrides = {
                **base["overrides"],
                "optim.speculative": case is REPLICA_CASE_SPECULATIVE,
                "train.grad_accum": 1,
                "store.dir": str(shm / f"node{node}"),
            }
            overrides["train.batch_size"] = 8 * 2  # 8 micro-batches × 2 sequences
            node_specs[node].append(tmp / f"spec_node{node}.json")
            spec = {**base, "overrides": overrides, "run_id": f"inbwd-two-nodes-{num}"}
            node_specs[node][-1].write_text(json.dumps(spec))
        runs[case.id] = (model_dir, inputs, labels, lengths, tmp)
    try:
        for node in range(2):
            (shm / f"node{node}").mkdir()
        _launch_two_nodes(node_specs, timeout_s=300)
        for node in range(2):
            assert not list((shm / f"node{node}").iterdir()), "a host store was left behind"
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    cases = (REPLICA_CASE, REPLICA_CASE_SPECULATIVE)
    return {c.id: (read_run(c, runs[c.id][-1] / "out"), *runs[c.id]) for c in cases}


@pytest.mark.parametrize("case", [REPLICA_CASE, REPLICA_CASE_SPECULATIVE], ids=lambda c: c.id)
def test_two_nodes_in_backward_equal_the_reference(case: Case, two_node_runs: dict) -> None:
    """Both cases' runs share one pair of two-node launches (``two_node_runs``); node 0's ranks are
    read as the run, node 1's weights must equal them bit for bit."""
    run, model_dir, inputs, labels, lengths, case_dir = two_node_runs[case.id]
    node1 = {}
    for rank in (2, 3):
        node1.update(load_file(str(case_dir / "out" / f"weights_rank{rank}.safetensors")))
    assert sorted(node1) == sorted(run.weights)
    for name, w in run.weights.items():
        assert torch.equal(node1[name], w), f"{name} differs between the nodes"

    ref = run_reference(case, model_dir, inputs, labels, lengths)
    assert [s["tokens"] for s in run.steps] == ref.tokens
    torch.testing.assert_close([s["loss"] for s in run.steps], ref.losses, rtol=RTOL, atol=0)
    torch.testing.assert_close([s["grad_norm"] for s in run.steps], ref.norms, rtol=RTOL, atol=0)
    _close(run.weights, ref.weights, ATOL_WEIGHT)
    if case is REPLICA_CASE_SPECULATIVE:  # the redo path ran (measured: 11 units over the 5 steps)
        assert sum(st["breakdown"]["num_rollbacks"] for st in run.steps) > 0
    # without the per-unit cross-node sum node 0 would have trained on its half only
    half = run_reference(case, model_dir, inputs[:, :4], labels[:, :4], lengths[:, :4])
    gap = max(float((run.weights[n] - half.weights[n]).abs().max()) for n in half.weights)
    assert gap > 100 * ATOL_WEIGHT, f"the two-node run is within {gap:.2e} of node 0's half alone"
