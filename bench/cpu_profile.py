"""Measure this machine's numbers for ``conf/hardware/cpu.yaml``: matmul and attention FLOP/s, the
elementwise, copy and memory bandwidth one core and the whole node reach.

    python bench/cpu_profile.py              # one core, and every core at once
    python bench/cpu_profile.py --seconds 3  # longer windows

A training run's ranks each compute on one thread (torchrun's ``OMP_NUM_THREADS=1``), so every
figure is measured as they run: single-threaded processes, one alone (one core) and one per core
at the same time (the node: their rates summed), each repeating its kernel for a window of
``--seconds``. Printed: the best call of the window (what the idle hardware does: the profile's
figures) and the window's throughput (work over the window's time: what a busy, shared machine
gives now; ``plan_accuracy.py`` calibrates with it). The kernels:

- matmul: ``torch.mm`` of two [2048, 2048] matrices, 2·n³ FLOPs per product, in bf16 and fp32;
- attention: causal ``scaled_dot_product_attention`` as a streamed layer runs it (a forward without
  autograd, then the recompute's forward and its backward) over [4, 8, 256, 64] queries, keys and
  values, counted as the planner counts it (16·B·T²·H·Q nominal FLOPs; the causal kernel skips
  about half of them), in bf16 and fp32;
- elementwise: a SwiGLU product and residual add, ``silu(a) * b + a`` over [2048, 1024]
  activations, counted as ``compute.block_elementwise_bytes`` counts a layer's (each tensor made is
  written once and read once: 2 × 3 × the activation's bytes), in bf16 and fp32;
- overhead: a decoder layer of hidden size 64 on 8 tokens (``transformers``' own layer, SDPA), its
  forward without autograd, recompute and backward: the seconds per layer and micro-batch that do not
  shrink with the layer (Python, autograd, dispatch), in bf16 and fp32;
- copy (the CPU "device" window's H2D/D2H): ``Tensor.copy_`` of 64 MB of bf16, bytes copied / s;
- memory bandwidth: a STREAM-triad-like ``torch.add(b, c, alpha=s, out=a)`` over three 16 M-element
  fp32 arrays (64 MB each, beyond the last-level cache), 3 × 4 bytes moved per element (McCalpin's
  STREAM convention).

``--host`` measures what a GPU node's profile needs of its host instead (``bench/host_rates.py``: memory
bandwidth per thread count, the accumulation's elements/s, the optimizer's parameters/s) and, with
``--write-profile PATH --base PROFILE``, writes them into a profile that ``hardware=`` loads.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["KINDS", "best_time", "workload", "window_rate", "concurrent", "matmul_flops", "cpu_name"]

KINDS = ("matmul", "attention", "elementwise", "overhead", "copy", "triad")
"""The measured kernels (see the module docstring); all but copy and triad per dtype."""

ATTENTION_SHAPE = (4, 8, 256, 64)
"""[B, H, T, Q] of the attention kernel unless a job gives its own (a model's)."""


def best_time(fn, reps: int = 5) -> float:
    """Shortest wall time of ``reps`` calls of ``fn`` after one warm-up call, in seconds."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_flops(dtype: torch.dtype, n: int = 2048) -> float:
    """Best FLOP/s of an [n, n] @ [n, n] product in ``dtype`` (2·n³ FLOPs) on this thread's team."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b, out=out))


def _tiny_layer(arch: str, dtype: torch.dtype) -> Callable[[], None]:
    """A streamed layer's three passes (forward without autograd, recompute, backward) on a decoder
    layer of ``arch`` (e.g. ``LlamaForCausalLM``) of hidden size 64 on [1, 8] tokens."""
    import importlib

    import transformers

    from nodetrain.config.constants import SUPPORTED_ARCHS

    kind, prefix = SUPPORTED_ARCHS[arch], arch.removesuffix("ForCausalLM")
    cfg = transformers.AutoConfig.for_model(
        kind,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    )
    cfg._attn_implementation = "sdpa"
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    layer = getattr(module, f"{prefix}DecoderLayer")(cfg, 0).to(dtype)
    x = torch.randn(1, 8, 64).to(dtype)
    rope = getattr(module, f"{prefix}RotaryEmbedding")(cfg)(x, torch.arange(8)[None])

    def passes() -> None:
        with torch.no_grad():
            layer(x, position_embeddings=rope, attention_mask=None)
        leaf = x.detach().requires_grad_(True)
        out = layer(leaf, position_embeddings=rope, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    return passes


def workload(
    kind: str, dtype: torch.dtype = torch.bfloat16, shape: tuple = ()
) -> tuple[Callable[[], None], float]:
    """One call of kernel ``kind`` (:data:`KINDS`) on fresh buffers, and its work per call (FLOPs for
    matmul and attention, bytes for elementwise, copy and triad, one call for overhead). ``dtype``
    for all but copy and triad; ``shape``: matmul's (M, K, N) (default 2048³), attention's
    [B, H, T, Q] (default :data:`ATTENTION_SHAPE`), elementwise's activation (default [2048, 1024]),
    overhead's architecture (``(arch,)``, default Llama)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "matmul":
        m, k, n = shape or (2048, 2048, 2048)
        a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        return lambda: torch.mm(a, b, out=out), 2 * m * k * n
    if kind == "overhead":
        return _tiny_layer(shape[0] if shape else "LlamaForCausalLM", dtype), 1
    if kind == "attention":
        b, h, t, q = shape or ATTENTION_SHAPE
        qkv = [torch.randn(b, h, t, q, generator=gen).to(dtype) for _ in range(3)]
        leaves = [x.clone().requires_grad_(True) for x in qkv]
        grad = torch.ones(b, h, t, q, dtype=dtype)

        def layer() -> None:
            with torch.no_grad():
                F.scaled_dot_product_attention(*qkv, is_causal=True)
            F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad)

        return layer, 16 * b * t * t * h * q
    if kind == "elementwise":
        a, b = (torch.randn(*(shape or (2048, 1024)), generator=gen).to(dtype) for _ in range(2))
        return lambda: F.silu(a) * b + a, 2 * 3 * a.numel() * a.element_size()
    if kind == "copy":
        src = torch.ones(32 << 20, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src), src.numel() * src.element_size()
    if kind == "triad":
        numel = 16 << 20
        a, b, c = torch.empty(numel), torch.ones(numel), torch.ones(numel)
        return lambda: torch.add(b, c, alpha=3.0, out=a), 12 * numel
    raise ValueError(f"kind={kind!r}: use one of {KINDS}")


def window_rate(fn, work: float, seconds: float) -> tuple[float, float]:
    """(best rate of one call, throughput of the window): ``fn`` called for ``seconds`` after a warm-up."""
    fn()
    times, t0 = [], time.perf_counter()
    while not times or time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return work / min(times), work * len(times) / (time.perf_counter() - t0)


def _child(jobs, seconds: float, barrier, queue, index: int) -> None:
    torch.set_num_threads(1)
    out = {}
    for kind, dtype, *shape in jobs:
        fn, work = workload(kind, getattr(torch, dtype), tuple(shape))
        barrier.wait()  # every process runs the same kernel at the same time
        out[kind, dtype] = window_rate(fn, work, seconds)
    queue.put((index, out))


def concurrent(jobs: list[tuple], procs: int, seconds: float = 1.0) -> dict:
    """Run each ``(kind, dtype name, *shape)`` of ``jobs`` (see :func:`workload`) in ``procs``
    single-threaded processes at once.

    Returns:
        ``{(kind, dtype): [(best rate, window throughput) per process]}`` (FLOP/s, bytes/s, calls/s).
    """
    ctx = mp.get_context("spawn")  # a fork would inherit this process's OpenMP pool
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    children = [ctx.Process(target=_child, args=(jobs, seconds, barrier, queue, i)) for i in range(procs)]
    for c in children:
        c.start()
    got = dict(queue.get() for _ in children)
    for c in children:
        c.join()
    return {job[:2]: [got[i][job[:2]] for i in range(procs)] for job in jobs}


def cpu_name() -> str:
    """The ``model name`` line of /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


JOBS = [(k, d) for k in KINDS[:4] for d in ("bfloat16", "float32")] + [
    ("copy", "bfloat16"),
    ("triad", "float32"),
]


def _host(args, cores: int) -> None:
    """``--host``: the host rates of a machine profile (``bench/host_rates.py``), printed and, with
    ``--write-profile``, written into a copy of the ``--base`` profile that ``hardware=`` loads."""
    from host_rates import PROFILE_KEYS, measure, write_profile

    figures = measure(cores, args.accum_threads, args.optim_threads, args.seconds)
    for key, value in figures.items():
        print(f"{key}: {value:,.4g}")
    if args.write_profile:
        note = (
            f"Host rates measured by bench/cpu_profile.py --host ({cpu_name()}, torch {torch.__version__}, "
            f"{args.accum_threads} accumulation and {args.optim_threads} optimizer threads): "
            + ", ".join(f"{k} {figures[k]:.1f}" for k in PROFILE_KEYS)
        )
        write_profile(Path(args.write_profile), args.base, figures, note)
        print(f"wrote {args.write_profile} (conf/hardware/<name>.yaml is what hardware=<name> loads)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="window per kernel and process")
    parser.add_argument("--host", action="store_true", help="the host rates: bench/host_rates.py")
    parser.add_argument("--accum-threads", type=int, default=8, help="--host: the D2H worker's threads")
    parser.add_argument("--optim-threads", type=int, default=8, help="--host: the optimizer's threads")
    parser.add_argument("--write-profile", help="--host: write a profile YAML here (from --base)")
    parser.add_argument("--base", default="cpu", help="--host: the profile whose other figures it keeps")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.host:
        return _host(args, cores)
    one, node = concurrent(JOBS, 1, args.seconds), concurrent(JOBS, cores, args.seconds)
    print(
        f"cpu: {cpu_name()}, {cores} logical cores, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'kernel':<22}{'one core: best':>16}{'window':>10}{f'{cores} cores: best':>18}{'window':>10}")
    for job in JOBS:
        unit = 1e9
        best1, win1 = one[job][0]
        best, win = (sum(r[j] for r in node[job]) for j in range(2))
        if job[0] == "overhead":  # ms per layer and micro-batch (each process's), not a rate
            best1, win1, best, win = (unit * 1e3 / x for x in (best1, win1, best / cores, win / cores))
        figures = f"{best1 / unit:>16,.1f}{win1 / unit:>10,.1f}{best / unit:>18,.1f}{win / unit:>10,.1f}"
        print(f"{' '.join(job):<22}{figures}")
    print("(GFLOP/s for matmul and attention, ms per layer for overhead, GB/s for the others)")

    def node_best(job) -> float:
        return sum(r[0] for r in node[job])

    print("# conf/hardware/cpu.yaml")
    print(f"peak_flops: {node_best(('matmul', 'bfloat16')):.3e}  # bf16 mm, one process per core")
    print(f"fp32_flops: {node_best(('matmul', 'float32')):.3e}")
    print(f"attention_flops: {node_best(('attention', 'bfloat16')):.3e}")
    print(f"fp32_attention_flops: {node_best(('attention', 'float32')):.3e}")
    print(
        f"device_memory_bandwidth_gbps: {one[('elementwise', 'bfloat16')][0][0] / 1e9:.1f}  # one core, bf16"
    )
    print(f"layer_overhead_s: {1 / one[('overhead', 'bfloat16')][0][0]:.2e}  # one core, bf16")
    print(f"host_link_gbps: {node_best(('copy', 'bfloat16')) / 1e9:.1f}")
    print(f"host_memory_bandwidth_gbps: {node_best(('triad', 'float32')) / 1e9:.1f}")
    print(f"core_memory_bandwidth_gbps: {one[('triad', 'float32')][0][0] / 1e9:.1f}  # the triad, one core")


if __name__ == "__main__":
    main()
