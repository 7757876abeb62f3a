"""Print a ``Plan`` as rich tables: host store by component, per-stage device memory, step time and
its bottleneck, throughput, the token budget, and the verdict. Owns layout and wording only; every
number comes from ``plan.make_plan``."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from nodetrain.core.placement import AUTO
from nodetrain.cost.exposure import CLIP_FRACTION
from nodetrain.cost.memory import (
    ALLOCATOR_MARGIN_BYTES,
    CUBLAS_MARGIN_BYTES,
    MARGIN_BYTES,
    NCCL_MARGIN_BYTES,
)
from nodetrain.plan.planner import GB, Plan
from nodetrain.plan.waves import wave_lines

__all__ = ["render"]

_FIELD_NAMES = {
    "master": "master weights (fp32)",
    "grad": "gradient accumulator (fp32)",
    "exp_avg": "AdamW exp_avg (fp32)",
    "exp_avg_sq": "AdamW exp_avg_sq (fp32)",
    "compute": "transfer copy ({dtype})",
    "grad_tied": "tied-embedding 2nd gradient (fp32)",
}


_LEAN_NAMES = {  # optim.state=lean (optim/lean.py)
    "exp_avg": "AdamW exp_avg (4-bit codes)",
    "exp_avg_absmax": "exp_avg block scales (fp32 / 128)",
    "exp_avg_sq": "AdamW exp_avg_sq (8-bit codes)",
    "exp_avg_sq_absmax": "exp_avg_sq block scales (fp32 / 2048)",
    "compute": "master weights = transfer copy ({dtype})",
}


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:,.2f}"


def _header(plan: Plan) -> str:
    cfg, hw, s, batch = plan.cfg, plan.cfg.hardware, plan.shape, plan.batch
    devices = f"{hw.gpus_per_node} GPU(s)" if hw.gpus_per_node else "CPU only"
    t, per_round = plan.time, batch.micro_batch_size * batch.seq_len * batch.microbatches
    active = f", {s.active_params / 1e9:,.3f}B active" if any(k for k, _ in s.routing) else ""
    params = f"{s.num_params / 1e9:,.3f}B parameters{active}"
    return (
        f"[bold]nodetrain plan[/]: model [bold]{cfg.model.name}[/] ({params}, "
        f"{s.num_layers} layers) on [bold]{hw.name}[/] ({devices}, {hw.host_memory_gb:,.0f} GB host RAM)\n"
        f"batch: {batch.micro_batch_size} × {batch.seq_len} tokens × {batch.microbatches} "
        f"micro-batches × {t.tokens // per_round} round(s) = {t.tokens:,} tokens/step; {plan.num_stages} "
        f"stage(s), {cfg.pipeline.schedule}, {cfg.train.dtype}, {cfg.stream.slots} window slots"
    )


def _store_table(plan: Plan) -> Table:
    table = Table(title="Host store (one copy per node)", title_justify="left")
    for col in ("component", "bytes/param", "GB"):
        table.add_column(col, justify="left" if col == "component" else "right")
    n = plan.shape.num_params
    names = _LEAN_NAMES if plan.cfg.optim.state == "lean" else {}
    for name, nbytes in plan.fields.items():
        label = names.get(name, _FIELD_NAMES.get(name, name)).format(dtype=plan.cfg.train.dtype)
        table.add_row(label, f"{nbytes / n:.2f}", _gb(nbytes))
    table.add_row(
        "[bold]host store[/]", f"[bold]{plan.store_bytes / n:.2f}[/]", f"[bold]{_gb(plan.store_bytes)}[/]"
    )
    ram = plan.store_bytes
    if plan.tier_bytes:
        table.add_row("  of it on NVMe (store.tier=nvme)", f"{plan.tier_bytes / n:.2f}", _gb(plan.tier_bytes))
        table.add_row(
            f"  + tier buffers ({plan.cfg.store.tier_buffers}, host RAM)", "", _gb(plan.tier_pool_bytes)
        )
        ram = plan.store_bytes - plan.tier_bytes + plan.tier_pool_bytes
        table.add_row("[bold]host store in RAM[/]", f"[bold]{ram / n:.2f}[/]", f"[bold]{_gb(ram)}[/]")
    extra = plan.host_need_bytes - ram
    what = "rank overhead + D2H staging"
    what += " + windows and activations" if not plan.device_limit_bytes else ""
    what += " + offloaded activations" if plan.cfg.stream.offload_activations else ""
    table.add_row(f"+ {what} ({plan.num_stages} ranks)", "", _gb(extra))
    host = plan.cfg.hardware.host_memory_gb * GB
    table.add_row(
        "[bold]host need / host memory[/]",
        "",
        f"{_gb(plan.host_need_bytes)} / {_gb(host)} ({plan.host_need_bytes / host:.0%})",
    )
    return table


def _stage_table(plan: Plan) -> Table:
    where = "device" if plan.device_limit_bytes else "host (CPU stages)"
    stages = plan.placed or plan.stages
    table = Table(
        title=f"Peak {where} memory per stage at micro_batch_size={plan.batch.micro_batch_size} with the "
        "planned placement (GB)",
        title_justify="left",
    )
    optional = {  # shown where some stage holds them
        "resident (+ AdamW)": [st.resident_bytes for st in stages],
        "grad accumulators": [st.grad_acc_bytes for st in stages],
        "kept activations": [st.kept_bytes for st in stages],
    }
    shown = [name for name, values in optional.items() if any(values)]
    cols = ("stage", "units", "window", *shown, "saved inputs (mbs)", "P2P live (bufs)", "recompute+grads")
    for col in (*cols, "total", "usable"):
        table.add_column(col, justify="right")
    usable = _gb(plan.device_limit_bytes) if plan.device_limit_bytes else "shared"
    units = plan.shape.num_layers + 2
    for k, st in enumerate(stages):
        names = [("embed" if i == 0 else "head" if i == units - 1 else f"L{i - 1}") for i in st.blocks]
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        table.add_row(
            str(st.stage),
            span,
            _gb(st.window_bytes) + (f" (sums {_gb(st.wave_bytes)})" if st.wave_bytes else ""),
            *(_gb(optional[name][k]) for name in shown),
            f"{_gb(st.saved_bytes)} ({st.in_flight})",
            f"{_gb(st.p2p_bytes)} ({st.p2p_buffers})",
            _gb(st.transient_bytes),
            _gb(st.total_bytes),
            usable,
        )
    return table


_MODE_NAMES = {
    "serial": "serial, after the step",
    "deferred": "deferred to the next forward",
    "in_backward": "in the backward",
    "speculative": "speculative",
}


def _time_table(plan: Plan) -> Table:
    t = plan.time
    title = (
        "Predicted step time of the slowest stage (parts overlap block by block: compute + its waits for "
        "H2D and for offloads + bubble + the optimizer the next step waits for; at least the host DRAM time)"
    )
    table = Table(title=title, title_justify="left")
    for col in ("part", "seconds", "of step"):
        table.add_column(col, justify="left" if col == "part" else "right")
    rows = [
        (_compute_label(plan), t.compute_s),
        ("H2D: weight prefetch (overlapped)", t.h2d_s),
        ("D2H: gradient offload (overlapped)", t.d2h_s),
        (
            f"host accumulation, {plan.rates.accum_threads} thread(s)/rank{_helped(plan)} (overlapped)",
            t.accum_s,
        ),
        ("  compute waits for loads (stall)", t.stall_s),
        ("  compute waits for offloads, the flush (d2h_wait)", t.d2h_wait_s),
        ("pipeline bubble", t.bubble_s),
        (f"CPU optimizer, {plan.rates.optim_threads} thread(s)/rank (busy)", t.optimizer_s),
        (f"  of it exposed: the next step waits ({_MODE_NAMES[t.update_mode]})", t.optimizer_exposed_s),
        ("device AdamW of the units kept on the device (optim.on_device)", t.device_optimizer_s),
        (f"host DRAM: {t.host_bytes / GB:,.1f} GB/step of all ranks (overlapped)", t.host_dram_s),
    ]
    for label, seconds in rows:
        seconds = max(seconds, 0.0)  # a bubble of -1e-17 s is float noise, not a gain
        table.add_row(label, f"{seconds:,.3f}", f"{seconds / t.step_s:.0%}")
    table.add_row("[bold]step[/]", f"[bold]{t.step_s:,.3f}[/]", "")
    return table


def _helped(plan: Plan) -> str:
    """The accumulation row's helpers: the idle optimizer thread's team (``stream.accum_help``)."""
    mode = plan.time.update_mode
    return (
        f" + the idle optimizer's {plan.rates.optim_threads}"
        if plan.cfg.stream.accum_help and mode != "serial"
        else ""
    )


def _compute_label(plan: Plan) -> str:
    """The compute row's name: whether any streamed layer's forward runs again in its backward."""
    layers = sum(1 for st in plan.run.works for i in st.blocks if 0 < i <= plan.shape.num_layers)
    kept = sum(len(st.kept) for st in plan.run.works)
    if kept == 0:
        return "compute: forward + recompute + backward"
    if kept >= layers:
        return "compute: forward + backward (every layer keeps its activations)"
    return f"compute: forward + recompute of {layers - kept} of {layers} layers + backward"


def _measured_rates(r) -> str:
    """The profile's measured host rates, where it has them (``hardware.accum_gbps`` and the like)."""
    parts = [
        ("accumulation", r.accum_bytes_per_s),
        ("optimizer", r.optim_bytes_per_s),
        ("D2H", r.d2h_link_bytes_per_s),
        ("H2D beside the optimizer", r.gated_link_bytes_per_s),
    ]
    named = [f"{name} {v / GB:,.1f} GB/s" for name, v in parts if v > 0]
    return f" (measured: {', '.join(named)})" if named else ""


