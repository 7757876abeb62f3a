"""Waves (``pipeline.wave``, issue 31 part 2): W micro-batches per load, one gradient ship per item.

Three torchrun launches (1, 2 and 4 ranks), every case compared with transformers + ``torch.optim.AdamW``
(test_parity.py's reference and tolerances; a wave changes only the order of fp32 sums) and each
stage's H2D bytes per step against the closed form over items (``_wave_h2d_numel``: the schedule over
M/W items, each item loading every block once per forward and once per backward, a use right after a
use of the same block sharing its load). Cases: one stage, untied and tied (the head's wave sum and the
embedding's rows land in one range), a Qwen3-MoE with every unit's gradient on the device
(``stream.grad_on_device``: its per-step accumulators, unchanged) and a tied Llama whose layers keep
their graphs (``stream.recompute=false``: W graphs per item in flight); two stages: the bar pair (W = 1
and W = M = 4, untied, every unit streamed), a tied GPipe case without clipping and a Mixtral; four
stages once. The bar: D2H and host accumulation bytes per step from the checkpoint's parameter counts
(``test_wave_bar_bytes_per_step``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_parity
import torch
from safetensors.torch import load_file
from test_parity import Case, check_run, launch_cases

from nodetrain.core.schedule import build_schedule, step_rounds

_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_experts": 4, "mlp_only_layers": [0]}
_NO_SPECIAL = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
_MIXTRAL = {"num_experts_per_tok": 2, "num_local_experts": 4, "intermediate_size": 32, **_NO_SPECIAL}
_ALL = ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "head")

# (case, wave, more config keys)
ONE_STAGE = [
    (Case("llama-1stage-gpipe-slots2-accum1x4-wave2", "LlamaForCausalLM", 1, "gpipe", 2, 1, 4), 2, {}),
    (
        Case(
            "llama-1stage-tied-1f1b-slots1-accum2x4-wave4-keep-noclip",
            "LlamaForCausalLM",
            1,
            "1f1b",
            1,
            2,
            4,
            tied=True,
            max_grad_norm=0.0,
            mutants=("untied_grad",),
        ),
        4,
        {"stream.recompute": False},
    ),
    (
        Case(
            "qwen3moe-1stage-1f1b-slots2-accum1x4-wave2-gradondevice",
            "Qwen3MoeForCausalLM",
            1,
            "1f1b",
            2,
            1,
            4,
            grad_acc=_ALL,
            hf=_MOE,
        ),
        2,
        {},
    ),
]
BAR = {
    w: Case(f"llama-2stage-1f1b-slots2-accum1x4-bar-wave{w}", "LlamaForCausalLM", 2, "1f1b", 2, 1, 4)
    for w in (1, 4)
}
TWO_STAGES = [
    *((case, w, {}) for w, case in BAR.items()),
    (
        Case(
            "llama-2stage-tied-gpipe-slots1-accum2x4-wave2-noclip",
            "LlamaForCausalLM",
            2,
            "gpipe",
            1,
            2,
            4,
            tied=True,
            max_grad_norm=0.0,
            mutants=("untied_grad",),
        ),
        2,
        {},
    ),
    (
        Case(
            "mixtral-2stage-1f1b-slots2-accum1x4-wave2",
            "MixtralForCausalLM",
            2,
            "1f1b",
            2,
            1,
            4,
            hf=_MIXTRAL,
            atol_weight=5e-6,
        ),
        2,
        {},
    ),
]
FOUR_STAGES = [
    (Case("llama-4stage-1f1b-slots1-accum2x4-wave2", "LlamaForCausalLM", 4, "1f1b", 1, 2, 4), 2, {}),
]
WAVE = {case.id: w for case, w, _ in [*ONE_STAGE, *TWO_STAGES, *FOUR_STAGES]}


def _wave_h2d_numel(case: Case, stage: int, names: list[str], numel: dict[str, int], rows: int) -> int:
    """Closed form of one step's H2D elements of a stage with waves: the schedule over the round's M/W
    items (``WAVE[case.id]``), an item's forward loading every block but the embedding, its backward
    every block but the embedding and the last stage's head, in reverse, once per item; a use right
    after a use of the same block shares its load. The embedding moves its ``rows`` per micro-batch."""
    wave = WAVE[case.id]
    rounds, per_round = step_rounds(case.schedule, case.grad_accum, case.microbatches)
    actions = build_schedule(case.schedule, case.stages, stage, per_round // wave) * rounds
    fwd = [n for n in names if n != "embed"]
    bwd = [n for n in fwd if not (stage == case.stages - 1 and n == "head")][::-1]
    seq = [n for a in actions for n in (fwd if a.kind == "F" else bwd)]
    loaded = [n for k, n in enumerate(seq) if k == 0 or seq[k - 1] != n]
    return sum(numel[n] for n in loaded) + (rows if "embed" in names else 0)


def _launch(cases, root: Path) -> dict:
    overrides = {case.id: {"pipeline.wave": w, **more} for case, w, more in cases}
    return launch_cases([case for case, _, _ in cases], root, overrides)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    root, got = tmp_path_factory.mktemp("wave"), {}

    def get(stages: int) -> dict:
        if stages not in got:
            cases = {1: ONE_STAGE, 2: TWO_STAGES, 4: FOUR_STAGES}[stages]
            got[stages] = _launch(cases, root)
        return got[stages]

    return get


@pytest.mark.parametrize(
    "case", [c for c, _, _ in [*ONE_STAGE, *TWO_STAGES, *FOUR_STAGES]], ids=lambda c: c.id
)
def test_wave_parity_with_transformers_adamw(case: Case, launched, monkeypatch) -> None:
    run, reports, *rest = launched(case.stages)[case.id]
    assert [u for r in reports for u in r["grad_acc"]] == list(case.grad_acc), "not the placement named"
    assert {s["breakdown"]["wave"] for s in run.steps} == {WAVE[case.id]}, "metrics.jsonl's wave"
    monkeypatch.setattr(test_parity, "_step_h2d_numel", _wave_h2d_numel)  # the loads over items
    check_run(case, run, *rest)


def _params(model_dir: Path) -> dict[str, int]:
    """Parameters per unit, counted from the HF checkpoint's tensors."""
    out: dict[str, int] = {}
    for name, t in load_file(model_dir / "model.safetensors").items():
        unit = test_parity.unit_of(name)
        out[unit] = out.get(unit, 0) + t.numel()
    return out


