"""The overlapped CPU optimizer (overlap.py) on a real small host store, single process.

- Per-unit AdamW (optim.py) gives bit for bit what one ``torch.optim.AdamW(fused=True)`` over the
  same two parameter groups gives (so splitting by unit cannot move the parity tests).
- No staleness (DESIGN invariant 3): with the optimizer thread slowed down, a load of a unit
  still returns the weights after that unit's update; without the gate the same check fails.
- In-backward updates start only when a unit's gradient is final (all its offloads of the step,
  from every block that binds it), and then see the whole accumulated gradient.
- The optimizer thread gets its own OpenMP team size without touching the training thread's.
"""

from __future__ import annotations

import threading

import pytest
import torch

from nodetrain.config.schema import OptimConfig
from nodetrain.core.update import policy_for
from nodetrain.engine.device.window import Window
from nodetrain.engine.host.binding import limit_thread
from nodetrain.engine.host.overlap import UnitUpdates
from nodetrain.model import Binding
from nodetrain.model.hf import Unit
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.run.inject import Faults
from nodetrain.store import HostStore, StoreLayout

# Unit 0: an "embedding" [8, 4]; units 1, 2: a [4, 4] matrix + a [4] norm; block 2 also binds
# unit 0's weight, as a tied head does on a single stage.
UNITS = [Unit(0, "embed", (), 32, 32), Unit(1, "layers.0", (), 20, 16), Unit(2, "head", (), 20, 16)]
BINDINGS = [
    (Binding("weight", 0, 0, (8, 4)),),
    (Binding("a", 1, 0, (4, 4)), Binding("b", 1, 16, (4,))),
    (Binding("w", 2, 0, (4, 4)), Binding("n", 2, 16, (4,)), Binding("lm_head.weight", 0, 0, (8, 4))),
]
BLOCKS = [0, 1, 2]
CFG = OptimConfig(lr=1e-2, weight_decay=0.1, eps=1e-8)


def seeded_store(shm_dir, units, dtype: torch.dtype, name: str) -> HostStore:
    """A host store for ``units`` (unlinked: gone with the test), master weights ~ N(0, 1) from seed
    0 and the transfer copies refreshed from them."""
    s = HostStore.create(StoreLayout(tuple(u.numel for u in units), dtype), shm_dir, name)
    s.unlink()
    gen = torch.Generator().manual_seed(0)
    for u in units:
        s.master(u.index).copy_(torch.randn(u.numel, generator=gen))
        s.compute(u.index).copy_(s.master(u.index))
    return s


@pytest.fixture
def store(shm_dir):
    return seeded_store(shm_dir, UNITS, torch.float32, "overlap-test")


def _grads(gen: torch.Generator) -> dict[int, torch.Tensor]:
    return {u.index: torch.randn(u.numel, generator=gen) * 1e-2 for u in UNITS}


def test_per_unit_adamw_is_bitwise_one_torch_adamw(store) -> None:
    ours = StoreAdamW(store, UNITS, CFG)
    ref = []  # (unit, offset, a leaf copy of that group's slice of the master weights)
    for u in UNITS:
        for lo, hi in ((0, u.num_decay), (u.num_decay, u.numel)):
            if hi > lo:
                ref.append((u.index, lo, store.master(u.index)[lo:hi].clone()))
    groups = [
        {"params": [t for _, lo, t in ref if lo == 0], "weight_decay": CFG.weight_decay},
        {"params": [t for _, lo, t in ref if lo > 0], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, fused=True)
    gen = torch.Generator().manual_seed(1)
    for step, (lr, scale) in enumerate([(1e-2, 1.0), (5e-3, 0.25), (2e-3, 1.0)]):
        grads = _grads(gen)
        for u in UNITS:
            store.grad(u.index).copy_(grads[u.index])
        for u, lo, t in ref:
            t.grad = grads[u][lo : lo + t.numel()] * scale
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        ours.step(lr, scale)
        for u in UNITS:
            want = torch.cat([t for i, _, t in ref if i == u.index])
            assert torch.equal(store.master(u.index), want), (step, u.name)
            assert torch.equal(store.compute(u.index), store.master(u.index))


def _policy(clip: bool):
    """Deferred (clipping) or in-backward (no clipping), overlapped."""
    return policy_for(OptimConfig(max_grad_norm=1.0 if clip else 0.0))


def _updates(store, *, clip: bool, delay_s: float) -> UnitUpdates:
    return UnitUpdates(
        StoreAdamW(store, UNITS, CFG),
        BINDINGS,
        BLOCKS,
        _policy(clip),
        threads=1,
        faults=Faults(optim_delay_s=delay_s),
    )


def _acquired(window: Window, sequence: list[int]) -> list[dict[str, torch.Tensor]]:
    out = []
    window.begin(sequence)
    for block in sequence:
        out.append({k: v.clone() for k, v in window.acquire(block).items()})
        window.release()
    window.flush()
    return out


def _final(store, block: int) -> dict[str, torch.Tensor]:
    return {
        b.local_name: store.compute(b.unit)[b.offset : b.offset + b.numel].view(b.shape)
        for b in BINDINGS[block]
    }


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "mutant-no-gate"])
def test_next_forward_never_reads_a_unit_before_its_update(store, gated: bool) -> None:
    """Clipping: updates run after the step, unit by unit (slowed to 50 ms each); the next
    forward's loads must still see every unit's updated weights. Without the gate they do not."""
    updates = _updates(store, clip=True, delay_s=0.05)
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", gate=updates.gate if gated else (lambda block: []))
    try:
        gen = torch.Generator().manual_seed(2)
        for u, g in _grads(gen).items():
            store.grad(u).copy_(g)
        before = {u.index: store.compute(u.index).clone() for u in UNITS}
        updates.finish_step(lr=1e-2, grad_scale=0.5)
        got = _acquired(window, BLOCKS)
        updates.wait_all()
        stale = [
            (b, n)
            for b, views in zip(BLOCKS, got, strict=True)
            for n, t in views.items()
            if not torch.equal(t, _final(store, b)[n])
        ]
        assert all(not torch.equal(before[u.index], store.compute(u.index)) for u in UNITS), (
            "an update did nothing"
        )
        if gated:
            assert stale == []
        else:
            assert stale, "the check cannot fail: the ungated loads were not stale"
    finally:
        updates.close()
        window.close()


