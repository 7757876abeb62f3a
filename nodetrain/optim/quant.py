"""Block-wise dynamic quantization and stochastic rounding: the number formats of lean optimizer state.

Owns: the dynamic (tree) quantization map of Dettmers et al. 2021 ("8-bit Optimizers via Block-wise
Quantization", arXiv:2110.02861, the map of bitsandbytes' ``create_dynamic_map``), block-wise absmax
quantization to 8-bit codes and to 4-bit codes packed two per byte (Li et al. 2023, "Memory Efficient
Optimizers with 4-bit States", arXiv:2309.01507), and stochastic rounding of fp32 to bf16 (Zamirai et
al. 2020, "Revisiting BFloat16 Training", arXiv:2010.06192). Does not own: AdamW (optim/lean.py).

A block of ``block`` elements x is stored as one fp32 ``absmax = max |x|`` and per element the index of
a map entry next to ``x / absmax``: the nearest one, or (given a generator) one of the two entries
around it, the upper with probability equal to the distance from the lower over their gap, so that
the decoded value is x in expectation (stochastic rounding, as for the bf16 weights). Decoding is
``map[code] · absmax``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["dynamic_map", "quantize_blockwise", "dequantize_blockwise", "stochastic_round_bf16"]


@functools.cache
def dynamic_map(bits: int, signed: bool) -> torch.Tensor:
    """The dynamic quantization map: ``2**bits`` sorted fp32 values in [-1, 1] (signed) or [0, 1].

    Each value is ``10**(e - (E-1)) · f`` for E = bits - 1 exponent levels e = 0 … E-1, f the
    midpoints of an even split of [0.1, 1] into ``2**e`` (signed, both signs) or ``2**(e+1)``
    (unsigned) parts, plus 0 and 1 (bitsandbytes ``create_dynamic_map(signed, bits - 1, bits)``; the
    signed 8-bit map is padded with one more 0 to 256 entries, as bitsandbytes does).

    Returns:
        ``[2**bits]`` fp32, sorted ascending.
    """
    exp_bits = bits - 1
    data = [0.0, 1.0]
    for i in range(exp_bits):
        items = 2 ** (i + (0 if signed else 1)) + 1
        edges = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2 * 10 ** (-(exp_bits - 1) + i)).tolist()
        data += means + ([-m for m in means] if signed else [])
    data += [0.0] * (2**bits - len(data))
    return torch.tensor(sorted(data[: 2**bits]), dtype=torch.float32)


@functools.cache
def _midpoints(bits: int, signed: bool) -> torch.Tensor:
    qmap = dynamic_map(bits, signed)
    return (qmap[1:] + qmap[:-1]) / 2


@functools.cache
def _count_table(bits: int, signed: bool, entries: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For each of the 65536 values of an fp32's top 16 bits, how many boundaries (the map's
    midpoints, or its entries) lie below the smallest fp32 with those bits; the boundaries with +inf
    appended; and how many boundaries one such bucket spans at most (the corrections
    :func:`_count_below` needs)."""
    bounds = dynamic_map(bits, signed) if entries else _midpoints(bits, signed)
    top = torch.arange(1 << 16, dtype=torch.int32) << 16
    low = torch.where(top < 0, top | 0xFFFF, top).view(torch.float32)  # negative: more bits = smaller
    high = torch.where(top < 0, top, top | 0xFFFF).view(torch.float32)
    first = torch.searchsorted(bounds, low)
    finite = ~(low.isnan() | high.isnan())
    steps = int((torch.searchsorted(bounds, high) - first)[finite].max())
    return first.to(torch.int32), torch.cat([bounds, torch.tensor([float("inf")])]), steps


def _count_below(x: torch.Tensor, bits: int, signed: bool, entries: bool) -> torch.Tensor:
    """``torch.searchsorted(boundaries, x)`` (int32; the boundaries as in :func:`_count_table`), 12x
    faster on CPU: a table lookup by the top 16 bits of x, then at most ``steps`` comparisons."""
    first, bounds, steps = _count_table(bits, signed, entries)
    key = torch.bitwise_right_shift(x.view(torch.int32), 16).bitwise_and_(0xFFFF)
    idx = torch.index_select(first, 0, key)
    for _ in range(steps):
        idx += torch.gt(x, torch.index_select(bounds, 0, idx))
    return idx


