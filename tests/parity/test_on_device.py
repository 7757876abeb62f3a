"""A resident unit's optimizer on the device (``optim.on_device``, issue 34 part 3).

The placement's rule against its closed form in bytes and the start-up refusal run in milliseconds.
Then two torchrun launches, each compared with transformers + ``torch.optim.AdamW``
(test_parity.py's reference and tolerances): one stage, a tied dense model, every unit resident with
its optimizer on the device (the embedding's two uses summed on the device; no gradient,
accumulation or optimizer byte crosses to the host in any step); two stages, a tied dense model (its
embedding and head keep their optimizer on the host: two stages read them) and an untied mixture of
experts partly resident. The resume test (check_resume_across) resumes a checkpoint saved with the
optimizer on the host with it on the device, ending bit for bit where the uninterrupted run does, and
checks that a run with it on the device saves, at step 3, the host run's checkpoint bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint_runs import (
    check_resume_across,
    work,  # noqa: F401  (the module's corpus and store directory, a fixture)
)
from test_parity import Case, check_parity, check_run, launch_cases

from nodetrain.config.checks import ConfigError
from nodetrain.config.schema import Config, validate
from nodetrain.core.placement import optimizer_blocks, place_stages, saved_host_bytes
from nodetrain.core.step_plan import StepPlan
from nodetrain.cost.memory import StageMemory
from nodetrain.cost.shape import ModelShape

# ----------------------------------------------------------------------------- the rule, in bytes


def _shape(tied: bool) -> ModelShape:
    """Embedding 100 elements, three layers of 50, head 10 (+ the 100 of the embedding it binds)."""
    return ModelShape(
        unit_numels=(100, 50, 50, 50, 10),
        load_numels=(100, 50, 50, 50, 110 if tied else 10),
        largest_tensors=(100, 50, 50, 50, 100 if tied else 10),
        costs=(0, 50, 50, 50, 110 if tied else 10),
        tied=tied,
        hidden=10,
        intermediate=20,
        vocab=10,
        heads=1,
        kv_heads=1,
        head_dim=10,
        qk_norm=False,
    )


def _plan(blocks=range(5), stage: int = 0, num_stages: int = 1) -> StepPlan:
    return StepPlan.step("1f1b", num_stages, stage, 1, 2, blocks, stage == num_stages - 1)


def test_optimizer_blocks_closed_form() -> None:
    """fp32 (e = 4): resident 8 B/param, with the optimizer 20 B/param (12 more)."""
    shape, plan = _shape(False), _plan()
    everything = 260 * 8
    assert optimizer_blocks(False, shape, plan, 4, everything + 10**6, frozenset(range(5))) == (
        frozenset(range(5)),
        frozenset(),
    )
    # auto: all resident (2080 B), then 1800 B = 12 × 150: block 0 (1200) and block 1 (600), in
    # block order (every block saves the same host bytes per device byte)
    res, opt = optimizer_blocks("auto", shape, plan, 4, everything + 1800, frozenset(range(5)))
    assert (res, opt) == (frozenset(range(5)), frozenset({0, 1}))
    # a block that does not fit is skipped: 0 (1200), then only the head (120) fits in 599
    assert optimizer_blocks("auto", shape, plan, 4, everything + 1799, frozenset(range(5)))[1] == {0, 4}
    assert optimizer_blocks("auto", shape, plan, 4, everything + 1199, frozenset(range(5)))[1] == {1, 4}
    # true: charged at 20 B/param within the budget: the head (200) first, then the embedding (2000:
    # the most link bytes saved per device byte), else one layer (1000)
    res, opt = optimizer_blocks(True, shape, plan, 4, 200 + 2000, frozenset(range(5)))
    assert res == opt == frozenset({0, 4})
    res, opt = optimizer_blocks(True, shape, plan, 4, 200 + 1999, frozenset(range(5)))
    assert res == opt == frozenset({1, 4})
    assert optimizer_blocks(True, shape, plan, 4, 260 * 20, frozenset(range(5))) == (
        frozenset(range(5)),
        frozenset(range(5)),
    )
    assert saved_host_bytes(10, 2) == 10 * (4 + 2 + 8 + 42)


def test_a_tied_embedding_keeps_its_optimizer_on_the_host_across_stages() -> None:
    tied = _shape(True)
    # one stage: block 0 and the head go together; without room for block 0, neither
    res, opt = optimizer_blocks(True, tied, _plan(), 4, 110 * 20 + 50 * 20, frozenset(range(5)))
    assert res == frozenset({1, 4}) and opt == frozenset({1})
    assert optimizer_blocks(True, tied, _plan(), 4, 360 * 20, frozenset(range(5)))[1] == frozenset(range(5))
    # two stages: the embedding (stage 0) and the head (stage 1) stay on the host, resident still
    plans = [_plan(range(0, 2), 0, 2), _plan(range(2, 5), 1, 2)]
    mem = [StageMemory(k, p.blocks, 0, 0, 0, 0, 0) for k, p in enumerate(plans)]
    _, resident, on_device = place_stages(10**6, tied, plans, mem, (0, 0), 4, True)
    assert resident == (frozenset({0, 1}), frozenset({2, 3, 4}))
    assert on_device == (frozenset({1}), frozenset({2, 3}))


def test_on_device_true_with_lean_state_is_refused() -> None:
    """Field, value and fix in the one start-up error (the model left unset: its problems are listed too)."""
    cfg = Config()
    cfg.optim.on_device, cfg.optim.state, cfg.train.dtype = True, "lean", "bfloat16"
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert (
        "optim.on_device=true: keeps fp32 master weights and moments on the device, optim.state=lean"
        in str(err.value)
    )
    assert "set optim.on_device=auto or false (or optim.state=full)" in str(err.value)
    cfg.optim.on_device = "auto"  # auto: none, said in the start-up line
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert "optim.on_device" not in str(err.value)


# ----------------------------------------------------------------------------- parity with transformers

_ALL = ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "head")
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_experts": 4, "mlp_only_layers": [0]}
_MOE_BUDGET = 16_448 * 20 + 37_280 * 20
"""fp32 with the optimizer on the device: 20 B/param. Stage 1: the head (16,448 elements) and one
layer (37,280); stage 0: the embedding (16,384) and layers.0 (37,024) fit, layers.1 does not."""
_MOE_RESIDENT = ("embed", "layers.0", "layers.2", "head")

ONE_STAGE = Case(
    "llama-1stage-tied-1f1b-slots2-accum2x4-ondevice-all",
    "LlamaForCausalLM",
    1,
    "1f1b",
    2,
    2,
    4,
    tied=True,
    device_budget=10**8,
    resident=_ALL,
    on_device=_ALL,
    mutants=("untied_grad",),
)
TWO_STAGES = [
    # the tied embedding is read by both stages: it and the head stay resident with a host optimizer
    Case(
        "llama-2stage-tied-1f1b-slots1-accum2x4-ondevice",
        "LlamaForCausalLM",
        2,
        "1f1b",
        1,
        2,
        4,
        tied=True,
        device_budget=10**8,
        resident=_ALL,
        on_device=_ALL[1:-1],
    ),
    # a mixture of experts, untied, streamed units updated in the backward beside the device's
    Case(
        "qwen3moe-2stage-1f1b-slots2-accum1x4-noclip-ondevice-part",
        "Qwen3MoeForCausalLM",
        2,
        "1f1b",
        2,
        1,
        4,
        max_grad_norm=0.0,
        device_budget=_MOE_BUDGET,
        resident=_MOE_RESIDENT,
        on_device=_MOE_RESIDENT,
        hf=_MOE,
    ),
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("on_device")
    return {**launch_cases([ONE_STAGE], root), **launch_cases(TWO_STAGES, root)}


@pytest.mark.parametrize("case", [ONE_STAGE, *TWO_STAGES], ids=lambda c: c.id)
def test_on_device_parity_with_transformers_adamw(case: Case, launched) -> None:
    run, reports, *rest = launched[case.id]
    assert [u for r in reports for u in r["on_device"]] == list(case.on_device), "not the placement named"
    check_run(case, run, *rest)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu-marked)")
def test_on_device_parity_on_cuda(tmp_path: Path, shm_dir: Path, torchrun) -> None:
    """The fused AdamW, the norm² and the tied sum on a CUDA device, against a reference there
    (test_parity.check_parity's measured tolerance). Not yet run on a GPU."""
    check_parity(ONE_STAGE, tmp_path, shm_dir, torchrun, device="cuda")


def test_every_unit_on_the_device_moves_no_host_byte(launched) -> None:
    """One stage, every unit resident with its optimizer on the device: no load after the start, no
    gradient, accumulation or host optimizer byte, in every step."""
    run, _, model_dir, *_ = launched[ONE_STAGE.id]
    for key in ("h2d_bytes", "d2h_bytes", "accum_host_bytes", "optim_host_bytes"):
        assert [s["breakdown"][f"stage0/{key}"] for s in run.steps] == [0] * ONE_STAGE.steps, key
    # the device holds fp32 master, moments and gradient of every parameter (16 B each; the tied
    # embedding once) and the head's own fp32 gradient of it, counted from the HF checkpoint's tensors
    saved = load_file(model_dir / "model.safetensors")
    params = sum(t.numel() for t in saved.values())
    want = 16 * params + 4 * saved["model.embed_tokens.weight"].numel()
    last = run.steps[-1]["breakdown"]
    assert (last["num_on_device"], last["device_optimizer_bytes"]) == (6, want)


# ----------------------------------------------------------------------------- resume across placements


def test_resume_is_bitwise_across_on_device_true_and_false(work: Path) -> None:  # noqa: F811
    """Qwen3, tied, one stage, every unit resident (the CPU's budget given in bytes): the optimizer on
    the device and on the host give the same run bit for bit, so a checkpoint of either resumed with
    the other ends exactly where the uninterrupted run ends (records, master weights, moments): the
    host run's step 3 resumed on the device; the device run's step 3 is the host run's, bit for bit
    (check_resume_across: three launches)."""
    out = check_resume_across(work, 1, "optim.on_device", ["stream.device_budget=1000000000"])
    for on, text in out.items():
        said = [line for line in text.splitlines() if "optim.on_device=" in line or "blocks resident" in line]
        assert f"optim.on_device={on}: " + ("6 of 6" if on == "true" else "every unit") in text, said
