"""Where a step's time goes: a phase timeline per rank, FLOPs and MFU, and the per-stage record.

Owns: attributing every moment of a rank's training thread during a step to one phase, the model
FLOPs of a stage (PaLM, arXiv:2204.02311 App. B), the peak FLOP/s MFU is measured against (a
configured figure, the datasheet of the hardware profile naming the GPU, or a matmul measured
once per process: ``select_peak_flops``), and turning one step's numbers of every
stage into one flat record on rank 0. Does not own: the waits themselves (window.py, p2p.py,
engine.py enter the phases), or writing records (metrics.py).

Phases (the training thread is in exactly one at any moment of the step, so they sum to it):
    compute   forward, recompute and backward of blocks (and the Python around them);
    stall     waiting for an H2D prefetch to land in the window;
    d2h_wait  waiting for gradient offloads (the in-flight bound and the final flush);
    optim     optimizer work the step waits for: the gradient norm, AdamW not hidden behind
              compute, and waiting for a unit's update before its load;
    bubble    blocked on other stages: P2P receives (pipeline bubble + transfer), the step's
              all-reduce and barriers.
On CPU a phase switch reads ``time.perf_counter``; on CUDA it records an event on the compute
stream, so the phases are the compute stream's timeline (a stall is the time the stream waited,
whether for a copy or for the host), resolved with one synchronisation at the end of the step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = [
    "PHASES",
    "Timeline",
    "NULL_TIMELINE",
    "flops_per_token",
    "measured_peak_flops",
    "select_peak_flops",
    "peak_flops_line",
    "mfu_warning",
    "hardware_profiles",
    "StepBreakdown",
    "combine_stages",
]

PHASES = ("compute", "stall", "d2h_wait", "optim", "bubble")
_TIME_KEYS = tuple(f"{p}_s" for p in PHASES)


class Timeline:
    """The phase timeline of one rank's training thread over one step.

    Args:
        device: the compute device; CUDA events on its current stream, else wall-clock time.
    """

    def __init__(self, device: torch.device | str):
        self._cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[Any, str | None]] = []
        self._phase: str | None = None

    def _stamp(self):
        if not self._cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        """Begin a step in phase ``compute``."""
        self._marks, self._phase = [(self._stamp(), "compute")], "compute"

    def _switch(self, name: str) -> None:
        if name != self._phase:
            self._marks.append((self._stamp(), name))
            self._phase = name

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the time inside the block to ``name``, then return to the enclosing phase.
        Does nothing outside ``start``/``stop`` (evaluation, tests of the window alone)."""
        prev = self._phase
        if prev is None:
            yield
            return
        assert name in PHASES, name
        self._switch(name)
        try:
            yield
        finally:
            self._switch(prev)

    def stop(self) -> dict[str, float]:
        """End the step; returns seconds per phase (``<phase>_s`` for every phase in ``PHASES``)."""
        assert self._phase is not None, "stop() without start()"
        self._marks.append((self._stamp(), None))
        if self._cuda:
            self._marks[-1][0].synchronize()
        out = dict.fromkeys(_TIME_KEYS, 0.0)
        for (t0, name), (t1, _) in zip(self._marks[:-1], self._marks[1:], strict=True):
            out[f"{name}_s"] += t0.elapsed_time(t1) / 1e3 if self._cuda else t1 - t0
        self._marks, self._phase = [], None
        return out


NULL_TIMELINE = Timeline("cpu")
"""A timeline that is never started: its ``phase`` blocks cost one attribute read."""


def flops_per_token(hf_config, num_matmul_params: int, num_layers: int, seq_len: int) -> float:
    """Model FLOPs per token of one training step (forward + backward), PaLM arXiv:2204.02311 App. B.

    ``6·N + 12·L·H·Q·T``: N parameters that multiply activations (decoder layers and the lm_head,
    tied or not; the embedding lookup is free), and the attention scores and values of L layers
    with H heads of width Q over T tokens (causal masking not discounted, as in PaLM). Recompute is
    not useful work and is not counted.

    Args:
        hf_config: the HF config (``num_attention_heads``, ``hidden_size``, optional ``head_dim``).
        num_matmul_params: N of the part of the model counted (a stage's blocks).
        num_layers: decoder layers in that part.
        seq_len: T, tokens per sequence.
    """
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 6.0 * num_matmul_params + 12.0 * num_layers * heads * head_dim * seq_len