def _exposure_line(plan: Plan) -> str:
    """The exposed optimizer seconds of every update mode, and which one the plan prices."""
    x, cfg = plan.time.exposure, plan.cfg
    auto = " (optim.speculative=auto: the engine chooses at start-up, by measurement)"
    return (
        f"optimizer exposed per step (s): deferred {x.deferred_s:,.3f}, speculative {x.speculative_s:,.3f} "
        f"({x.speculative_clipped_s:,.3f} on a step that clips, {CLIP_FRACTION:.0%} assumed), in the "
        f"backward without clipping {x.in_backward_s:,.3f}, serial {x.serial_s:,.3f}; planned: "
        f"{_MODE_NAMES[plan.time.update_mode]}{auto if cfg.optim.speculative == 'auto' else ''}"
    )


def _traffic_table(plan: Plan) -> Table:
    table = Table(
        title="Bytes per step per stage (GB): what the times above are made of", title_justify="left"
    )
    for col in ("stage", "resident", "loads", "H2D", "D2H", "accumulation", "optimizer", "host DRAM"):
        table.add_column(col, justify="right")
    units = plan.shape.num_layers + 2
    for k, x in enumerate(plan.time.traffic):
        res = sorted(plan.resident[k]) if plan.resident else []
        names = ", ".join("embed" if i == 0 else "head" if i == units - 1 else f"L{i - 1}" for i in res)
        table.add_row(
            str(k),
            names or "-",
            f"{x.loads:,}",
            _gb(x.h2d_bytes),
            _gb(x.d2h_bytes),
            _gb(x.accum_bytes),
            _gb(x.optimizer_bytes),
            _gb(x.host_bytes),
        )
    return table


