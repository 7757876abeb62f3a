"""Lean host state (``optim.state=lean``): quantizers, stochastic rounding, one AdamW step, the layout.

References are written here from the papers, independently of quant.py: the dynamic map's closed
form (Dettmers et al. 2021, its 4-bit variant in Li et al. 2023), nearest-entry quantization by a
brute-force argmin, and AdamW's update (arXiv:1711.05101) in plain fp32 tensor arithmetic.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from nodetrain.config.schema import OptimConfig
from nodetrain.model.hf import Unit
from nodetrain.optim import lean as lean_optim
from nodetrain.optim.lean import LeanAdamW
from nodetrain.optim.quant import dequantize_blockwise, dynamic_map, quantize_blockwise, stochastic_round_bf16
from nodetrain.store import LEAN_FORMATS, HostStore, StoreLayout

UNITS = [Unit(0, "layers.0", (), 5000, 4500), Unit(1, "layers.1", (), 333, 300)]
CFG = OptimConfig(lr=1e-2, weight_decay=0.1, eps=1e-8)


def _closed_map_4bit() -> torch.Tensor:
    """The signed 4-bit dynamic-exponent map: 0, 1 and ±10^(e-2)·(midpoints of [0.1, 1] cut into 2^e)."""
    vals = [0.0, 1.0]
    for e in range(3):
        edges = [0.1 + 0.9 * k / 2**e for k in range(2**e + 1)]
        vals += [s * 10 ** (e - 2) * (a + b) / 2 for a, b in itertools.pairwise(edges) for s in (1, -1)]
    return torch.tensor(sorted(vals))


def _ref_roundtrip(x: torch.Tensor, block: int, qmap: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """Nearest map entry times the block's absmax, by brute force; an unsigned (second-moment) map
    without its 0 (Li et al. 2023), and an all-zero block stays zero."""
    out = torch.zeros_like(x)
    if not signed:
        qmap = qmap[qmap > 0]
    for lo in range(0, x.numel(), block):
        b = x[lo : lo + block]
        absmax = b.abs().max()
        if absmax > 0:
            idx = (b[:, None] / absmax - qmap[None, :]).abs().argmin(dim=1)
            out[lo : lo + block] = qmap[idx] * absmax
    return out


def _roundtrip(x: torch.Tensor, bits: int, block: int, signed: bool) -> torch.Tensor:
    n = x.numel()
    codes = torch.empty(-(-n * bits // 8), dtype=torch.uint8)
    absmax = torch.empty(-(-n // block))
    quantize_blockwise(x, codes, absmax, block, bits, signed)
    return dequantize_blockwise(codes, absmax, n, block, bits, signed, out=torch.empty(n))


def test_dynamic_maps_match_closed_form():
    torch.testing.assert_close(dynamic_map(4, True), _closed_map_4bit(), rtol=0, atol=1e-7)
    m8 = dynamic_map(8, True)
    assert m8.numel() == 256 and m8.max() == 1.0 and m8[m8 > 0].min() == pytest.approx(0.55e-6, rel=1e-5)
    u8 = dynamic_map(8, False)
    assert u8.numel() == 256 and bool((u8 >= 0).all()) and len(set(u8.tolist())) == 256


@pytest.mark.parametrize("bits,block,signed", [(4, 128, True), (8, 2048, False), (8, 64, True)])
@pytest.mark.parametrize("n", [4096, 4999])  # whole blocks; a partial last block (and an odd count)
def test_quantize_roundtrip_is_nearest_entry(bits, block, signed, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x = x.abs() ** 2 if not signed else x**3  # moment-like: heavy-tailed
    x[:block] = 0.0  # an all-zero block decodes to zeros
    x[block : block + 5] = 1e-30  # too small for any nonzero entry: rounds to the smallest, not 0
    want = _ref_roundtrip(x, block, dynamic_map(bits, signed), signed)
    torch.testing.assert_close(_roundtrip(x, bits, block, signed), want, rtol=0, atol=0)


def test_stochastic_rounding_is_unbiased_and_brackets():
    x = torch.full((200_000,), 1.0 + 2**-9)  # 1/4 of the way from 1 to the next bf16 (1 + 2^-7)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    stochastic_round_bf16(x.clone(), out, torch.Generator().manual_seed(0))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert out.float().mean().item() == pytest.approx(1.0 + 2**-9, abs=2e-5)  # E = x; nearest would give 1
    inf = torch.tensor([float("inf"), float("nan"), -3.0])
    out3 = torch.empty(3, dtype=torch.bfloat16)
    stochastic_round_bf16(inf.clone(), out3, torch.Generator().manual_seed(0))
    assert out3[0].isinf() and out3[1].isnan() and out3[2] == -3.0


@pytest.fixture
def store(shm_dir):
    layout = StoreLayout(tuple(u.numel for u in UNITS), torch.bfloat16, state="lean")
    s = HostStore.create(layout, shm_dir, "lean-test")
    s.unlink()
    return s


def _seeded(store: HostStore) -> LeanAdamW:
    opt = LeanAdamW(store, UNITS, CFG, seed=1)
    gen = torch.Generator().manual_seed(0)
    for u in UNITS:
        m = torch.randn(u.numel, generator=gen) * 1e-2
        opt.load_unit(u.index, torch.randn(u.numel, generator=gen), m, m**2 + 1e-6)
        store.grad(u.index).copy_(torch.randn(u.numel, generator=gen) * 1e-2)
    return opt


def _decode(store: HostStore, unit: int, name: str) -> torch.Tensor:
    bits, block, signed = LEAN_FORMATS[name]
    n = store.layout.unit_numels[unit]
    codes, absmax = store.buffer(unit, name), store.buffer(unit, name + "_absmax")
    return dequantize_blockwise(codes, absmax, n, block, bits, signed, out=torch.empty(n))


@pytest.mark.parametrize("chunk", [2048, 1 << 18], ids=["chunks", "whole"])
def test_one_lean_step_matches_the_papers(store, monkeypatch, chunk):
    monkeypatch.setattr(lean_optim, "CHUNK_NUMEL", chunk)
    opt = _seeded(store)
    lr, clip, t = 3e-2, 0.5, 1
    for u in UNITS:
        w = store.compute(u.index).float()
        m, v = _decode(store, u.index, "exp_avg"), _decode(store, u.index, "exp_avg_sq")
        g = store.grad(u.index) * clip
        wd = torch.full((u.numel,), CFG.weight_decay)
        wd[u.num_decay :] = 0.0
        m = CFG.beta1 * m + (1 - CFG.beta1) * g
        v = CFG.beta2 * v + (1 - CFG.beta2) * g * g
        denom = (v / (1 - CFG.beta2**t)).sqrt() + CFG.eps
        w_ref = w * (1 - lr * wd) - lr * (m / (1 - CFG.beta1**t)) / denom
        opt.step_unit(u.index, lr, clip)
        for name, want in (("exp_avg", m), ("exp_avg_sq", v)):
            bits, block, signed = LEAN_FORMATS[name]
            got, ref = (
                _decode(store, u.index, name),
                _ref_roundtrip(want, block, dynamic_map(bits, signed), signed),
            )
            # the fused kernel and this formula differ by ulps (absmax too): a tie may pick the neighbour
            assert torch.isclose(got, ref, rtol=1e-5, atol=0).float().mean() > 0.999, name
        got_w = store.compute(u.index).float()
        down = w_ref.bfloat16().float()  # stochastic rounding lands on one of the two bf16 neighbours
        ulp = (w_ref.abs() * 2**-7).clamp_min(1e-30)
        assert bool(((got_w - w_ref).abs() <= ulp * 1.01).all()), (got_w - w_ref).abs().max()
        assert (got_w != down).any(), "always rounded to nearest: not stochastic"
    assert opt.steps_by_name() == {}  # Units here have no HF params; counts live per group
    assert [float(s) for s in opt._steps[0]] == [1.0, 1.0]


def test_skipped_step_changes_nothing_and_replay_is_bit_exact(store, shm_dir):
    opt = _seeded(store)
    before = {
        (u.index, f): store.buffer(u.index, f).clone() for u in UNITS for f in store.layout.fields_of(0)
    }
    opt.step_unit(0, 1e-2, 1.0, found_inf=torch.tensor(1.0))
    for (u, f), t in before.items():
        assert torch.equal(store.buffer(u, f), t), (u, f)
    assert float(opt._steps[0][0]) == 0.0
    opt.step_unit(0, 1e-2)
    after = {f: store.buffer(0, f).clone() for f in store.layout.fields_of(0)}
    for f in store.layout.fields_of(0):  # replay from the same state: the same bytes (resume is exact)
        store.buffer(0, f).copy_(before[(0, f)])
    opt._steps[0] = [torch.tensor(0.0), torch.tensor(0.0)]
    opt.step_unit(0, 1e-2)
    for f, t in after.items():
        assert torch.equal(store.buffer(0, f), t), f


def test_lean_layout_bytes_per_parameter():
    numels = (131_072_000,) + (218_112_000,) * 4 + (131_080_192,)  # Llama-2-7B-like units
    lean = StoreLayout(numels, torch.bfloat16, state="lean")
    full = StoreLayout(numels, torch.bfloat16)
    # 2 (bf16 master) + 0.5 + 4/128 (4-bit m) + 1 + 4/2048 (8-bit v) + 4 (fp32 grad)
    want = 2 + 0.5 + 4 / 128 + 1 + 4 / 2048 + 4
    assert lean.nbytes / sum(numels) == pytest.approx(want, abs=1e-4) and want <= 8
    assert full.nbytes / sum(numels) == pytest.approx(18, abs=1e-4)
    assert lean.dtype("exp_avg") == torch.uint8 and lean.numel(1, "exp_avg") == numels[1] // 2


def test_lean_needs_a_lean_bf16_store(shm_dir):
    s = HostStore.create(StoreLayout((10,), torch.bfloat16), shm_dir, "not-lean")
    s.unlink()
    with pytest.raises(ValueError, match=r"optim\.state=lean"):
        LeanAdamW(s, [Unit(0, "u", (), 10, 10)], CFG)


def test_tiny_second_moment_never_decodes_to_zero(store):
    """An embedding row unused for a while: gradient 0, m and v small but consistent (|m| ≈ sqrt(v)),
    in a v block whose other rows are large. Exact AdamW moves it by ~lr; had v rounded to 0 the step
    would be lr·m/eps = 100·lr (the transient loss spikes of the first lean runs)."""
    opt = LeanAdamW(store, UNITS, OptimConfig(lr=1e-2, weight_decay=0.0, eps=1e-8), seed=1)
    n = UNITS[0].numel
    m, v = torch.zeros(n), torch.full((n,), 1e-2)
    m[:128], v[:128] = 1e-6, 1e-12  # one whole 4-bit m block small; inside a 2048-element v block
    opt.load_unit(0, torch.zeros(n), m, v)
    opt._steps[0] = [torch.tensor(100.0), torch.tensor(100.0)]
    store.grad(0).zero_()
    opt.step_unit(0, 1e-2)
    assert store.compute(0)[:128].float().abs().max() <= 2e-2


@pytest.mark.parametrize("bits,signed", [(4, True), (8, True), (8, False)])
def test_table_lookup_is_searchsorted_for_every_float(bits, signed):
    """quant._nearest (table + corrections) against ``torch.searchsorted`` on 4M random fp32 bit
    patterns (every sign, exponent, denormal and infinity; NaN excluded) plus the map's own values."""
    from nodetrain.optim.quant import _midpoints, _nearest

    pattern = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), dtype=torch.int32, generator=torch.Generator())
    x = pattern.view(torch.float32)
    x = torch.cat(
        [x[~x.isnan()], dynamic_map(bits, signed), _midpoints(bits, signed), torch.tensor([0.0, -0.0])]
    )
    assert torch.equal(_nearest(x, bits, signed).long(), torch.searchsorted(_midpoints(bits, signed), x))