def test_finish_step_waits_for_shared_units_only(store) -> None:
    """The tied embedding (unit 0) is read by another stage after the engine's barrier, so the step
    must not end before its update; the other units' updates (300 ms each here) keep running."""
    opt = StoreAdamW(store, UNITS, CFG)
    updates = UnitUpdates(
        opt,
        BINDINGS,
        BLOCKS,
        _policy(clip=True),
        shared_units=(0,),
        threads=1,
        faults=Faults(optim_delay_s=0.3),
    )
    try:
        for u, g in _grads(torch.Generator().manual_seed(5)).items():
            store.grad(u).copy_(g)
        before = store.compute(0).clone()
        updates.finish_step(lr=1e-2, grad_scale=1.0)
        assert not torch.equal(store.compute(0), before), "returned before the shared unit's update"
        assert not all(f.done() for f in updates.gate(2)), "waited for every update: no overlap"
    finally:
        updates.close()


@pytest.mark.parametrize("offloads_per_block", [2, 1], ids=["counted", "mutant-counts-one"])
def test_in_backward_update_sees_the_whole_gradient(store, offloads_per_block: int) -> None:
    """No clipping: each unit is updated as soon as its gradient is final. Unit 0 is bound by blocks
    0 and 2 (the tied head); every block is offloaded twice (two micro-batches). The result must
    equal AdamW on the sum of all four offloads of unit 0 (and two of the others); a count that
    fires after the first offload updates on a partial gradient and must differ."""
    ref_store_master = {u.index: store.master(u.index).clone() for u in UNITS}
    updates = _updates(store, clip=False, delay_s=0.0)
    window = Window(
        store, BINDINGS, BLOCKS, 2, "cpu", on_arrival=updates.arrived, faults=Faults(copy_delay_s=0.002)
    )
    gen = torch.Generator().manual_seed(3)
    total = {u.index: torch.zeros(u.numel) for u in UNITS}
    try:
        updates.begin_step(lr=1e-2, arrivals=list(reversed(BLOCKS)) * offloads_per_block)
        for _ in range(2):  # micro-batches, backward order
            for block in reversed(BLOCKS):
                grads = {b.local_name: torch.randn(b.shape, generator=gen) for b in BINDINGS[block]}
                for b in BINDINGS[block]:
                    total[b.unit][b.offset : b.offset + b.numel] += grads[b.local_name].reshape(-1)
                window.offload(block, grads)
        window.flush()
        updates.wait_all()
    finally:
        updates.close()
        window.close()
    # the reference: one fused AdamW step per unit on the full gradient, from the same start
    ref = {}
    for u in UNITS:
        p = ref_store_master[u.index]
        groups = [{"params": [p[: u.num_decay]], "weight_decay": CFG.weight_decay}]
        if u.numel > u.num_decay:
            groups.append({"params": [p[u.num_decay :]], "weight_decay": 0.0})
        for g in groups:
            (t,) = g["params"]
            lo = 0 if g is groups[0] else u.num_decay
            t.grad = total[u.index][lo : lo + t.numel()].clone()
        torch.optim.AdamW(groups, lr=1e-2, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, fused=True).step()
        ref[u.index] = torch.cat([g["params"][0] for g in groups])
    same = all(torch.equal(store.master(u.index), ref[u.index]) for u in UNITS)
    assert same == (offloads_per_block == 2)


