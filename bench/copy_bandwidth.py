"""The host link's GB/s each way, alone and both at once, next to pageable copies and the window's paths.

    python bench/copy_bandwidth.py --out results/             # GPU: 201 MB H2D, 403 MB D2H (est. 15-25 s)
    python bench/copy_bandwidth.py --out /tmp/r --dry-run     # CPU: 4 and 8 MB, the same control flow
    python bench/copy_bandwidth.py --profile-lines results/check.json   # YAML lines for conf/hardware/

``gpu_check.sh`` runs it (its copy_bandwidth step, ≤ 60 s). Sizes as a training step's transfers: H2D
one decoder layer of Llama-3.2-3B in bf16 (100.7M parameters, ``--h2d-mb`` 201), D2H its fp32
gradient (a device accumulator's ship, ``--d2h-mb`` 403). GB = 1e9 bytes; every figure is the bytes
of one copy over the median of ``--repeats`` timed copies (one untimed copy first). Written to
``<out>/copy_bandwidth.json``:

The link (plain tensors, no nodetrain code; "page-locked" = page-aligned anonymous memory registered
with ``cudaHostRegister``, as the host store and the gradient staging are):
- ``h2d_pinned_gbps``, ``d2h_pinned_gbps``: one direction alone, ``copy_(non_blocking=True)`` on a
  side stream of its own, timed by CUDA events on that stream;
- ``h2d_while_d2h_gbps``, ``d2h_while_h2d_gbps``: both at once, each direction timed while the other
  runs a chain of copies on its own stream (both streams released by one event after a GPU sleep);
  ``both_overlapped`` says whether the other chain outlasted the timed copy every time;
- ``h2d_pageable_gbps``, ``d2h_pageable_gbps``: from / into ordinary memory, timed by the wall clock
  to the stream's end (the driver stages these through its own buffer on the host, which a stream's
  events do not bracket).
The window's paths (nodetrain's ``HostStore``, ``GradStaging``, ``Window``, H2D-sized bf16):
- ``h2d_store_gbps``: the store's page-locked transfer copy into a device buffer, as ``Window`` loads;
- ``d2h_staging_gbps``: a bf16 gradient into a ``GradStaging`` buffer, its event waited for;
- ``offload_gbps``: whole ``Window.offload`` calls (staging copy + fp32 accumulation into the store on
  the D2H worker) over their wall time to ``flush``, after an untimed step; ``offload_over_d2h_pageable``.
On the CPU (``--dry-run``, or no CUDA) the same calls run on host buffers, timed by the wall clock; the
other direction of "both at once" runs on a thread. Each part runs on its own: one that raises is
printed, named in ``errors`` and fails the exit status, and the others' figures are still written.
``--profile-lines`` prints the ``hardware.host_link_gbps`` / ``host_link_d2h_gbps`` lines of a
measured ``check.json`` (or ``copy_bandwidth.json``) to paste into ``conf/hardware/<gpu>.yaml``;
``--write-profile PATH --base PROFILE`` writes them into a copy of a profile instead.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYER_BF16_MB = 201.4
"""One Llama-3.2-3B decoder layer in bf16: 100.7M parameters × 2 bytes, in MB (1e6 bytes)."""
GATE_CYCLES = 2_000_000
"""A GPU sleep of ~1 ms before both directions start: the host queues both streams' copies first."""
CHAIN_OVER = 3.0
"""The other direction's chain lasts this many times the timed copy (at their rates alone)."""


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _host(nbytes: int, pin: bool) -> tuple[torch.Tensor, list[int]]:
    """[nbytes] uint8 of page-aligned anonymous memory, filled (its pages touched), and the addresses
    registered with ``cudaHostRegister`` when ``pin`` (whole pages, as staging.py registers them;
    release with :func:`_unpin`)."""
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    raw = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
    raw.fill_(7)
    if not pin:
        return raw[:nbytes], []
    err = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), size, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {size / 1e6:.0f} MB failed with CUDA error {err}")
    return raw[:nbytes], [raw.data_ptr()]


def _unpin(addrs: list[int]) -> None:
    while addrs:
        torch.cuda.cudart().cudaHostUnregister(addrs.pop())


