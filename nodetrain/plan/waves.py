"""Waves: which ``pipeline.wave`` the planner would pick, and why (issue 31).

Owns: pricing the plan's batch at every wave W that divides its micro-batches per round
(:func:`wave_options`: the step, tokens/s and the peak memory each needs, with the placement the
budget makes at that W) and the report's wave lines (:func:`wave_lines`). A wave is one pipeline
item (the schedule runs over M/W items), so one W holds for all stages. Does not own the pricing
(``core.batch.priced_batch``, ``cost/``) or the rest of the report (``report.py``).

Why waves pay: a streamed block is loaded once per item and ships its wave-summed fp32 gradient once
per item, so the step's H2D bytes fall as 1/W and its D2H and host accumulation bytes as 1/W (to
4·P D2H and 8·P host bytes per parameter at W = M); against that, the bubble is
(S − 1)/(M/W + S − 1) of the round, each stage holds W micro-batches' saved inputs per item in
flight (and a kept layer W graphs), and the device holds fp32 wave sums
(``cost.memory.wave_summed_numel`` × 4 bytes per slot).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nodetrain.config.batch import BatchShape
from nodetrain.config.schema import Config
from nodetrain.core.batch import priced_batch
from nodetrain.core.machine import GB, Machine
from nodetrain.cost.memory import StageMemory
from nodetrain.cost.shape import ModelShape
from nodetrain.cost.step_time import StepTime

__all__ = ["WaveOption", "best_wave", "wave_lines", "wave_options"]


@dataclass(frozen=True)
class WaveOption:
    """The plan's batch priced at one wave."""

    wave: int
    """W, micro-batches per pipeline item."""
    time: StepTime
    memory: tuple[StageMemory, ...]
    """Per stage its peak with the placement the budget makes at this W (device bytes; host bytes on
    a CPU profile)."""
    fits: bool
    """Every stage's streamed peak fits (``NodeFit.fits``) and, on a GPU, its placed peak too."""

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens / self.time.step_s

    @property
    def peak_bytes(self) -> int:
        """The largest stage's peak (bytes)."""
        return max(m.total_bytes for m in self.memory)


def divisors(m: int) -> list[int]:
    """The waves a round of ``m`` micro-batches allows: the divisors of ``m``, ascending."""
    return [w for w in range(1, m + 1) if m % w == 0]


def wave_option(cfg: Config, shape: ModelShape, machine: Machine, batch: BatchShape, stages: int, wave: int):
    """``batch`` priced with ``pipeline.wave=wave`` (:func:`~nodetrain.core.batch.priced_batch`: its
    stages fitted and placed at that W, the update mode chosen), as a :class:`WaveOption`."""
    at = replace(cfg, pipeline=replace(cfg.pipeline, wave=wave))
    fit, _, (resident, on_device, grads), recompute, _, time = priced_batch(at, shape, machine, batch, stages)
    placed = zip(fit.plans, resident, on_device, recompute.kept, grads, strict=True)
    b = batch.micro_batch_size
    memory = tuple(fit.memory_of(p.work(r, o, k, g), b) for p, r, o, k, g in placed)
    fits = fit.fits(b) and (fit.cpu or max(m.total_bytes for m in memory) <= fit.device_limit_bytes)
    return WaveOption(wave, time, memory, fits)


def wave_options(
    cfg: Config, shape: ModelShape, machine: Machine, batch: BatchShape, stages: int
) -> tuple[WaveOption, ...]:
    """The plan's ``batch`` priced at every wave W dividing its micro-batches per round
    (``batch.microbatches``), ascending; the configured ``pipeline.wave`` is one of them."""
    return tuple(wave_option(cfg, shape, machine, batch, stages, w) for w in divisors(batch.microbatches))


def best_wave(options) -> WaveOption | None:
    """The fastest option that fits (the smaller W on a tie: less memory); None when none fits."""
    fitting = [o for o in options if o.fits]
    return max(fitting, key=lambda o: (o.tokens_per_s, -o.wave)) if fitting else None


def _why(best: WaveOption, other: WaveOption) -> str:
    """``best`` against ``other``: its bytes per step (H2D and D2H of the busiest stage, host DRAM of all
    ranks), its bubble (s) and its largest stage's saved inputs and kept activations (bytes), as signed
    differences."""
    h2d = max(x.h2d_bytes for x in best.time.traffic) - max(x.h2d_bytes for x in other.time.traffic)
    d2h = max(x.d2h_bytes for x in best.time.traffic) - max(x.d2h_bytes for x in other.time.traffic)
    host = best.time.host_bytes - other.time.host_bytes
    held = [max(m.saved_bytes + m.kept_bytes for m in o.memory) for o in (best, other)]
    saved = held[0] - held[1]
    return (
        f"against W={other.wave}: {h2d / GB:+,.1f} GB H2D, {d2h / GB:+,.1f} GB D2H and {host / GB:+,.1f} GB "
        f"through host DRAM per step, a bubble of {best.time.bubble_s:,.3f} s (W={other.wave}: "
        f"{other.time.bubble_s:,.3f} s), {saved / GB:+,.2f} GB of saved inputs and kept activations: "
        f"{best.tokens_per_s / other.tokens_per_s - 1:+.1%} tokens/s"
    )


def wave_lines(options, configured: int, peak_flops: float) -> list[str]:
    """The report's wave lines: each W's predicted tokens/s, step (s), MFU (over ``peak_flops``, FLOP/s
    of the plan's devices), bottleneck and peak memory (GB; the configured W marked), then the best W
    that fits and why, against W = 1."""
    if not options:
        return []
    each = ", ".join(
        f"W={o.wave} {o.tokens_per_s:,.0f} tokens/s ({o.time.step_s:,.3f} s, "
        f"MFU {o.time.mfu(peak_flops):.1%}, {o.time.bottleneck}-bound, {o.peak_bytes / GB:,.2f} GB"
        f"{'' if o.fits else ', does not fit'})" + (" ← configured" if o.wave == configured else "")
        for o in options
    )
    what = "pipeline.wave=W micro-batches per load; one W for all stages, a wave is one pipeline item"
    lines = [f"waves ({what}): {each}"]
    best = best_wave(options)
    if best is None:
        return [*lines, "  best wave: none fits"]
    now = next(o for o in options if o.wave == configured)
    gain = f", {best.tokens_per_s / now.tokens_per_s - 1:+.1%} on the configured W={configured}"
    other = options[0] if best.wave > 1 else next((o for o in options[1:] if o.fits), None)
    why = _why(best, other) if other else "the only W that fits"
    lines.append(
        f"  best wave that fits: pipeline.wave={best.wave} ({best.time.bottleneck}-bound"
        f"{gain if best.wave != configured else ', as configured'}): {why}"
    )
    return lines
