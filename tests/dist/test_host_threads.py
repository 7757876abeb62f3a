"""Host threads: the core split, each worker's OpenMP team, NUMA binding read from fake sysfs trees, and
the engine's start-up order (bind, then first-touch the rank's own units of the host store)."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from nodetrain.core.cores import split_cores
from nodetrain.engine.device.copy_worker import CopyWorker
from nodetrain.engine.host.binding import bind_rank_threads, bind_threads, numa_binding, parse_cpulist
from nodetrain.store import PAGE_BYTES, StoreLayout

WORKER = Path(__file__).resolve().parents[1] / "numa_order_worker.py"


@pytest.mark.parametrize(
    ("cores", "accum", "optim", "want"),
    [
        (8, 0, 0, (4, 4)),  # auto: half each
        (7, 0, 0, (3, 4)),  # the optimizer gets the odd core
        (1, 0, 0, (1, 1)),  # one core: both teams share it
        (8, 6, 0, (6, 2)),  # one set, the other the rest
        (8, 0, 3, (5, 3)),
        (8, 8, 0, (8, 1)),  # at least 1
        (4, 3, 5, (3, 5)),  # both set: as given
    ],
)
def test_split_cores(cores: int, accum: int, optim: int, want: tuple[int, int]) -> None:
    split = split_cores(cores, accum, optim)
    assert (split.accum_threads, split.optim_threads) == want
    assert f"stream.accum_threads={want[0]}" in split.reason and f"optim.threads={want[1]}" in split.reason
    assert ("oversubscribed" in split.reason) == (sum(want) > cores)


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8-9,16\n") == [0, 1, 2, 3, 8, 9, 16]
    assert parse_cpulist("5") == [5]
    with pytest.raises(ValueError):
        parse_cpulist("a-b")


def _fake_sysfs(root, nodes: dict[int, str], gpus: dict[str, int]):
    for node, cpulist in nodes.items():
        d = root / "devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for bus, node in gpus.items():
        d = root / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


GPUS = {"0000:1b:00.0": 0, "0000:29:00.0": 0, "0000:9a:00.0": 1, "0000:ab:00.0": 1, "0000:cc:00.0": 1}


def test_numa_binding_two_nodes(tmp_path) -> None:
    sysfs = _fake_sysfs(tmp_path, {0: "0-55,112-167", 1: "56-111,168-223", 2: ""}, GPUS)
    ids = [bus.upper() for bus in GPUS]  # the ids torch gives are matched case-insensitively
    b = numa_binding(ids, 3, sysfs)
    assert b.cpus == [*range(56, 112), *range(168, 224)]
    assert b.ranks_sharing == 3  # three of the five GPUs sit on node 1
    assert "node 1" in b.reason and "112 CPUs" in b.reason
    b0 = numa_binding(ids, 0, sysfs)
    assert b0.cpus == [*range(0, 56), *range(112, 168)] and b0.ranks_sharing == 2
    # a cpuset (container) that allows only some of node 0's CPUs: only those; none: not bound
    b0 = numa_binding(ids, 0, sysfs, allowed={3, 4, 60, 113})
    assert b0.cpus == [3, 4, 113]
    b0 = numa_binding(ids, 0, sysfs, allowed={60, 61})
    assert b0.cpus is None and "no CPU this process may use: not bound" in b0.reason


def test_numa_binding_one_node_or_unknown(tmp_path) -> None:
    one = _fake_sysfs(tmp_path / "one", {0: "0-15"}, {"0000:01:00.0": 0})
    b = numa_binding(["0000:01:00.0"], 0, one)
    assert b.cpus is None and b.ranks_sharing == 0 and "not bound" in b.reason
    two = _fake_sysfs(tmp_path / "two", {0: "0-7", 1: "8-15"}, {"0000:01:00.0": -1})
    b = numa_binding(["0000:01:00.0"], 0, two)
    assert b.cpus is None and "no NUMA node" in b.reason
    empty = tmp_path / "empty"
    empty.mkdir()
    assert numa_binding(["0000:01:00.0"], 0, empty).cpus is None


def test_bind_threads_binds_every_thread() -> None:
    before = os.sched_getaffinity(0)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        one = [min(before)]
        bind_threads(one)
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        assert len(tids) >= 2
        assert all(os.sched_getaffinity(t) == set(one) for t in tids)
    finally:
        bind_threads(sorted(before))
        stop.set()
        other.join()
    assert os.sched_getaffinity(0) == before


def test_d2h_worker_has_its_own_team() -> None:
    """The D2H worker's accumulation runs on ``accum_threads`` OpenMP threads, the caller keeps its own
    (mutant: without ``limit_thread`` in ``stream._init_worker`` the worker reports the caller's)."""
    main = torch.get_num_threads()
    want = main + 3
    worker = CopyWorker("d2h", None, "cpu", threads=want)
    seen = []
    try:
        worker.submit(lambda: seen.append(torch.get_num_threads())).result()
    finally:
        worker.shutdown()
    assert seen == [want]
    assert torch.get_num_threads() == main


def test_engine_logs_the_split(caplog, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cores = len(os.sched_getaffinity(0))
    with caplog.at_level(logging.INFO, logger="nodetrain.engine.host.binding"):
        split = bind_rank_threads(0, 1, torch.device("cpu"), 0)  # stream.accum_threads=0, optim.threads=1
    assert split.optim_threads == 1 and split.accum_threads == max(1, cores - 1)
    text = caplog.text
    assert "not a GPU: threads not bound" in text
    assert f"stream.accum_threads={split.accum_threads} (auto)" in text and "OMP_NUM_THREADS=" in text


def _expected_span(layout: StoreLayout, units: list[int]) -> tuple[int, int]:
    """The byte range of a stage's (contiguous) units, from the layout's field offsets."""
    ends = [
        (off, off + -(-layout.field_nbytes(u, f) // PAGE_BYTES) * PAGE_BYTES)
        for (u, f), off in layout.offsets.items()
        if u in units
    ]
    return min(a for a, _ in ends), max(b for _, b in ends)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(r) for r in out]


def test_each_rank_binds_before_it_first_touches_its_own_units(tmp_path, shm_dir, torchrun) -> None:
    """NUMA first touch: a 2-rank start (gloo) records, per rank, the call that binds its threads, the
    store's creation and every page allocation of the store. Each rank binds first, and allocates
    exactly the byte range of its own units (mutants: opening the store before ``bind_rank_threads``, or
    local rank 0 allocating the whole file in ``create``, fail here); together they cover the store."""
    torchrun(2, WORKER, str(shm_dir), str(tmp_path), timeout_s=180)
    reports = [json.loads((tmp_path / f"order_rank{r}.json").read_text()) for r in range(2)]
    r0 = reports[0]
    layout = StoreLayout(
        tuple(r0["unit_numels"]), getattr(torch, r0["compute_dtype"]), tuple(r0["tied_units"])
    )
    touched = []
    for rank, report in enumerate(reports):
        events = report["events"]
        kinds = [e[0] for e in events]
        assert kinds[0] == "bind" and kinds.count("bind") == 1, (rank, events)
        assert kinds.count("create") == (rank == 0), (rank, events)
        ranges = _merged([(off, off + length) for _, off, length in (e for e in events if e[0] == "touch")])
        assert ranges == [_expected_span(layout, report["units"])], (rank, events)
        touched += ranges
    assert _merged(touched) == [(0, layout.nbytes)] and reports[1]["nbytes"] == layout.nbytes
