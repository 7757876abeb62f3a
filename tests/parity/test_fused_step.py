"""One fused optimizer pass (optim.py ``StoreAdamW.step_unit``), single process, random tensors.

The reference is what the pass replaces: ``torch.nn.utils.clip_grad_norm_`` then ``torch.optim.AdamW``
(its default, non-fused implementation), with a unit whose gradient is NaN left out of that step.
Chunks are made tiny (64 elements) so every unit is cut into several, one of them partial; each test
also runs with whole groups (what a multi-thread OpenMP team gets, ``optim.chunk_numel``).
"""

from __future__ import annotations

import pytest
import torch
from test_overlap import seeded_store

from nodetrain.config.schema import OptimConfig
from nodetrain.model.hf import Unit
from nodetrain.optim import adamw as optim
from nodetrain.optim.adamw import StoreAdamW, clip_coef
from nodetrain.store import HostStore

UNITS = [Unit(0, "layers.0", (), 1000, 900), Unit(1, "layers.1", (), 333, 300)]
CFG = OptimConfig(lr=1e-2, weight_decay=0.1, eps=1e-8, max_grad_norm=0.5)
STEPS = [(1e-2, None), (5e-3, 1), (2e-3, None)]  # (lr, the unit whose gradient is NaN)
# Dividing by 1/coef instead of multiplying by coef, and torch's fused vs its for-each kernel, move a
# weight by a few fp32 ulps of its O(1) value; a missed clip or a wrong step count moves it by ~lr.
ATOL = 1e-6


@pytest.fixture(params=[64, None], ids=["chunks", "whole-groups"])
def store(shm_dir, monkeypatch, request):
    monkeypatch.setattr(optim, "chunk_numel", lambda: request.param)
    return seeded_store(shm_dir, UNITS, torch.bfloat16, "fused-test")


def _reference(store: HostStore) -> dict[int, tuple[list[torch.Tensor], torch.optim.AdamW]]:
    """Per unit, leaf copies of its two parameter groups and a plain ``torch.optim.AdamW`` over them."""
    ref = {}
    for u in UNITS:
        decay = store.master(u.index)[: u.num_decay].clone().requires_grad_()
        no_decay = store.master(u.index)[u.num_decay :].clone().requires_grad_()
        groups = [
            {"params": [decay], "weight_decay": CFG.weight_decay},
            {"params": [no_decay], "weight_decay": 0.0},
        ]
        ref[u.index] = (
            [decay, no_decay],
            torch.optim.AdamW(groups, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps),
        )
    return ref


def _state(store: HostStore, opt: StoreAdamW, unit: int) -> list[torch.Tensor]:
    steps = [st["step"] for st in opt._opts[unit].state.values()]
    fields = ("master", "exp_avg", "exp_avg_sq", "compute")
    return [store.buffer(unit, f).clone() for f in fields] + [s.clone() for s in steps]


def test_fused_step_equals_clip_then_adamw_and_skips_a_nan_unit(store) -> None:
    ours, ref = StoreAdamW(store, UNITS, CFG), _reference(store)
    gen = torch.Generator().manual_seed(1)
    clipped = []
    for lr, nan_unit in STEPS:
        grads = {u.index: torch.randn(u.numel, generator=gen) for u in UNITS}  # norm ≫ 0.5: clipped
        if nan_unit is not None:
            grads[nan_unit][7] = float("nan")
        finite = [u.index for u in UNITS if u.index != nan_unit]
        for u in UNITS:
            store.grad(u.index).copy_(grads[u.index])
        # reference: clip_grad_norm_ (in place, on views of grads) over the finite units, AdamW on
        # them, the NaN unit left out
        leaves = [t for i in finite for t in ref[i][0]]
        for i in finite:
            ref[i][0][0].grad, ref[i][0][1].grad = (
                grads[i][: UNITS[i].num_decay],
                grads[i][UNITS[i].num_decay :],
            )
        norm = torch.nn.utils.clip_grad_norm_(leaves, CFG.max_grad_norm)
        for i in finite:
            for group in ref[i][1].param_groups:
                group["lr"] = lr
            ref[i][1].step()
        # ours: the same clip coefficient folded into the fused pass, the NaN unit flagged
        coef = clip_coef(float(norm), CFG.max_grad_norm)
        clipped.append(coef < 1)
        for i in finite:
            ours.step_unit(i, lr, coef)
        if nan_unit is not None:
            before = _state(store, ours, nan_unit)
            ours.step_unit(nan_unit, lr, coef, found_inf=torch.tensor(1.0))
            for got, want in zip(_state(store, ours, nan_unit), before, strict=True):
                assert torch.equal(got, want), "a flagged unit must be left exactly as it was"
        for u in UNITS:
            want = torch.cat([t.detach() for t in ref[u.index][0]])
            torch.testing.assert_close(store.master(u.index), want, rtol=0, atol=ATOL)
            assert torch.equal(store.compute(u.index), store.master(u.index).to(torch.bfloat16))
    assert all(clipped)
    counts = {u.index: [float(st["step"]) for st in ours._opts[u.index].state.values()] for u in UNITS}
    assert counts == {0: [3.0, 3.0], 1: [2.0, 2.0]}


def test_chunked_pass_is_bitwise_torch_fused_adamw(store) -> None:
    """Cutting a unit into chunks changes no bit: the same kernel, on views, elementwise (chunks are
    a multiple of the kernel's vector width, so only a group's last elements take its scalar tail)."""
    ours = StoreAdamW(store, UNITS, CFG)
    ref = _reference(store)
    leaves = [t for u in UNITS for t in ref[u.index][0]]
    groups = [
        {"params": leaves[0::2], "weight_decay": CFG.weight_decay},
        {"params": leaves[1::2], "weight_decay": 0.0},
    ]
    fused = torch.optim.AdamW(groups, lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, fused=True)
    fused.grad_scale = torch.tensor(1 / 0.3)  # what the kernel divides by: ours passes 1 / coef
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        for u in UNITS:
            store.grad(u.index).copy_(torch.randn(u.numel, generator=gen))
            decay, no_decay = ref[u.index][0]
            decay.grad, no_decay.grad = (
                store.grad(u.index)[: u.num_decay].clone(),
                store.grad(u.index)[u.num_decay :].clone(),
            )
        fused.step()
        for u in UNITS:
            ours.step_unit(u.index, CFG.lr, 0.3)
            assert torch.equal(store.master(u.index), torch.cat([t.detach() for t in ref[u.index][0]]))