def _expected(units, params, hidden: int, vocab: int, rows: list[int], items: int) -> tuple:
    """(D2H, host accumulation) bytes of one step of a stage of ``units`` (fp32, e = 4, untied, every
    unit streamed), from the parameter counts: each dense unit ships once per backward item — its
    fp32 wave sum for W > 1 (4 B/param D2H; the host's first copy 8, each later add 12), its staged
    gradient per micro-batch for W = 1 (4 D2H; the first copy e + 4, each later add e + 8) — and the
    embedding its used rows per micro-batch (``rows``: distinct ids each; the host zeroes [V, D] once
    and adds each row element: e + 8)."""
    d2h = accum = 0
    for u in units:
        if u == "embed":
            d2h += 4 * hidden * sum(rows)
            accum += 4 * vocab * hidden + (4 + 8) * hidden * sum(rows)
            continue
        p = params[u]  # one ship per item: a wave sum (W > 1) or a micro-batch's gradient (W = 1)
        d2h += 4 * p * items
        accum += 8 * p + 12 * p * (items - 1)
    return d2h, accum


def test_wave_bar_bytes_per_step(launched) -> None:
    """The bar (two stages, 1F1B, M = 4, untied, every unit streamed): with W = M = 4 each stage's D2H
    and host accumulation bytes per step are one fp32 ship per unit per item (and the embedding's
    rows per micro-batch), from the checkpoint's parameter counts; the H2D loads of the streamed
    blocks (rows aside) are the closed form over one item. Printed: each figure against W = 1's."""
    runs = launched(2)
    seen = {}
    for w, case in BAR.items():
        run, reports, model_dir, inputs, *_ = runs[case.id]
        params = _params(model_dir)
        hidden, vocab = test_parity.HF_BASE["hidden_size"], test_parity.VOCAB
        items = case.grad_accum * case.microbatches // w
        for k, step in enumerate(run.steps):
            rows = [len(torch.unique(mb)) for mb in inputs[k]]
            for s, report in enumerate(reports):
                b = step["breakdown"]
                want = _expected(report["units"], params, hidden, vocab, rows if s == 0 else [], items)
                got = (b[f"stage{s}/d2h_bytes"], b[f"stage{s}/accum_host_bytes"])
                assert got == want, (w, k, s, got, want)
                seen.setdefault((w, s), []).append((b[f"stage{s}/h2d_bytes"], *got))
    for s in range(2):
        print(f"stage {s}: (h2d, d2h, accum) W=1 {seen[(1, s)][0]}  W=4 {seen[(4, s)][0]}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu-marked)")
def test_wave_parity_on_cuda(tmp_path: Path, shm_dir: Path, torchrun, monkeypatch) -> None:
    """Waves on a CUDA device: one stage, untied, GPipe, W=2 of 4 micro-batches, every unit streamed
    (the wave sums in fp32 device buffers, shipped once per item through the pinned staging, a buffer
    rewritten only after its ship landed): loss, gradient norm, weights and H2D bytes against
    transformers + ``torch.optim.AdamW`` on the same GPU (check_parity's measured tolerance). Not yet
    run on a GPU."""
    case, wave, more = ONE_STAGE[0]
    monkeypatch.setattr(test_parity, "_step_h2d_numel", _wave_h2d_numel)
    run = test_parity.check_parity(case, tmp_path, shm_dir, torchrun, "cuda", {"pipeline.wave": wave, **more})
    assert {s["breakdown"]["wave"] for s in run.steps} == {wave}