def test_in_backward_grad_norm_matches_the_flushed_gradient(store) -> None:
    updates = _updates(store, clip=False, delay_s=0.0)
    window = Window(store, BINDINGS, BLOCKS, 2, "cpu", on_arrival=updates.arrived)
    gen = torch.Generator().manual_seed(4)
    try:
        updates.begin_step(lr=1e-2, arrivals=list(reversed(BLOCKS)))
        grads = {
            blk: {b.local_name: torch.randn(b.shape, generator=gen) for b in BINDINGS[blk]} for blk in BLOCKS
        }
        want = 0.0
        sums = {u.index: torch.zeros(u.numel, dtype=torch.float64) for u in UNITS}
        for blk in reversed(BLOCKS):
            for b in BINDINGS[blk]:
                sums[b.unit][b.offset : b.offset + b.numel] += grads[blk][b.local_name].reshape(-1).double()
            window.offload(blk, grads[blk])
        window.flush()
        want = float(sum((s * s).sum() for s in sums.values()))
        torch.testing.assert_close(updates.grad_sq_sum(), want, rtol=1e-6, atol=0)
    finally:
        updates.close()
        window.close()


def test_optimizer_thread_has_its_own_team_size() -> None:
    main_threads = torch.get_num_threads()
    want = main_threads + 2
    seen = []

    def worker() -> None:
        limit_thread(want)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [want]
    assert torch.get_num_threads() == main_threads


TINY_VOCAB = 320
"""The tiny engine's vocabulary: at least a byte-level BPE's 257 (data.vocab_size's lower bound)."""


def tiny_engine_config(steps: int = 1, stream=None, **optim):
    """A one-stage config of a 2-layer, hidden-32 Llama on 8-token micro-batches (2 per step), fp32,
    one optimizer thread, ``optim`` set (for ``bench._engine.make_engine``)."""
    from bench._engine import base_config, model_config

    hf = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
    }
    cfg = base_config(
        model_config("llama_10m", TINY_VOCAB, **hf),
        train={"seq_len": 8, "micro_batch_size": 1, "dtype": "float32", "steps": steps},
        pipeline={"stages": 1, "microbatches": 2},
        stream=stream or {},
        optim={"threads": 1, **optim},
    )
    cfg.data.vocab_size = TINY_VOCAB
    return cfg


@pytest.mark.parametrize(
    "optim", [{"max_grad_norm": 1.0}, {"overlap": False}], ids=["deferred", "no-overlap"]
)
def test_grad_norm_runs_on_the_accumulation_team(monkeypatch, optim, one_rank_world) -> None:
    """The norm² after the flush (deferred clipping, or no overlap) runs on the D2H worker with its
    OpenMP team of ``stream.accum_threads``, not on the training thread that torchrun leaves at
    ``OMP_NUM_THREADS=1`` (set here on this thread); its value is the float64 sum of the fp32 dots."""
    from bench._engine import make_engine

    seen: list[tuple[str, int, float, float]] = []
    grad_sq_sum = StoreAdamW.grad_sq_sum

    def recorded(self) -> float:
        got = grad_sq_sum(self)
        want = sum(float(self.store.grad(u.index).double().square().sum()) for u in self.units)
        seen.append((threading.current_thread().name, torch.get_num_threads(), got, want))
        return got

    monkeypatch.setattr(StoreAdamW, "grad_sq_sum", recorded)
    cfg = tiny_engine_config(stream={"accum_threads": 2}, **optim)
    before = torch.get_num_threads()
    limit_thread(1)  # the training thread under torchrun
    engine = None
    try:
        engine, _ = make_engine(cfg, "norm-team")
        x = torch.randint(
            0,
            TINY_VOCAB,
            (engine.run.batch.global_microbatches, 1, 8),
            generator=torch.Generator().manual_seed(0),
        )
        engine.train_step(0, x, x)
        engine.wait_optimizer()
    finally:
        if engine is not None:
            engine.close()
        limit_thread(before)
    assert [(name.split("_")[0], team) for name, team, _, _ in seen] == [("d2h", 2)], seen
    ((_, _, got, want),) = seen
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
