"""The host rates a machine profile prices a step at, measured: memory bandwidth per thread count, the
D2H worker's accumulation and the CPU AdamW, as the engine runs them (``bench/cpu_profile.py --host``).

    python bench/cpu_profile.py --host                                  # print the figures
    python bench/cpu_profile.py --host --write-profile conf/hardware/mine.yaml --base h200_1gpu

Each kernel runs on one process's OpenMP team of k threads (``torch.set_num_threads``), as the
engine's threads do, repeated for ``--seconds``; the best call counts (what the idle machine does):

- triad: ``torch.add(b, c, alpha=s, out=a)`` over three 16 M-element fp32 arrays, 12 bytes moved per
  element (STREAM's convention), for k = 1, 2, 4, … up to the cores: ``core_memory_bandwidth_gbps``
  is k = 1's, ``host_memory_bandwidth_gbps`` the best k's;
- accumulation: ``HostAccumulator.add`` (engine/host/accumulate.py: fp32 += bf16 in cache-sized
  chunks) over 64 M elements on ``--accum-threads`` threads: elements/s, and GB/s in the planner's
  count (``cost.traffic``: read 2 + read 4 + write 4 bytes per element) = ``accum_gbps``;
- optimizer: ``torch._fused_adamw_`` on master, gradient, ``exp_avg``, ``exp_avg_sq`` (fp32) and the
  bf16 transfer copy's refresh, chunk by chunk as ``StoreAdamW.step_unit`` runs it, on
  ``--optim-threads`` threads: parameters/s, and GB/s in the planner's count
  (``cost.traffic.optimizer_bytes_per_param``: 42 bytes) = ``optimizer_gbps``.

The figures are one rank's; on a node of several GPUs run it while the others are idle and divide the
node's DRAM between the ranks as the planner does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nodetrain.cost.traffic import optimizer_bytes_per_param  # noqa: E402
from nodetrain.engine.host.accumulate import HostAccumulator  # noqa: E402
from nodetrain.optim.adamw import chunk_numel  # noqa: E402

__all__ = ["best_rate", "triad", "accumulation", "optimizer", "measure", "write_profile"]


def best_rate(fn, work: float, seconds: float) -> float:
    """Work per second of ``fn``'s fastest call within ``seconds`` (after one warm-up call)."""
    fn()
    best, t0 = float("inf"), time.perf_counter()
    while best == float("inf") or time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return work / best


def triad(threads: int, seconds: float, numel: int = 16 << 20) -> float:
    """Bytes/s of the triad on ``threads`` threads."""
    torch.set_num_threads(threads)
    a, b, c = torch.empty(numel), torch.ones(numel), torch.ones(numel)
    return best_rate(lambda: torch.add(b, c, alpha=3.0, out=a), 12 * numel, seconds)


def accumulation(threads: int, seconds: float, numel: int = 64 << 20) -> float:
    """Elements/s of ``HostAccumulator.add`` (fp32 += bf16) on ``threads`` threads."""
    torch.set_num_threads(threads)
    acc, dst, src = HostAccumulator(), torch.zeros(numel), torch.ones(numel, dtype=torch.bfloat16)
    return best_rate(lambda: acc.add(dst, src), numel, seconds)


def optimizer(threads: int, seconds: float, numel: int = 32 << 20) -> float:
    """Parameters/s of the CPU AdamW and its transfer-copy refresh on ``threads`` threads."""
    torch.set_num_threads(threads)
    master, grad, m, v = (torch.rand(numel) for _ in range(4))
    compute, step = torch.empty(numel, dtype=torch.bfloat16), torch.tensor(1.0)
    size = chunk_numel() or numel

    def run() -> None:
        for lo in range(0, numel, size):
            part = slice(lo, lo + size)
            torch._fused_adamw_(
                [master[part]],
                [grad[part]],
                [m[part]],
                [v[part]],
                [],
                [step],
                lr=1e-4,
                beta1=0.9,
                beta2=0.95,
                weight_decay=0.1,
                eps=1e-8,
                amsgrad=False,
                maximize=False,
            )
            compute[part].copy_(master[part])

    return best_rate(run, numel, seconds)


def measure(cores: int, accum_threads: int, optim_threads: int, seconds: float) -> dict[str, float]:
    """The profile's host figures (GB/s, GB = 1e9 bytes) and the raw rates they come from."""
    counts = sorted({1, *(2**k for k in range(cores.bit_length()) if 2**k <= cores), cores})
    triads = {k: triad(k, seconds) for k in counts}
    accum = accumulation(accum_threads, seconds)
    adamw = optimizer(optim_threads, seconds)
    return {
        **{f"triad_{k}_threads_gbps": v / 1e9 for k, v in triads.items()},
        "accum_elements_per_s": accum,
        "optimizer_params_per_s": adamw,
        "core_memory_bandwidth_gbps": triads[1] / 1e9,
        "host_memory_bandwidth_gbps": max(triads.values()) / 1e9,
        "accum_gbps": accum * (2 + 8) / 1e9,
        "optimizer_gbps": adamw * optimizer_bytes_per_param(2) / 1e9,
    }


PROFILE_KEYS = ("core_memory_bandwidth_gbps", "host_memory_bandwidth_gbps", "accum_gbps", "optimizer_gbps")
"""The figures :func:`write_profile` sets in a machine profile."""


def write_profile(path: Path, base: str, figures: dict[str, float], note: str) -> None:
    """Write ``conf/hardware/<base>.yaml`` with ``figures``' :data:`PROFILE_KEYS` (and any other
    ``hardware`` key among them) set, and ``note`` added to its ``source``, to ``path``."""
    from omegaconf import OmegaConf

    src = Path(base) if base.endswith(".yaml") else ROOT / "conf" / "hardware" / f"{base}.yaml"
    cfg = OmegaConf.load(src)
    for key, value in figures.items():
        if key in PROFILE_KEYS or key in cfg or key.startswith("host_link"):
            cfg[key] = round(float(value), 3)
    cfg.name = path.stem
    cfg.source = f"{cfg.get('source', '')} {note}".strip()
    path.write_text(OmegaConf.to_yaml(cfg))
