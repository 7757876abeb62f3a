"""A streamed unit's gradient accumulated on the device (``stream.grad_on_device``, issue 31 part 1).

Two torchrun launches (one per stage count), each case compared with transformers +
``torch.optim.AdamW`` (test_parity.py's reference and tolerances, its H2D closed form: the weights
still stream at every pass) and each stage's D2H bytes per step against the closed form (4 B per
parameter once per step, ``check_d2h_bytes``): one stage, a tied dense model (the embedding's rows and
the head's use of it accumulate in two device buffers, both shipped into unit 0's gradient) and an
untied mixture of experts updated in the backward (no clipping); two stages, an untied dense model at 4
and at 8 micro-batches a step (the bar: the gradient path's bytes per step do not grow with the
micro-batch count), a tied mixture of experts (the head's use of the embedding ships into
``grad_tied``) and a tied dense model whose embedding and head are resident while its layers stream
with device accumulators. The resume test (check_resume_across) resumes a checkpoint saved with the
accumulators on the host with them on the device, bit for bit, and checks that a run with them on the
device saves, at step 3, the host run's checkpoint bit for bit.
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

_ALL = ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "head")
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_experts": 4, "mlp_only_layers": [0]}

ONE_STAGE = [
    Case(
        "llama-1stage-tied-gpipe-slots2-accum2x4-gradondevice",
        "LlamaForCausalLM",
        1,
        "gpipe",
        2,
        2,
        4,
        tied=True,
        grad_acc=_ALL,
        mutants=("untied_grad",),
    ),
    Case(
        "qwen3moe-1stage-1f1b-slots1-accum1x4-noclip-gradondevice",
        "Qwen3MoeForCausalLM",
        1,
        "1f1b",
        1,
        1,
        4,
        max_grad_norm=0.0,
        grad_acc=_ALL,
        hf=_MOE,
    ),
]
BAR = {
    m: Case(
        f"llama-2stage-1f1b-slots2-accum1x{m}-gradondevice",
        "LlamaForCausalLM",
        2,
        "1f1b",
        2,
        1,
        m,
        grad_acc=_ALL,
    )
    for m in (4, 8)
}
TWO_STAGES = [
    *BAR.values(),
    Case(
        "qwen3moe-2stage-tied-1f1b-slots2-accum2x4-gradondevice",
        "Qwen3MoeForCausalLM",
        2,
        "1f1b",
        2,
        2,
        4,
        tied=True,
        grad_acc=_ALL,
        hf=_MOE,
    ),
    # resident: embed (stage 0) and the tied head (stage 1, 8 B/param within 295,936 B); the layers
    # stream with their accumulators beyond the budget
    Case(
        "llama-2stage-tied-1f1b-slots1-accum2x4-resident-gradondevice",
        "LlamaForCausalLM",
        2,
        "1f1b",
        1,
        2,
        4,
        tied=True,
        device_budget=295_936,
        resident=("embed", "head"),
        grad_acc=_ALL[1:-1],
    ),
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("grad_on_device")
    return {**launch_cases(ONE_STAGE, root), **launch_cases(TWO_STAGES, root)}


@pytest.mark.parametrize("case", [*ONE_STAGE, *TWO_STAGES], ids=lambda c: c.id)
def test_grad_on_device_parity_with_transformers_adamw(case: Case, launched) -> None:
    run, reports, *rest = launched[case.id]
    assert [u for r in reports for u in r["grad_acc"]] == list(case.grad_acc), "not the placement named"
    check_run(case, run, *rest)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu-marked)")
def test_grad_on_device_parity_on_cuda(tmp_path: Path, shm_dir: Path, torchrun) -> None:
    """Streamed units' fp32 accumulators on a CUDA device: one stage, tied (the embedding's rows and
    the head's use of it in two device buffers, both shipped into unit 0's gradient), GPipe, 2 × 4
    micro-batches; each unit's gradient leaves once per step (check_d2h_bytes: 4 B per parameter),
    loss, gradient norm and weights against transformers + ``torch.optim.AdamW`` on the same GPU
    (check_parity's measured tolerance), and the untied-gradient mutant fails. Not yet run on a GPU."""
    case = ONE_STAGE[0]
    assert case.stages == 1 and case.grad_acc == _ALL
    run = check_parity(case, tmp_path, shm_dir, torchrun, device="cuda")
    assert {s["breakdown"]["num_grad_on_device"] for s in run.steps} == {len(_ALL)}


def _params(model_dir: Path) -> dict[str, int]:
    """Parameters per unit, counted from the HF checkpoint's tensors."""
    out: dict[str, int] = {}
    for name, t in load_file(model_dir / "model.safetensors").items():
        unit = (
            "layers." + name.split(".")[2]
            if name.startswith("model.layers.")
            else "embed"
            if name.startswith("model.embed_tokens")
            else "head"
        )
        out[unit] = out.get(unit, 0) + t.numel()
    return out


def test_gradient_bytes_per_step_do_not_grow_with_the_micro_batches(launched) -> None:
    """The bar (two stages, every unit streamed, untied): D2H and host accumulation bytes per step are
    4 and 8 B per parameter (a copy of each shipped accumulator into the store), whatever the
    micro-batch count: 8 micro-batches over 4 ≤ 1.05 (it is 1). The device holds 4 B per parameter of
    accumulators. Without them (closed form, the counts test_parity checks) the ratio is about 2."""
    per_step = {}
    for m, case in BAR.items():
        run, reports, model_dir, *_ = launched[case.id]
        params = _params(model_dir)
        for s, report in enumerate(reports):
            n = sum(params[u] for u in report["units"])
            for step in run.steps:
                b = step["breakdown"]
                assert (b[f"stage{s}/d2h_bytes"], b[f"stage{s}/accum_host_bytes"]) == (4 * n, 8 * n), (m, s)
        last = run.steps[-1]["breakdown"]
        total = sum(params.values())
        assert (last["num_grad_on_device"], last["grad_acc_bytes"]) == (6, 4 * total)
        per_step[m] = [
            (st["breakdown"]["d2h_bytes"], st["breakdown"]["accum_host_bytes"]) for st in run.steps
        ]
        assert {x for x in per_step[m]} == {(4 * total, 8 * total)}
    for (d8, a8), (d4, a4) in zip(per_step[8], per_step[4], strict=True):
        assert d8 / d4 <= 1.05 and a8 / a4 <= 1.05, (d8 / d4, a8 / a4)


# ----------------------------------------------------------------------------- resume across placements


def test_resume_is_bitwise_across_grad_on_device_true_and_false(work: Path) -> None:  # noqa: F811
    """Qwen3, tied, two stages, every unit streamed: the gradients accumulated on the device and on the
    host give the same run bit for bit (the same fp32 adds in the same order, into separate ranges:
    the embedding's rows on stage 0, the head's use of it into ``grad_tied`` on stage 1), so a
    checkpoint of either resumed with the other ends exactly where the uninterrupted run ends (records,
    master weights, moments): the host run's step 3 resumed on the device; the device run's step 3 is
    the host run's, bit for bit (check_resume_across: three launches)."""
    out = check_resume_across(work, 2, "stream.grad_on_device", ["stream.device_budget=0"])
    for on, text in out.items():
        said = [line for line in text.splitlines() if "stream.grad_on_device=" in line]
        assert f"stream.grad_on_device={on}: " + ("6 of 6" if on == "true" else "0 of 6") in text, said
