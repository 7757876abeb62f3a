"""The host side of gradient offloads: accumulation without temporaries, ships through staging, and
page-locked staging of exactly the requested pages (accumulate.py, window.py, staging.py).

- ``HostAccumulator`` gives ``fp32(dst) + fp32(src)`` bit for bit (checked against float64 sums
  rounded once), in any number of chunks.
- A step's accumulations in its steady state neither page-fault nor allocate in proportion to the
  unit (``getrusage`` minor faults; bytes allocated on the D2H worker, from torch's profiler).
- A resident block's ship streams its fp32 accumulator through a staging buffer, in chunks, and
  counts in the staging rotation (an offload after it must not overwrite it).
- On CUDA each staging buffer is registered as its own page-rounded range (a fake ``cudart`` here).
"""

from __future__ import annotations

import resource

import pytest
import torch
from torch.autograd.profiler import profile

import nodetrain.engine.device.staging as staging
from nodetrain.engine.device.staging import GradStaging, page_round
from nodetrain.engine.device.window import Window
from nodetrain.engine.host.accumulate import HostAccumulator
from nodetrain.model import Binding
from nodetrain.run.inject import Faults
from nodetrain.store import HostStore, StoreLayout


def _reference_sum(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """fp32(dst) + fp32(src) rounded once: the float64 sum is exact for operands this close in scale."""
    return (dst.double() + src.double().reshape(dst.shape)).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_accumulator_adds_bit_for_bit_in_any_chunking(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    n, rows, width = 10_007, 37, 13
    for chunk_per_thread in (1, 7, 1 << 17):  # many chunks, ragged ones, one chunk
        acc = HostAccumulator(chunk_per_thread)
        dst, src = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(dtype)
        want = _reference_sum(dst, src)
        acc.add(dst, src)
        assert torch.equal(dst, want), chunk_per_thread
        acc.copy(dst, src)
        assert torch.equal(dst, src.float())
        table, grad = torch.randn(50, width, generator=gen), torch.randn(rows, width, generator=gen).to(dtype)
        index = torch.randperm(50, generator=gen)[:rows]
        want = table.clone()
        want[index] = _reference_sum(table[index], grad)
        acc.index_add(table, index, grad)
        assert torch.equal(table, want), chunk_per_thread


# a dense block of N elements and a row block [V, D]: each fp32 temporary of the old code was
# > 32 MiB, above glibc's largest mmap threshold, so it was mapped, faulted in and unmapped per add
N, V, D = 9_000_000, 36_000, 256
PAGE = resource.getpagesize()


def _step(window: Window, grads: list[torch.Tensor], rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    window.begin([])
    for g in grads:  # the first overwrites, the others add
        window.offload(1, {"w": g})
    for index, g in rows:  # the first zeroes and scatter-adds, the other adds
        window.offload_rows(0, index, g)
    window.flush()


def test_a_steps_accumulations_neither_fault_nor_allocate(shm_dir) -> None:
    """Steady state (after a first step): a step's minor page faults stay under 1% of one fp32
    temporary's pages, and the D2H worker allocates under 64 KiB in a step. Today's ``dst.add_(bf16)`` and
    ``index_add_(…, src.float())`` allocate ~36 MB and fault ~8,800 pages per add."""
    store = HostStore.create(StoreLayout((V * D, N), torch.bfloat16), shm_dir, "accum-faults")
    store.unlink()
    bindings = [(Binding("weight", 0, 0, (V, D)),), (Binding("w", 1, 0, (N,)),)]
    window = Window(store, bindings, [0, 1], 2, "cpu", rows=[0], accum_threads=2)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(N, generator=gen).bfloat16() for _ in range(3)]
    rows = [(torch.randperm(V, generator=gen), torch.randn(V, D, generator=gen).bfloat16()) for _ in range(2)]
    try:
        _step(window, grads, rows)  # first touch of the store's and staging's pages, the scratch
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _step(window, grads, rows)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        prof = profile(profile_memory=True, use_kineto=False)  # (its own records fault pages: apart)
        window.run_host(prof.__enter__)  # the profiler records the thread that starts it
        _step(window, grads, rows)
        window.run_host(lambda: prof.__exit__(None, None, None))
        allocated = sum(e.self_cpu_memory_usage for e in prof.function_events if e.self_cpu_memory_usage > 0)
        temporary_pages = N * 4 // PAGE
        assert faults < temporary_pages // 100, (faults, temporary_pages)
        assert allocated < 64 * 1024, allocated
        want = grads[0].float() + grads[1].float() + grads[2].float()
        assert torch.equal(store.grad(1), want)  # the same fp32 sums, in the same order
        table = torch.zeros(V, D)
        for index, g in rows:
            table[index] += g.float()
        assert torch.equal(store.grad(0).view(V, D), table)
    finally:
        window.close()


# one resident block of two parameters that ships in several chunks, and a streamed one
SHIP_NUMELS = (6000, 700)
SHIP_BINDINGS = [
    (Binding("a", 0, 0, (4000,)), Binding("b", 0, 4000, (2000,))),
    (Binding("w", 1, 0, (700,)),),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_ship_streams_through_staging_in_chunks(shm_dir, monkeypatch, dtype) -> None:
    """Every chunk a ship lands in the store is read from a staging buffer, in chunks of half a
    buffer that alternate its two halves (≥ 3 chunks here, so a half is reused), and the store
    gets the device accumulator's fp32 sums bit for bit."""
    store = HostStore.create(StoreLayout(SHIP_NUMELS, dtype), shm_dir, "accum-ship")
    store.unlink()
    window = Window(store, SHIP_BINDINGS, [0, 1], 2, "cpu", resident=[0])
    raw = [(r.data_ptr(), r.data_ptr() + r.numel()) for r in window._staging._raw]
    landed: list[int] = []
    copy = HostAccumulator.copy
    monkeypatch.setattr(
        HostAccumulator, "copy", lambda self, dst, src: (landed.append(src.data_ptr()), copy(self, dst, src))
    )
    gen = torch.Generator().manual_seed(0)
    grads = [{"a": torch.randn(4000, generator=gen), "b": torch.randn(2000, generator=gen)} for _ in range(3)]
    try:
        window.begin([], {0: 3})
        for g in grads:
            window.offload(0, {k: v.to(dtype) for k, v in g.items()})
        window.flush()
        for name, lo, hi in (("a", 0, 4000), ("b", 4000, 6000)):
            want = sum((g[name].to(dtype).float() for g in grads[1:]), grads[0][name].to(dtype).float())
            assert torch.equal(store.grad(0)[lo:hi], want), name
        half = page_round(6000 * store.layout.compute_dtype.itemsize) // 8  # fp32 elements per half
        assert len(landed) == -(-4000 // half) + -(-2000 // half) >= 3, (len(landed), half)
        assert all(any(lo <= p < hi for lo, hi in raw) for p in landed), "a chunk not read from staging"
        assert len(set(landed)) == 2, "chunks alternate two halves"
    finally:
        window.close()


def test_a_ship_holds_its_staging_buffer_until_landed(shm_dir) -> None:
    """One slot, a slowed D2H worker: the streamed offload right after a ship must wait for the ship
    to land before its copy reuses the one staging buffer (else the ship reads the offload's bytes
    as its accumulator, or the offload's gradient is overwritten)."""
    store = HostStore.create(StoreLayout(SHIP_NUMELS, torch.float32), shm_dir, "accum-ship-bound")
    store.unlink()
    window = Window(store, SHIP_BINDINGS, [0, 1], 1, "cpu", faults=Faults(copy_delay_s=0.05), resident=[0])
    gen = torch.Generator().manual_seed(1)
    g0 = {"a": torch.randn(4000, generator=gen), "b": torch.randn(2000, generator=gen)}
    g1 = torch.randn(700, generator=gen)
    try:
        window.begin([], {0: 1})
        window.offload(0, g0)  # the resident block's only backward: its ship
        window.offload(1, {"w": g1})
        window.flush()
        assert torch.equal(store.grad(0), torch.cat([g0["a"], g0["b"]]))
        assert torch.equal(store.grad(1), g1)
    finally:
        window.close()


class _FakeCudart:
    """Records ``cudaHostRegister``/``cudaHostUnregister``; fails the registration number ``fail_at``."""

    def __init__(self, fail_at: int = -1):
        self.registered: dict[int, int] = {}
        self.calls, self.fail_at = 0, fail_at

    def cudaHostRegister(self, addr: int, size: int, flags: int) -> int:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        assert flags == 0 and addr not in self.registered
        self.registered[addr] = size
        return 0

    def cudaHostUnregister(self, addr: int) -> int:
        del self.registered[addr]
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(cudart: _FakeCudart) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # not asked of the fake here

    return install


def test_cuda_staging_pins_exactly_the_requested_pages(fake_cuda) -> None:
    """1.1 GB in two buffers would pin 2 × 2 GiB through torch's caching host allocator; here each
    buffer is one registered range, page-aligned, of its bytes rounded up to a page, released at
    close. (A smaller size of the same shape: 3 × 2^20 + 5 bf16 elements per buffer.)"""
    cudart = _FakeCudart()
    fake_cuda(cudart)
    numel = 3 * 2**20 + 5
    stage = GradStaging(2, numel, torch.bfloat16, torch.device("cuda", 0))
    want = page_round(numel * 2)
    assert want < 2 * numel * 2 and want < 2 ** (numel * 2).bit_length()
    assert sorted(cudart.registered.values()) == [want, want]
    assert all(addr % PAGE == 0 for addr in cudart.registered)
    assert stage.pinned_nbytes == 2 * want and stage.nbytes == 2 * numel * 2
    stage.close()
    stage.close()  # idempotent
    assert cudart.registered == {} and stage.pinned_nbytes == 0


def test_a_failed_registration_releases_the_others(fake_cuda) -> None:
    cudart = _FakeCudart(fail_at=1)
    fake_cuda(cudart)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of a .* staging buffer failed"):
        GradStaging(3, 1000, torch.bfloat16, torch.device("cuda", 0))
    assert cudart.registered == {}


def test_cpu_staging_pins_nothing() -> None:
    stage = GradStaging(2, 1000, torch.bfloat16, torch.device("cpu"))
    assert stage.pinned_nbytes == 0 and not stage.pinned and stage.nbytes == 4000


SLEEP_CYCLES = 20_000_000
"""A GPU sleep of ~10 ms (at ~2 GHz): far longer than the host needs to land a chunk."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu-marked test)")
@pytest.mark.parametrize("mutant", [False, True], ids=["waits", "mutant-no-chunk-wait"])
def test_cuda_ship_lands_only_copied_chunks(shm_dir, monkeypatch, mutant: bool) -> None:
    """A resident block's two backwards write its accumulator late (GPU sleeps on the compute
    stream) and each chunk's D2H copy lands late (a sleep on the D2H stream): the ship must wait for
    the accumulator's event and for each chunk's before landing it (4 chunks through page-locked
    halves of 1 MiB). The mutant lands without the chunk's event wait and must read stale staging."""
    copy_in = staging._copy_in

    def slow_copy_in(dst, src):
        torch.cuda._sleep(SLEEP_CYCLES)  # on the D2H stream: the chunk lands late
        copy_in(dst, src)

    monkeypatch.setattr(staging, "_copy_in", slow_copy_in)
    if mutant:
        monkeypatch.setattr(  # the chunk is landed without waiting for its copy's event
            staging.GradStaging,
            "_land",
            staticmethod(lambda land, dst, first, half, event: land(dst, first, half)),
        )
    store = HostStore.create(StoreLayout((1 << 20,), torch.bfloat16), shm_dir, "gpu-ship")
    store.unlink()
    window = Window(store, [(Binding("w", 0, 0, (1024, 1024)),)], [0], 2, torch.device("cuda"), resident=[0])
    try:
        assert window._staging.pinned and window.staging_pinned_nbytes == 2 * page_round(2 << 20)
        store.grad(0).fill_(-1.0)  # the previous step's leftovers: the ship's first write overwrites them
        window.begin([], {0: 2})
        for i in range(2):
            torch.cuda._sleep(SLEEP_CYCLES)  # the gradient below is written late on the compute stream
            window.offload(
                0, {"w": torch.full((1024, 1024), float(i + 1), device="cuda", dtype=torch.bfloat16)}
            )
        window.flush()
        got = store.grad(0).clone()
    finally:
        window.close()
    assert torch.equal(got, torch.full_like(got, 3.0)) != mutant