def _budget_line(plan: Plan) -> list[str]:
    """How the automatic residency budget is sized (GPU profiles, ``stream.device_budget`` -1/auto)."""
    if not plan.device_limit_bytes or plan.cfg.stream.device_budget not in AUTO:
        return []
    return [
        "automatic residency budget per stage: usable − window − activations (the table above) − "
        f"{MARGIN_BYTES / GB:.2f} GB margin (NCCL buffers {NCCL_MARGIN_BYTES / GB:.2f} + cuBLAS workspaces "
        f"{CUBLAS_MARGIN_BYTES / GB:.2f} + allocator {ALLOCATOR_MARGIN_BYTES / GB:.2f}; core/placement.py)"
    ]


def _summary(plan: Plan) -> list[str]:
    t, hw = plan.time, plan.cfg.hardware
    tokens_budget = plan.cfg.plan.train_tokens
    budget = "plan.train_tokens" if tokens_budget else "20 × parameters, Chinchilla"
    r = plan.rates
    lines = [
        *plan.choices,
        f"bottleneck: [bold]{t.bottleneck}[/]",
        _left_line(plan),
        f"host side: {r.ranks} rank(s) share {r.host_bytes_per_s / GB:,.0f} GB/s of DRAM; each rank's "
        f"{r.accum_threads} accumulation + {r.optim_threads} optimizer thread(s) at "
        f"{r.core_bytes_per_s / GB:,.1f} GB/s per core{_measured_rates(r)}; link "
        f"{r.link_bytes_per_s / GB:,.1f} GB/s each way",
        f"throughput: {t.tokens / t.step_s:,.0f} tokens/s = {t.tokens_per_day / 1e9:,.3f}B tokens/day; "
        f"MFU {t.mfu(plan.peak_flops):.1%} (model FLOPs 6·N·tokens + attention, PaLM arXiv:2204.02311, "
        f"over {plan.peak_flops / 1e12:,.1f} TFLOP/s peak at {hw.matmul_efficiency:.0%} matmul efficiency)",
        _exposure_line(plan),
        *wave_lines(plan.waves, plan.cfg.pipeline.wave, plan.peak_flops),
        f"largest micro-batch that fits: train.micro_batch_size={plan.max_micro_batch}"
        + ("" if plan.max_micro_batch else " (none fits, not even 1)"),
        *_budget_line(plan),
        f"training budget: {plan.train_tokens / 1e9:,.1f}B tokens ({budget}) = "
        f"{plan.days_one_node:,.1f} days on one node",
    ]
    if plan.nodes:
        lines.append(
            f"to finish in {plan.cfg.plan.days:g} days: {plan.nodes:,} nodes = "
            f"{plan.nodes * plan.num_stages:,} GPUs (data-parallel replicas of this node, assuming linear "
            "scaling; nodetrain itself runs one node)"
        )
    return lines


