"""H2D and D2H GB/s of the window's copy paths, page-locked next to pageable; ``gpu_check.sh`` runs it.

    python bench/copy_bandwidth.py --out results/             # on a GPU node: 256 MB per copy, ~20 s
    python bench/copy_bandwidth.py --out /tmp/r --dry-run     # CPU: 4 MB, the same code paths

Measures, each as the median of ``--repeats`` copies of ``--mb`` megabytes of bf16:
- ``h2d_store_gbps``: the host store's transfer copy (a real ``HostStore``, cudaHostRegister-ed
  when CUDA is there) into a device buffer with ``copy_(non_blocking=True)``, as ``Window`` loads;
- ``h2d_pageable_gbps``: the same from an ordinary (pageable) host tensor;
- ``d2h_staging_gbps``: a device gradient into a ``GradStaging`` buffer (page-locked on CUDA) and
  its event waited for, as ``Window.offload`` copies;
- ``d2h_pageable_gbps``: the same into an ordinary host tensor (what the window did before);
- ``offload_gbps``: whole ``Window.offload`` calls (staging copy + fp32 accumulation into the store
  on the D2H worker: one first write, then adds) over their wall time to ``flush``, bytes of the
  bf16 gradient, after one untimed step (a run's steady state: the store's gradient and the staging
  pages are mapped once per run, not per step);
- ``offload_over_d2h_pageable``: ``offload_gbps / d2h_pageable_gbps``. Memory speed allows ~0.17
  (a plain copy moves 4 bytes per bf16 element, an accumulation ~12 with its staging copy); on a
  CPU "device" both share the host's cores, on CUDA the staging copy is DMA.
Each copy is timed from an idle device to its completion (``torch.cuda.synchronize``). Writes
``<out>/copy_bandwidth.json`` and prints the figures side by side (expect pinned ≈ 5-10 × pageable
on a PCIe/NVLink-C2C host link; the ratio, not the absolute figure, is what this checks). With
``--write-profile PATH --base PROFILE`` the link per direction goes into a machine profile
(``host_link_gbps``, ``host_link_d2h_gbps``) that ``hardware=`` loads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nodetrain.engine.device.staging import GradStaging  # noqa: E402
from nodetrain.engine.device.window import Window  # noqa: E402
from nodetrain.model import Binding  # noqa: E402
from nodetrain.store import HostStore, StoreLayout  # noqa: E402


def _timed_s(fn, device: torch.device) -> float:
    """Wall seconds from an idle device to ``fn``'s work done (a GPU copy of hundreds of MB takes
    milliseconds, so the microseconds of launch and synchronisation do not matter)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def measure(numel: int, repeats: int, device: torch.device, store_dir: Path) -> dict[str, float]:
    """The figures of the module docstring for copies of ``numel`` bf16 elements."""
    nbytes, out = numel * 2, {}
    store = HostStore.create(StoreLayout((numel,), torch.bfloat16), store_dir, "copy-bandwidth")
    store.unlink()
    if device.type == "cuda":
        store.pin([0])  # as the engine does for the units a rank loads
    dev_buf = torch.empty(numel, dtype=torch.bfloat16, device=device)
    pageable = torch.randn(numel).bfloat16()
    store.compute(0).copy_(pageable)
    for name, src in (("h2d_store_gbps", store.compute(0)), ("h2d_pageable_gbps", pageable)):
        times = [_timed_s(lambda s=src: dev_buf.copy_(s, non_blocking=True), device) for _ in range(repeats)]
        out[name] = _gbps(nbytes, times)
    out["store_pinned"] = store.is_pinned(0)

    grad = torch.randn(numel, device=device).bfloat16()
    stage = GradStaging(1, numel, torch.bfloat16, device)
    times = [_timed_s(lambda: stage.issue(0, [grad]).wait(), device) for _ in range(repeats)]
    out["d2h_staging_gbps"] = _gbps(nbytes, times)
    out["staging_pinned"] = stage.pinned
    host = torch.empty(numel, dtype=torch.bfloat16)
    times = [_timed_s(lambda: host.copy_(grad), device) for _ in range(repeats)]
    out["d2h_pageable_gbps"] = _gbps(nbytes, times)

    window = Window(store, [(Binding("w", 0, 0, (numel,)),)], [0], 2, device)
    try:
        for timed in (False, True):  # an untimed step first: the pages of a run's first touch
            window.begin([])
            t0 = time.perf_counter()
            for _ in range(repeats if timed else 2):
                window.offload(0, {"w": grad})
            window.flush()
        out["offload_gbps"] = repeats * nbytes / (time.perf_counter() - t0) / 1e9
        out["staging_pinned_bytes"] = window.staging_pinned_nbytes
    finally:
        window.close()
        store.unpin()
    out["offload_over_d2h_pageable"] = out["offload_gbps"] / out["d2h_pageable_gbps"]
    return out


def _write_profile(path: Path, base: str, result: dict, device: torch.device) -> None:
    """The link per direction into a copy of profile ``base`` (``bench/host_rates.write_profile``):
    ``host_link_gbps`` = H2D from the page-locked store, ``host_link_d2h_gbps`` = D2H into staging."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from host_rates import write_profile

    figures = {"host_link_gbps": result["h2d_store_gbps"], "host_link_d2h_gbps": result["d2h_staging_gbps"]}
    note = (
        f"Link measured by bench/copy_bandwidth.py on {device} ({result['mb_per_copy']:.0f} MB copies): "
        f"H2D {figures['host_link_gbps']:.1f}, D2H {figures['host_link_d2h_gbps']:.1f} GB/s"
    )
    write_profile(path, base, figures, note)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, 4 MB copies")
    ap.add_argument("--mb", type=float, default=256, help="megabytes (1e6) of bf16 per copy")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--store-dir", help="host store directory (default: roomier of /dev/shm, $TMPDIR)")
    ap.add_argument("--write-profile", help="write a profile YAML with this link (from --base)")
    ap.add_argument("--base", default="h200_1gpu", help="the profile whose other figures it keeps")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    numel = int((4 if args.dry_run else args.mb) * 1e6) // 2
    candidates = [args.store_dir] if args.store_dir else ["/dev/shm", tempfile.gettempdir()]
    root = max(candidates, key=lambda d: shutil.disk_usage(d).free)
    store_dir = Path(tempfile.mkdtemp(prefix="nt-copybw-", dir=root))
    try:
        result = measure(numel, args.repeats, device, store_dir)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    result.update(device=str(device), mb_per_copy=numel * 2 / 1e6, repeats=args.repeats)
    (args.out / "copy_bandwidth.json").write_text(json.dumps(result, indent=2))
    if args.write_profile:
        _write_profile(Path(args.write_profile), args.base, result, device)
    print(f"copy bandwidth on {device}, {numel * 2 / 1e6:.0f} MB per copy (GB/s):")
    print(
        f"  H2D  store (pinned={result['store_pinned']}) {result['h2d_store_gbps']:8.2f}"
        f"   pageable {result['h2d_pageable_gbps']:8.2f}"
    )
    print(
        f"  D2H  staging (pinned={result['staging_pinned']}) {result['d2h_staging_gbps']:6.2f}"
        f"   pageable {result['d2h_pageable_gbps']:8.2f}"
    )
    print(
        f"  Window.offload (copy + fp32 accumulate)  {result['offload_gbps']:8.2f}"
        f"   = {result['offload_over_d2h_pageable']:.3f} × D2H pageable"
    )


if __name__ == "__main__":
    main()
