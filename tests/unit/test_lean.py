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


def _ref_bracket(x: torch.Tensor, block: int, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The map entries just below and just above each x / absmax, times the block's absmax (brute force)."""
    below, above = torch.zeros_like(x), torch.zeros_like(x)
    for lo in range(0, x.numel(), block):
        b = x[lo : lo + block]
        absmax = b.abs().max()
        y = b[:, None] / absmax
        below[lo : lo + block] = torch.where(qmap[None, :] <= y, qmap[None, :], -2).amax(dim=1) * absmax
        above[lo : lo + block] = torch.where(qmap[None, :] >= y, qmap[None, :], 2).amin(dim=1) * absmax
    return below, above


def _roundtrip(x: torch.Tensor, bits: int, block: int, signed: bool, generator=None) -> torch.Tensor:
    n = x.numel()
    codes = torch.empty(-(-n * bits // 8), dtype=torch.uint8)
    absmax = torch.empty(-(-n // block))
    quantize_blockwise(x, codes, absmax, block, bits, signed, generator)
    return dequantize_blockwise(codes, absmax, n, block, bits, signed, out=torch.empty(n))


def test_stochastic_quantization_brackets_and_is_unbiased():
    """With a generator, each element decodes to one of the two 4-bit map entries around it, and
    the mean over many draws is the element (round to nearest keeps 0.4 of the way to 0.0055 at 0)."""
    qmap = dynamic_map(4, True)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) ** 3
    below, above = _ref_bracket(x, 128, qmap)
    got = _roundtrip(x, 4, 128, True, torch.Generator().manual_seed(2))
    assert bool(((got == below) | (got == above)).all()) and (got != _roundtrip(x, 4, 128, True)).any()
    y = torch.full((128 * 512,), 0.4 * 0.0055)  # between the entries 0 and 0.0055 of every block ...
    y[::128] = 1.0  # ... whose absmax is 1
    draws = _roundtrip(y, 4, 128, True, torch.Generator().manual_seed(3)).view(512, 128)[:, 1:]
    assert draws.unique().tolist() == [0.0, dynamic_map(4, True)[8].item()]  # 0 and 0.0055
    assert draws.mean().item() == pytest.approx(0.4 * 0.0055, rel=0.02)
    assert bool((_roundtrip(y, 4, 128, True)[1:128] == 0).all())


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
        # the fused kernel and this formula differ by ulps (absmax too): a tie may pick the neighbour
        bits, block, signed = LEAN_FORMATS["exp_avg_sq"]
        got, ref = (
            _decode(store, u.index, "exp_avg_sq"),
            _ref_roundtrip(v, block, dynamic_map(bits, signed), False),
        )
        assert torch.isclose(got, ref, rtol=1e-5, atol=0).float().mean() > 0.999, "exp_avg_sq: to nearest"
        bits, block, signed = LEAN_FORMATS["exp_avg"]
        got, (below, above) = (
            _decode(store, u.index, "exp_avg"),
            _ref_bracket(m, block, dynamic_map(bits, signed)),
        )
        on = torch.isclose(got, below, rtol=1e-5, atol=0) | torch.isclose(got, above, rtol=1e-5, atol=0)
        assert on.float().mean() > 0.999, "exp_avg: stochastically one of the two entries around m"
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


def test_a_first_moment_whose_gradient_stopped_decays_as_fp64_adamw_s(shm_dir):
    """unsloth-zoo#962 (issue 24, part 4): one coordinate per 128-element block gets no gradient
    while the block's other coordinates keep theirs (they set its absmax). fp64 AdamW from the same
    decoded start moves the quiet coordinates by ~lr·m/sqrt(v)/(1 - β1/sqrt(β2)) and then stops; 500
    lean steps must move them as far on average (round to nearest kept β1·m on m's own code: a
    constant step every update, 2.79 against 0.0068 in the issue's run), and leave their m at 0."""
    block, num_blocks, steps, lr = 128, 64, 500, 1e-2
    n = block * num_blocks
    cfg = OptimConfig(lr=lr, weight_decay=0.0, eps=1e-8)
    s = HostStore.create(StoreLayout((n,), torch.bfloat16, state="lean"), shm_dir, "lean-decay")
    s.unlink()
    opt = LeanAdamW(s, [Unit(0, "u", (), n, n)], cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    quiet = torch.arange(0, n, block)  # [num_blocks]: the first coordinate of every block
    m, v = torch.randn(n, generator=gen) * 0.2, torch.rand(n, generator=gen) + 0.5
    m[quiet], v[quiet] = 0.02, 1e-3  # small beside the block's absmax; a step of ~0.6 lr
    opt.load_unit(0, torch.zeros(n), m, v)
    opt._steps[0] = [torch.tensor(20000.0)]  # long past warm-up: bias corrections 1 (β2^20000 ≈ 2e-9)
    w64 = s.compute(0).double()  # fp64 AdamW from the decoded state
    m64, v64 = _decode(s, 0, "exp_avg").double(), _decode(s, 0, "exp_avg_sq").double()
    b1, b2 = cfg.beta1, cfg.beta2
    m0, v0 = m64[quiet].clone(), v64[quiet].clone()
    for t in range(20001, 20001 + steps):
        g = torch.randn(n, generator=gen)
        g[quiet] = 0.0
        s.grad(0).copy_(g)
        opt.step_unit(0, lr)
        m64, v64 = b1 * m64 + (1 - b1) * g.double(), b2 * v64 + (1 - b2) * g.double() ** 2
        w64 -= lr * (m64 / (1 - b1**t)) / ((v64 / (1 - b2**t)).sqrt() + cfg.eps)
    lean_drift = s.compute(0)[quiet].double().abs().mean().item()
    ref_drift = w64[quiet].abs().mean().item()
    q = b1 / b2**0.5  # g = 0: m and sqrt(v) decay by β1 and sqrt(β2) per step
    closed = (lr * m0 / v0.sqrt() * q * (1 - q**steps) / (1 - q)).abs().mean().item()
    assert ref_drift == pytest.approx(closed, rel=1e-4)
    assert lean_drift == pytest.approx(ref_drift, rel=0.25), (lean_drift, ref_drift)
    assert bool((_decode(s, 0, "exp_avg")[quiet] == 0).all()), "the quiet moments decayed to 0"