def _left_line(plan: Plan) -> str:
    """What the step holds beyond the slowest stage's compute (the busiest stage's waits, the bubble,
    the optimizer the next step waits for), and the MFU of the compute alone, with and without its
    recompute: what is left above the bottleneck."""
    t, peak = plan.time, plan.peak_flops
    ceiling = t.model_flops / t.compute_s / peak if t.compute_s > 0 else 0.0
    bare = t.model_flops / (t.compute_s - t.recompute_s) / peak if t.compute_s > t.recompute_s else 0.0
    return (
        f"  beyond compute ({t.compute_s:,.3f} s, of it recompute {t.recompute_s:,.3f} s): "
        f"{max(0.0, t.step_s - t.compute_s):,.3f} s of the step (waits for loads {t.stall_s:,.3f}, for "
        f"offloads and the flush {t.d2h_wait_s:,.3f}, for the optimizer {t.optimizer_exposed_s:,.3f}; "
        f"bubble {max(0.0, t.bubble_s):,.3f}); MFU of the compute alone {ceiling:.1%}, without recompute "
        f"{bare:.1%}"
    )


def _compute_bound_line(plan: Plan) -> str:
    """The smallest batch found compute-bound (``Plan.compute_bound``), its throughput and days per
    billion tokens, or that none that fits is."""
    if plan.compute_bound is None:
        return (
            f"compute-bound at no batch that fits (micro-batch sizes ≤ {plan.max_micro_batch}, "
            f"≤ {64 * plan.num_stages} micro-batches)"
        )
    b, m, t = plan.compute_bound
    tps = t.tokens / t.step_s
    return (
        f"compute-bound from {t.tokens:,} tokens/step (train.micro_batch_size={b} × train.seq_len="
        f"{plan.cfg.train.seq_len} × pipeline.microbatches={m}): {tps:,.0f} tokens/s, "
        f"{1e9 / tps / 86400:,.1f} days per billion tokens"
    )


def render(plan: Plan, console: Console | None = None) -> None:
    """Print ``plan`` to ``console`` (default: stdout; 120 columns when it is not a terminal and
    ``COLUMNS`` is unset)."""
    console = console or Console(width=None if Console().is_terminal or "COLUMNS" in os.environ else 120)
    console.print(_header(plan))
    console.print(_store_table(plan))
    console.print(_stage_table(plan))
    console.print(_time_table(plan))
    console.print(_traffic_table(plan))
    for line in _summary(plan):
        console.print(line)
    color = "red" if plan.problems else "green"
    console.print(f"[bold {color}]verdict: {plan.verdict}[/]")
    if plan.searched_compute_bound:
        console.print(f"  {_compute_bound_line(plan)}")
    for reason in plan.problems:
        console.print(f"  - {reason}")
    for hint in plan.hints:
        console.print(f"  hint: {hint}")
    console.print(f"[dim]hardware source: {plan.cfg.hardware.source}[/]")