def _nearest(x: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    """The nearest map entry's index of each x (int32): how many midpoints lie below it."""
    return _count_below(x, bits, signed, entries=False)


@functools.cache
def _gaps(bits: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per entry k < last: the entry and 1 / (entry k+1 - entry k) (the maps used here are distinct)."""
    qmap = dynamic_map(bits, signed)
    return qmap[:-1].clone(), 1.0 / (qmap[1:] - qmap[:-1])


def _stochastic(x: torch.Tensor, bits: int, signed: bool, generator: torch.Generator) -> torch.Tensor:
    """Per x (normalized, [n] fp32) the index of the map entry below it or of the one above, the upper
    with probability (x - below) / gap: ``E[map[index]] = x`` inside the map's range (int32)."""
    below, inv_gap = _gaps(bits, signed)
    lo = _count_below(x, bits, signed, entries=True).sub_(1).clamp_(0, below.numel() - 1)  # below <= x
    p_up = (x - torch.index_select(below, 0, lo)).mul_(torch.index_select(inv_gap, 0, lo))
    return lo.add_(torch.lt(torch.rand(x.shape, generator=generator), p_up))


def quantize_blockwise(
    x: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    block: int,
    bits: int,
    signed: bool,
    generator: torch.Generator | None = None,
) -> None:
    """Quantize ``x`` into ``codes`` and ``absmax`` in place, block by block: to the nearest map entry,
    or stochastically between the two around it when ``generator`` is given.

    Args:
        x: ``[n]`` fp32, n a multiple of ``block`` except for the tensor's last block.
        codes: ``[n]`` uint8 (8 bits) or ``[ceil(n / 2)]`` uint8 (4 bits: element 2i in the low nibble
            of byte i, 2i+1 in the high nibble).
        absmax: ``[ceil(n / block)]`` fp32, the blocks' max |x| (0 for an all-zero block, which decodes
            to zeros).
        block: elements per block (even for 4 bits).
        bits: 4 or 8.
        signed: signed map (first moment) or unsigned (second moment, x ≥ 0). Unsigned codes skip the
            map's 0 (Li et al. 2023's zero-point exclusion for the second moment): a nonzero element
            too small for the block rounds up to the smallest nonzero entry, never to 0, so its
            AdamW denominator stays ≥ sqrt(3.25e-7 · absmax) instead of eps.
        generator: CPU generator of the random draws for stochastic rounding (one fp32 uniform per
            element); None: round to nearest. A decaying first moment needs it: to nearest, β1·m lands
            back on m's own code whenever m is small beside its block's absmax, so m never decays
            (unsloth-zoo#962). Only for maps whose entries are distinct (not the padded signed 8-bit).
    """
    n = x.numel()
    full = n // block * block
    if full:
        torch.amax(x[:full].view(-1, block).abs(), dim=1, out=absmax[: n // block])
    if full < n:
        absmax[-1] = x[full:].abs().max()
    scale = absmax.clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero block keeps absmax 0
    norm = torch.empty_like(x)
    norm[:full].view(-1, block).copy_(x[:full].view(-1, block) / scale[: n // block, None])
    if full < n:
        norm[full:] = x[full:] / scale[-1]
    idx = _nearest(norm, bits, signed) if generator is None else _stochastic(norm, bits, signed, generator)
    if not signed:  # no zero code for x > 0: a second moment rounded to 0 would make 1/sqrt(v) explode
        idx.clamp_(min=1)
    idx = idx.to(torch.uint8)
    if bits == 8:
        codes.copy_(idx)
    else:
        if n % 2:
            idx = torch.cat([idx, idx.new_zeros(1)])
        pairs = idx.view(-1, 2)
        torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=codes)


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, n: int, block: int, bits: int, signed: bool, out: torch.Tensor
) -> torch.Tensor:
    """Decode ``codes`` / ``absmax`` (as :func:`quantize_blockwise` wrote them) into ``out``.

    Args:
        out: ``[n]`` fp32, written.

    Returns:
        ``out``.
    """
    qmap = dynamic_map(bits, signed)
    if bits == 8:
        idx = codes.int()
    else:
        idx = torch.stack([codes & 0xF, codes >> 4], dim=1).view(-1)[:n].int()
    torch.index_select(qmap, 0, idx, out=out)
    full = n // block * block
    if full:
        out[:full].view(-1, block).mul_(absmax[: n // block, None])
    if full < n:
        out[full:].mul_(absmax[-1])
    return out


def stochastic_round_bf16(x: torch.Tensor, out: torch.Tensor, generator: torch.Generator) -> None:
    """Round fp32 ``x`` to bf16 ``out`` stochastically: up with probability equal to the distance from
    the value below, so ``E[out] = x`` (Zamirai et al. 2020); adds 16 random bits below bf16's mantissa
    to the fp32 bit pattern and truncates. Non-finite values stay non-finite.

    Args:
        x: ``[n]`` fp32 (overwritten with scratch).
        out: ``[n]`` bf16, written.
        generator: CPU generator of the random bits (seeded per unit and step for exact resume).
    """
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, generator=generator)
    finite = torch.isfinite(x)
    bits.add_(torch.where(finite, noise, 0)).bitwise_and_(-65536)  # 0xFFFF0000 as int32
    out.copy_(x)  # exact: the low 16 bits are zero