class Link:
    """Copies between host and ``device``, timed. CUDA: each direction on a side stream of its own,
    timed by events on it (``clock="wall"``: by the wall clock to the stream's end). CPU: the wall
    clock; the other direction of :meth:`beside` runs on a thread."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats, self.cuda = device, repeats, device.type == "cuda"
        self.streams = {d: torch.cuda.Stream(device) for d in ("h2d", "d2h")} if self.cuda else {}
        self._pool = None if self.cuda else ThreadPoolExecutor(1, "copy-bandwidth-other")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _event(self):
        return torch.cuda.Event(enable_timing=True)

    def one_s(self, way: str, dst: torch.Tensor, src: torch.Tensor, clock: str = "events") -> float:
        """Seconds of one copy ``src`` → ``dst`` on direction ``way``'s stream, from an idle device."""
        if not self.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0
        stream = self.streams[way]
        torch.cuda.synchronize(self.device)
        start, end, t0 = self._event(), self._event(), time.perf_counter()
        with torch.cuda.stream(stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        end.synchronize()
        return time.perf_counter() - t0 if clock == "wall" else start.elapsed_time(end) / 1e3

    def alone(self, way: str, dst, src, clock: str = "events") -> list[float]:
        """:meth:`one_s` ``repeats`` times after an untimed copy."""
        return [self.one_s(way, dst, src, clock) for _ in range(self.repeats + 1)][1:]

    def beside(self, way: str, dst, src, other: str, other_copy, chain: int) -> tuple[float, bool]:
        """Seconds of one ``src`` → ``dst`` copy on ``way``'s stream while ``other``'s stream runs
        ``chain`` × ``other_copy()``, both started together; and whether that chain outlasted it."""
        if not self.cuda:
            gate = threading.Event()
            fut = self._pool.submit(lambda: gate.wait() and [other_copy() for _ in range(chain)])
            gate.set()
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds, overlapped = time.perf_counter() - t0, not fut.done()
            fut.result()
            return seconds, overlapped
        torch.cuda.synchronize(self.device)
        released, start, end, other_end = self._event(), self._event(), self._event(), self._event()
        torch.cuda._sleep(GATE_CYCLES)  # on the current stream: both side streams wait for its end
        released.record()
        with torch.cuda.stream(self.streams[other]):
            self.streams[other].wait_event(released)
            for _ in range(chain):
                other_copy()
            other_end.record()
        with torch.cuda.stream(self.streams[way]):
            self.streams[way].wait_event(released)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        torch.cuda.synchronize(self.device)
        overlapped = released.elapsed_time(other_end) >= released.elapsed_time(end)
        return start.elapsed_time(end) / 1e3, overlapped


def measure_link(link: Link, h2d_bytes: int, d2h_bytes: int) -> dict:
    """The link figures of the module docstring: pinned alone, both at once, pageable."""
    pin = link.cuda
    src, src_locks = _host(h2d_bytes, pin)  # the H2D source, page-locked on CUDA
    dst, dst_locks = _host(d2h_bytes, pin)  # the D2H target, page-locked on CUDA
    try:
        dev_in = torch.empty(h2d_bytes, dtype=torch.uint8, device=link.device)
        dev_out = torch.full((d2h_bytes,), 3, dtype=torch.uint8, device=link.device)
        h2d = link.alone("h2d", dev_in, src)
        d2h = link.alone("d2h", dst, dev_out)
        out = {
            "h2d_pinned_gbps": _median_gbps(h2d_bytes, h2d),
            "d2h_pinned_gbps": _median_gbps(d2h_bytes, d2h),
        }
        out["host_pinned"] = pin and src.is_pinned() and dst.is_pinned()
        h2d_s, d2h_s = statistics.median(h2d), statistics.median(d2h)
        both, overlapped = {}, []
        for way, other, dst_, src_, mine_s, other_s, copy in (
            ("h2d", "d2h", dev_in, src, h2d_s, d2h_s, lambda: dst.copy_(dev_out, non_blocking=True)),
            ("d2h", "h2d", dst, dev_out, d2h_s, h2d_s, lambda: dev_in.copy_(src, non_blocking=True)),
        ):
            chain = max(2, math.ceil(CHAIN_OVER * mine_s / other_s))
            runs = [link.beside(way, dst_, src_, other, copy, chain) for _ in range(link.repeats + 1)][1:]
            both[way] = [s for s, _ in runs]
            overlapped += [o for _, o in runs]
        out["h2d_while_d2h_gbps"] = _median_gbps(h2d_bytes, both["h2d"])
        out["d2h_while_h2d_gbps"] = _median_gbps(d2h_bytes, both["d2h"])
        out["both_overlapped"] = all(overlapped)
        pageable_src, pageable_dst = _host(h2d_bytes, False)[0], _host(d2h_bytes, False)[0]
        h2d = link.alone("h2d", dev_in, pageable_src, clock="wall")
        out["h2d_pageable_gbps"] = _median_gbps(h2d_bytes, h2d)
        out["d2h_pageable_gbps"] = _median_gbps(
            d2h_bytes, link.alone("d2h", pageable_dst, dev_out, clock="wall")
        )
    finally:
        if link.cuda:
            torch.cuda.synchronize(link.device)
        _unpin(src_locks)
        _unpin(dst_locks)
    return out


def measure_window(link: Link, numel: int, store_dir: Path) -> dict:
    """The window's paths of the module docstring for ``numel`` bf16 elements (nodetrain's classes:
    imported here, so that the link figures above need nothing but torch)."""
    from nodetrain.engine.device.staging import GradStaging
    from nodetrain.engine.device.window import Window
    from nodetrain.model import Binding
    from nodetrain.store import HostStore, StoreLayout

    device, nbytes, out = link.device, numel * 2, {}
    store = HostStore.create(StoreLayout((numel,), torch.bfloat16), store_dir, "copy-bandwidth")
    store.unlink()
    stage = window = None
    try:
        if link.cuda:
            store.pin([0])  # as the engine does for the units a rank loads
        out["store_pinned"] = store.is_pinned(0)
        dev_buf = torch.empty(numel, dtype=torch.bfloat16, device=device)
        out["h2d_store_gbps"] = _median_gbps(nbytes, link.alone("h2d", dev_buf, store.compute(0)))
        grad = torch.ones(numel, dtype=torch.bfloat16, device=device)
        stage = GradStaging(1, numel, torch.bfloat16, device)
        out["staging_pinned"] = stage.pinned
        times = []
        for _ in range(link.repeats + 1):
            t0 = time.perf_counter()
            stage.issue(0, [grad]).wait()
            times.append(time.perf_counter() - t0)
        out["d2h_staging_gbps"] = _median_gbps(nbytes, times[1:])
        window = Window(store, [(Binding("w", 0, 0, (numel,)),)], [0], 2, device)
        for timed in (False, True):  # an untimed step first: the pages of a run's first touch
            window.begin([])
            t0 = time.perf_counter()
            for _ in range(link.repeats if timed else 2):
                window.offload(0, {"w": grad})
            window.flush()
        out["offload_gbps"] = link.repeats * nbytes / (time.perf_counter() - t0) / 1e9
        out["staging_pinned_bytes"] = window.staging_pinned_nbytes
    finally:
        for closing in (window, stage):
            if closing is not None:
                closing.close()
        store.unpin()
    return out


def _run_part(name: str, fn, result: dict) -> None:
    """``result.update(fn())``; a part that raises is printed and named in ``result["errors"]``."""
    try:
        result.update(fn())
    except Exception as exc:  # a broken part must not lose the others' figures
        traceback.print_exc()
        result["errors"][name] = f"{type(exc).__name__}: {exc}"


def _print(r: dict) -> None:
    """The figures side by side (a part that failed prints as -)."""

    def f(key: str) -> str:
        return f"{r[key]:8.2f}" if key in r else "       -"

    print(
        f"copy bandwidth on {r['device']} (GB/s; median of {r['repeats']}; H2D {r['h2d_mb']:.0f} MB, "
        f"D2H {r['d2h_mb']:.0f} MB per copy; host page-locked: {r.get('host_pinned')})"
    )
    print("               pinned alone   while the other runs   pageable")
    for way, other in (("h2d", "d2h"), ("d2h", "h2d")):
        row = (f(f"{way}_pinned_gbps"), f(f"{way}_while_{other}_gbps"), f(f"{way}_pageable_gbps"))
        print(f"  {way.upper()}         {row[0]}       {row[1]}             {row[2]}")
    print(f"  both directions overlapped in every timed copy: {r.get('both_overlapped')}")
    print(
        f"  window: H2D from the store (pinned={r.get('store_pinned')}) {f('h2d_store_gbps')}"
        f"   D2H into staging (pinned={r.get('staging_pinned')}) {f('d2h_staging_gbps')}"
    )
    if "offload_over_d2h_pageable" in r:
        print(
            f"  Window.offload (copy + fp32 accumulate) {r['offload_gbps']:8.2f}"
            f"   = {r['offload_over_d2h_pageable']:.3f} × D2H pageable"
        )
    for name, error in r["errors"].items():
        print(f"  FAILED {name}: {error}")


def profile_figures(copies: dict) -> dict[str, float]:
    """The hardware profile's link fields from copy_bandwidth.json's (or check.json's step's) figures:
    ``host_link_gbps`` = pinned H2D alone, ``host_link_d2h_gbps`` = pinned D2H alone."""
    return {"host_link_gbps": copies["h2d_pinned_gbps"], "host_link_d2h_gbps": copies["d2h_pinned_gbps"]}


def profile_lines(path: Path) -> list[str]:
    """YAML lines for ``conf/hardware/<gpu>.yaml`` from a ``check.json`` (its copy_bandwidth step) or a
    ``copy_bandwidth.json``; the figures with the other direction running go into the comments (the
    planner prices each direction at its own figure, both at once).

    Raises:
        KeyError: the file holds no pinned H2D and D2H figures (the step failed or is older).
    """
    data = json.loads(Path(path).read_text())
    copies = data["steps"]["copy_bandwidth"] if "steps" in data else data
    where = data.get("gpu") or copies.get("device", "?")
    version = data.get("torch") or copies.get("torch", "?")
    lines = [f"# from bench/copy_bandwidth.py ({path}) on {where}, torch {version}"]
    if data.get("dry_run") or "cuda" not in str(copies.get("device", "cuda")):
        lines.append("# A DRY RUN ON THE CPU: not a GPU's link; do not paste these into a GPU profile")
    if copies.get("both_overlapped") is False:
        lines.append("# the other direction ended before some timed copies: 'running' figures are high")
    figures = profile_figures(copies)
    both = {"host_link_gbps": "h2d_while_d2h_gbps", "host_link_d2h_gbps": "d2h_while_h2d_gbps"}
    pageable = {"host_link_gbps": "h2d_pageable_gbps", "host_link_d2h_gbps": "d2h_pageable_gbps"}
    for key, value in figures.items():
        way, mb = ("H2D", copies.get("h2d_mb")) if key == "host_link_gbps" else ("D2H", copies.get("d2h_mb"))
        lines.append(
            f"{key}: {value:.1f}  # measured: pinned {way} alone ({mb or 0:.0f} MB copies, median of "
            f"{copies.get('repeats')}); {copies.get(both[key], float('nan')):.1f} with the other "
            f"direction running, {copies.get(pageable[key], float('nan')):.1f} pageable"
        )
    return lines


def _write_profile(path: Path, base: str, result: dict) -> None:
    """:func:`profile_figures` into a copy of profile ``base`` (``bench/host_rates.write_profile``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from host_rates import write_profile

    figures = profile_figures(result)
    note = (
        f"Link measured by bench/copy_bandwidth.py on {result['device']} (pinned, alone): "
        f"H2D {figures['host_link_gbps']:.1f}, D2H {figures['host_link_d2h_gbps']:.1f} GB/s"
    )
    write_profile(path, base, figures, note)
    print(f"wrote {path}")


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="writes <out>/copy_bandwidth.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU, 4 and 8 MB copies")
    ap.add_argument("--h2d-mb", type=float, default=LAYER_BF16_MB, help="MB (1e6) per H2D copy")
    ap.add_argument("--d2h-mb", type=float, default=2 * LAYER_BF16_MB, help="MB (1e6) per D2H copy")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--store-dir", help="host store directory (default: roomier of /dev/shm, $TMPDIR)")
    ap.add_argument("--profile-lines", type=Path, help="print a check.json's profile lines and exit")
    ap.add_argument("--write-profile", help="write a profile YAML with this link (from --base)")
    ap.add_argument("--base", default="h200_1gpu", help="the profile whose other figures it keeps")
    args = ap.parse_args()
    if args.profile_lines is None and args.out is None:
        ap.error("--out is required (or --profile-lines CHECK_JSON)")
    return args


def main() -> None:
    args = _args()
    if args.profile_lines is not None:
        try:
            print("\n".join(profile_lines(args.profile_lines)))
        except KeyError as e:
            raise SystemExit(f"{args.profile_lines}: no {e} (did its copy_bandwidth step fail?)") from None
        return
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.dry_run
    # an indexed device: the window's worker threads select it (the H200 run died on set_device("cuda"))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    h2d_mb, d2h_mb = (4.0, 8.0) if args.dry_run else (args.h2d_mb, args.d2h_mb)
    h2d_bytes, d2h_bytes = int(h2d_mb * 1e6) // 2 * 2, int(d2h_mb * 1e6) // 4 * 4
    result = {"device": str(device), "torch": torch.__version__, "h2d_mb": h2d_bytes / 1e6}
    result["d2h_mb"] = d2h_bytes / 1e6
    result.update(repeats=args.repeats, errors={})
    candidates = [args.store_dir] if args.store_dir else ["/dev/shm", tempfile.gettempdir()]
    store_dir = Path(
        tempfile.mkdtemp(prefix="nt-copybw-", dir=max(candidates, key=lambda d: shutil.disk_usage(d).free))
    )
    link = Link(device, args.repeats)
    try:
        _run_part("link", lambda: measure_link(link, h2d_bytes, d2h_bytes), result)
        _run_part("window", lambda: measure_window(link, h2d_bytes // 2, store_dir), result)
    finally:
        link.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    if "offload_gbps" in result and "d2h_pageable_gbps" in result:
        result["offload_over_d2h_pageable"] = result["offload_gbps"] / result["d2h_pageable_gbps"]
    result["passed"] = not result["errors"]
    (args.out / "copy_bandwidth.json").write_text(json.dumps(result, indent=2))
    _print(result)
    if args.write_profile and "h2d_pinned_gbps" in result:
        _write_profile(Path(args.write_profile), args.base, result)
    raise SystemExit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