@functools.cache
def measured_peak_flops(device: str, dtype: torch.dtype, threads: int) -> float:
    """FLOP/s of a dense square matmul in ``dtype`` on ``device``, best of a few (cached per process).

    CPU: n = 512 (0.27 GFLOP per product, a few ms each) on ``threads`` intra-op threads (the
    cache key; the caller passes ``torch.get_num_threads()``). CUDA: n = 8192, timed with events.
    """
    dev = torch.device(device)
    n, reps = (8192, 10) if dev.type == "cuda" else (512, 5)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        if dev.type == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            torch.mm(a, b)
            t1.record()
            t1.synchronize()
            best = min(best, t0.elapsed_time(t1) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


HARDWARE_DIR = Path(__file__).resolve().parents[2] / "conf" / "hardware"
"""The shipped hardware profiles (``conf/hardware/*.yaml``)."""


def hardware_profiles(directory: Path = HARDWARE_DIR) -> list[Any]:
    """Every profile in ``directory`` (name order), as OmegaConf objects with ``name``,
    ``peak_flops`` and ``device_names``; [] when the directory is missing."""
    from omegaconf import OmegaConf  # the engine imports this module; keep omegaconf out of its path

    return [OmegaConf.load(f) for f in sorted(Path(directory).glob("*.yaml"))]


def select_peak_flops(
    configured: float, device_name: str | None, active, profiles
) -> tuple[float | None, str]:
    """MFU's denominator and where it comes from (pure; the engine logs the source).

    Order: ``train.peak_flops`` when > 0; else the datasheet ``peak_flops`` of the selected hardware
    profile ``active``, then of the first of ``profiles``, whose ``device_names`` holds
    ``device_name`` (case-insensitive, exact); else ``None``: measure a matmul (a CPU, or a GPU no
    profile names). Datasheet is the convention Megatron-LM and PaLM (arXiv:2204.02311) report.

    Args:
        configured: ``train.peak_flops`` (FLOP/s; 0 = automatic).
        device_name: ``torch.cuda.get_device_name()``, or None on a CPU.
        active: the run's ``cfg.hardware``; profiles: :func:`hardware_profiles`.

    Returns:
        (FLOP/s or None, a one-line source for the log and the breakdown).
    """
    if configured > 0:
        return configured, f"train.peak_flops={configured:.4g}"
    if device_name:
        want = device_name.strip().lower()
        for prof in [active, *profiles]:
            names = [n.strip().lower() for n in (getattr(prof, "device_names", None) or [])]
            if want in names:
                return float(prof.peak_flops), f"datasheet of hardware={prof.name} ({device_name})"
        return None, f"measured matmul (no conf/hardware profile lists {device_name!r} in device_names)"
    return None, "measured matmul (CPU)"


def peak_flops_line(peak_flops: float, source: str) -> str:
    """The log line naming MFU's denominator, to 3 significant digits (a CPU's measured matmul is
    well below 0.1 TFLOP/s, which one decimal would print as 0.0)."""
    return f"MFU against {peak_flops / 1e12:.3g} TFLOP/s per device: {source}"


def mfu_warning(mfu: float, source: str) -> str | None:
    """The warning for a step whose MFU is above 100% (None when it is not): no device runs above its
    peak, so the denominator is wrong, typically a matmul measured on a shared, busy machine."""
    if mfu <= 1.0:
        return None
    return (
        f"MFU {mfu:.0%} is above 100%: the peak it is measured against ({source}) is unreliable (a "
        "matmul measured on a shared machine runs below the device's peak); set train.peak_flops to the "
        "FLOP/s of one device (e.g. train.peak_flops=2e12) for MFU against a fixed peak"
    )


def _rate(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


class StepBreakdown:
    """One stage's step numbers: the timeline while it runs, then a record, gathered to rank 0.

    Args:
        device: compute device (selects the timeline's clock).
        flops_per_step_token: this stage's model FLOPs per token (see :func:`flops_per_token`).
        peak_flops: FLOP/s of one device (MFU's denominator).
        static: what does not change between steps (``window_bytes``, ``resident_bytes``,
            ``num_resident``, ``resident_units`` (names, comma-separated), ``store_bytes``,
            ``device_optimizer_bytes``, ``num_on_device``, ``num_kept``, ``num_grad_on_device``,
            ``grad_acc_bytes``, ``wave``, ``wave_bytes``), copied
            into every record.
        num_stages: stages per pipeline (P); the world is P × replicas, rank = replica · P + stage
            (replicas.py). Default: the whole world is one pipeline.
        timeline: the timeline the stage's components time their phases on (default: a new one).
    """

    def __init__(
        self,
        device,
        flops_per_step_token: float,
        peak_flops: float,
        static: dict[str, float],
        num_stages: int | None = None,
        timeline: Timeline | None = None,
    ):
        self.timeline = timeline or Timeline(device)
        self.flops_per_token = flops_per_step_token
        self.peak_flops = peak_flops
        self.static = dict(static)
        self.num_stages = num_stages
        self._mfu_warned = False  # MFU above 100% is warned about once per run

    def stage_record(self, step_s: float, tokens: int, phases: dict[str, float], busy: dict) -> dict:
        """This stage's record of one step.

        Args:
            step_s: wall seconds of the step on this rank.
            tokens: tokens computed in the step (padding included: it costs the same FLOPs).
            phases: :meth:`Timeline.stop`'s output.
            busy: ``h2d_bytes``, ``d2h_bytes``, ``h2d_busy_s``, ``d2h_busy_s``, ``optim_busy_s``:
                bytes moved and seconds the copy and optimizer workers worked (overlapped or not);
                ``accum_host_bytes``, ``optim_host_bytes``: host bytes read and written by the
                gradient accumulation (``Window.take_stats``) and the optimizer's updates;
                ``accum_helped_bytes``: of the former, those the idle optimizer thread added;
                ``cpu_s``: CPU seconds of this process (all threads) during the step;
                ``num_updates_in_backward``: unit updates that started before the backward ended;
                ``num_rollbacks``: speculative unit updates rolled back (``optim.speculative``).
                ``p2p_peak_bytes``: the step's high-water mark of live P2P buffers (bytes).
                ``saved_peak_bytes``: that of the saved block inputs on the device; with
                ``stream.offload_activations`` ``act_d2h_bytes``/``act_h2d_bytes`` they moved (the
                latter on the H2D worker: in ``h2d_gbps``), ``saved_host_bytes`` their host buffers.
        """
        flops = self.flops_per_token * tokens
        rec = {"step_s": step_s, **phases, "other_s": step_s - sum(phases.values()), **busy}
        rec["h2d_gbps"] = _rate(busy["h2d_bytes"] + busy.get("act_h2d_bytes", 0), busy["h2d_busy_s"]) / 1e9
        rec["d2h_gbps"] = _rate(busy["d2h_bytes"], busy["d2h_busy_s"]) / 1e9
        rec["flops"] = flops
        rec["peak_flops"] = self.peak_flops
        rec["mfu"] = _rate(flops, step_s * self.peak_flops)
        return {**rec, **self.static}

    def gather(self, record: dict) -> dict:
        """Collective: every rank's record to rank 0, combined by :func:`combine_stages` there;
        ``{}`` on the other ranks. The first step whose MFU is above 100% is warned about (rank 0,
        :func:`mfu_warning`)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            combined = combine_stages([record])
        else:
            rank = dist.get_rank()
            out = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(record, out, dst=0)
            if rank != 0:
                return {}
            combined = combine_stages(out, self.num_stages)
        warning = mfu_warning(combined["mfu"], combined.get("peak_flops_source", "?"))
        if warning and not self._mfu_warned:
            log.warning(warning)
            self._mfu_warned = True
        return combined


_HOST_KEYS = ("accum_host_bytes", "accum_helped_bytes", "optim_host_bytes", "act_d2h_bytes", "act_h2d_bytes")
"""Summed over every rank, 0 where a record has none: the gradient path's host bytes, the saved inputs'."""


def combine_stages(records: list[dict], num_stages: int | None = None) -> dict:
    """One flat record from every rank's record (index = global rank = replica · P + stage).

    Per stage: replica 0's record of stage s, every key as ``stage<s>/<key>`` (the replicas run the
    same blocks on the same shapes, so one pipeline's stages describe the run; a single node's keys
    are unchanged). With several replicas, ``replica<r>/step_s`` is each replica's slowest stage,
    so a slow node shows. Step level, over every rank of every replica: ``step_s`` the slowest
    rank; the phase times and ``other_s`` the mean over ranks (so they still sum to about
    ``step_s``); ``tflops`` = Σ FLOPs / step_s / 1e12; ``mfu`` = Σ FLOPs / (step_s × Σ peaks);
    ``h2d_gbps``/``d2h_gbps`` bytes over worker-busy seconds of all ranks; ``window_bytes`` the
    largest rank's; ``accum_host_bytes``/``accum_helped_bytes``/``optim_host_bytes`` (host bytes of the
    gradient path) and
    ``*_bytes`` moved, ``*_busy_s``, ``num_resident`` (units resident on all devices),
    ``num_on_device``, ``num_kept``, ``device_optimizer_bytes``, ``num_grad_on_device``,
    ``grad_acc_bytes`` and ``wave_bytes`` summed; ``wave`` and ``store_bytes`` (one node's store) as is.

    Args:
        records: :meth:`StepBreakdown.stage_record` of every rank, in global rank order.
        num_stages: P, stages per pipeline; default ``len(records)`` (one replica).
    """
    p = num_stages or len(records)
    assert len(records) % p == 0, f"{len(records)} ranks' records do not form pipelines of {p} stages"
    out: dict[str, Any] = {}
    for s, rec in enumerate(records[:p]):
        out.update({f"stage{s}/{k}": v for k, v in rec.items()})
    if len(records) > p:
        for r in range(len(records) // p):
            out[f"replica{r}/step_s"] = max(x["step_s"] for x in records[r * p : (r + 1) * p])
    n = len(records)

    def total(key: str) -> float:
        return sum(r[key] for r in records)

    step_s = max(r["step_s"] for r in records)
    out["step_s"] = step_s
    for key in (*_TIME_KEYS, "other_s"):
        out[key] = total(key) / n
    for key in ("h2d_bytes", "d2h_bytes", "h2d_busy_s", "d2h_busy_s", "optim_busy_s", "cpu_s", "flops"):
        out[key] = total(key)
    for key in _HOST_KEYS:
        out[key] = sum(r.get(key, 0) for r in records)  # host DRAM of the gradient path; saved inputs
    out["h2d_gbps"] = _rate(out["h2d_bytes"] + out["act_h2d_bytes"], out["h2d_busy_s"]) / 1e9
    out["d2h_gbps"] = _rate(out["d2h_bytes"], out["d2h_busy_s"]) / 1e9
    out["tflops"] = _rate(out["flops"], step_s) / 1e12
    out["mfu"] = _rate(out["flops"], step_s * total("peak_flops"))
    out["window_bytes"] = max(r["window_bytes"] for r in records)
    out["num_resident"] = total("num_resident")
    device = ("num_on_device", "num_kept", "device_optimizer_bytes", "num_grad_on_device", "grad_acc_bytes")
    for key in (*device, "wave_bytes"):
        out[key] = sum(r.get(key, 0) for r in records)  # optim.on_device, recompute, grad_on_device, waves
    out["wave"] = records[0].get("wave", 1)  # pipeline.wave: micro-batches per item, every stage
    out["num_rollbacks"] = sum(r.get("num_rollbacks", 0) for r in records[:p])  # one pipeline's units
    out["store_bytes"] = records[0]["store_bytes"]
    if "peak_flops_source" in records[0]:  # what ``mfu`` is measured against (select_peak_flops)
        out["peak_flops_source"] = records[0]["peak_flops_source"]
    return out
