"""The host store: layout, shared mapping, stale-store cleanup, and one copy per node (invariant 1).

Cheapest first: the layout is pure arithmetic; create/attach and cleanup run in this process and
in small subprocesses; the last test is a 4-rank torchrun job over a store of 1.8 GB that
checks every rank maps the same (already unlinked) file and keeps no private copy of it.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

import nodetrain.store as store_module
from nodetrain.store import FIELDS, PAGE_BYTES, HostStore, StoreLayout, remove_stale_stores

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "parity_worker.py"

# ----------------------------------------------------------------------------- layout (pure)


@pytest.mark.parametrize("seed", range(20))
def test_layout_buffers_are_page_aligned_and_disjoint(seed: int) -> None:
    rng = random.Random(seed)
    numels = tuple(rng.choice([1, 7, 1024, 1025, 4096, 50_000]) for _ in range(rng.randint(1, 8)))
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    tied = tuple(sorted(rng.sample(range(len(numels)), rng.randint(0, min(2, len(numels))))))
    layout = StoreLayout(numels, dtype, tied_units=tied)
    offsets = layout.offsets

    want_keys = {(u, f) for u in range(len(numels)) for f in FIELDS}
    want_keys |= {(u, "grad_tied") for u in tied}
    assert set(offsets) == want_keys
    spans = []
    for (u, name), off in offsets.items():
        itemsize = dtype.itemsize if name == "compute" else 4
        assert layout.dtype(name) == (dtype if name == "compute" else torch.float32)
        assert off % PAGE_BYTES == 0, (u, name, off)
        spans.append((off, off + numels[u] * itemsize))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), "buffers overlap"
    assert spans[0][0] == 0 and layout.nbytes % PAGE_BYTES == 0
    assert spans[-1][1] <= layout.nbytes < spans[-1][1] + PAGE_BYTES, "store larger than its last page"


# ----------------------------------------------------------------------------- create / attach

_LAYOUT = StoreLayout((1000, 5000, 3), torch.bfloat16, tied_units=(0,))


def test_create_and_attach_share_memory(shm_dir: Path) -> None:
    store = HostStore.create(_LAYOUT, shm_dir, "share-test")
    assert store.path.parent == shm_dir and store.path.name == f"nodetrain-share-test-{os.getpid()}.store"
    assert store.path.stat().st_size == _LAYOUT.nbytes == store.nbytes
    other = HostStore.attach(_LAYOUT, store.path)
    try:
        assert not store.master(1).any() and not other.compute(1).any(), "a new store is zero-filled"
        store.master(1).copy_(torch.arange(5000.0))
        store.compute(0).fill_(1.5)
        other.buffer(0, "grad_tied").fill_(-2.0)
        assert torch.equal(other.master(1), torch.arange(5000.0))
        assert other.compute(0).dtype == torch.bfloat16 and bool((other.compute(0) == 1.5).all())
        assert bool((store.buffer(0, "grad_tied") == -2.0).all())
        assert not store.grad(1).any() and not store.buffer(1, "exp_avg").any(), "fields alias each other"

        # another process attaches the same file and writes; we see it without re-reading
        code = textwrap.dedent(f"""
            import torch
            from nodetrain.store import HostStore, StoreLayout
            layout = StoreLayout((1000, 5000, 3), torch.bfloat16, tied_units=(0,))
            s = HostStore.attach(layout, {str(store.path)!r})
            assert float(s.master(1)[4999]) == 4999.0
            s.buffer(2, "exp_avg_sq").copy_(torch.tensor([7.0, 8.0, 9.0]))
        """)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)
        assert store.buffer(2, "exp_avg_sq").tolist() == [7.0, 8.0, 9.0]

        store.unlink()  # the name goes, the memory stays while mapped
        assert not store.path.exists()
        store.master(2).fill_(3.0)
        assert other.master(2).tolist() == [3.0, 3.0, 3.0]
        other.unlink()  # not the owner: nothing to do, no error
    finally:
        store.unlink()


def test_populate_allocates_exactly_the_given_units_pages(shm_dir: Path) -> None:
    """``create(populate=False)`` sizes the file and allocates no page (tmpfs counts allocated pages in
    ``st_blocks``); ``populate(units)`` allocates those units' page-aligned buffers and nothing else
    (each rank first-touches its own units, NUMA); the default ``create`` allocates every page."""
    layout = StoreLayout((1000, 5000, 3, 70_000), torch.float32, tied_units=(0,))
    store = HostStore.create(layout, shm_dir, "populate", populate=False)
    try:

        def allocated() -> int:
            return store.path.stat().st_blocks * 512

        def buffers(units) -> int:
            return sum(
                -(-layout.field_nbytes(u, f) // PAGE_BYTES) * PAGE_BYTES
                for u in units
                for f in layout.fields_of(u)
            )

        assert store.path.stat().st_size == layout.nbytes and allocated() == 0
        store.populate([2, 1])
        assert allocated() == buffers([1, 2])
        for u in (1, 2):
            start, end = layout.unit_span(u)
            assert (start, end) == (
                min(off for (v, _), off in layout.offsets.items() if v == u),
                min((off for (v, _), off in layout.offsets.items() if v == u + 1), default=layout.nbytes),
            )
        store.populate([0, 1, 3])
        assert allocated() == buffers(range(4)) == layout.nbytes
        assert not store.master(3).any() and not store.buffer(0, "grad_tied").any(), "zero-filled"
    finally:
        store.unlink()
    whole = HostStore.create(layout, shm_dir, "populate-all")
    try:
        assert whole.path.stat().st_blocks * 512 == layout.nbytes
    finally:
        whole.unlink()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_remove_stale_stores_removes_only_dead_runs(shm_dir: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead_pid = _dead_pid()
        dead = shm_dir / f"nodetrain-2024-01-01_00-00-00_p1-{dead_pid}.store"
        dead.write_bytes(b"x" * 12345)
        alive = shm_dir / f"nodetrain-live-run-{live.pid}.store"
        alive.write_bytes(b"y")
        mine = shm_dir / f"nodetrain-mine-{os.getpid()}.store"
        mine.write_bytes(b"z")
        unrelated = shm_dir / "nodetrain-notes.txt"
        unrelated.write_bytes(b"n")

        removed = remove_stale_stores(shm_dir)
        assert removed == [(dead, 12345)]
        assert not dead.exists() and alive.exists() and mine.exists() and unrelated.exists()

        # creating a store cleans up too
        dead.write_bytes(b"x")
        store = HostStore.create(_LAYOUT, shm_dir, "after-stale")
        store.unlink()
        assert not dead.exists() and alive.exists()
        for p in (alive, mine, unrelated):
            p.unlink()
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("ending", ["exit", "sigterm"])
def test_creator_removes_its_store_when_it_ends(shm_dir: Path, ending: str) -> None:
    """A creator that never reaches ``unlink`` (it ends first) still leaves no file behind."""
    code = textwrap.dedent(f"""
        import sys, time, torch
        from nodetrain.store import HostStore, StoreLayout
        s = HostStore.create(StoreLayout((1000,), torch.float32), {str(shm_dir)!r}, "ending")
        print(s.path, flush=True)
        if {ending!r} == "sigterm":
            time.sleep(120)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        path = Path(proc.stdout.readline().strip())
        assert path.parent == shm_dir
        if ending == "sigterm":
            assert path.exists()
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not path.exists(), f"{ending}: the store file outlived its creator"


# ----------------------------------------------------------------------------- one copy per node

# ~99M parameters in many small units: 396 MB of fp32 master weights, a store of 1.8 GB, while
# the largest unit (one layer, 3M parameters) bounds what a rank holds privately (window slot,
# gradient temporaries); 4 tokens per micro-batch keep the step short.
_BIG_HF = {
    "hidden_size": 512,
    "num_hidden_layers": 32,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1536,
    "vocab_size": 2048,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def test_four_ranks_map_one_store_and_keep_no_private_copy(tmp_path: Path, shm_dir: Path, torchrun) -> None:
    ranks, seq_len, microbatches = 4, 4, 4
    with torch.device("meta"):
        num_params = sum(
            p.numel() for p in transformers.LlamaForCausalLM(transformers.LlamaConfig(**_BIG_HF)).parameters()
        )
    master_bytes = 4 * num_params
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, _BIG_HF["vocab_size"], (1, microbatches, 1, seq_len), generator=gen)
    save_file({"inputs": tokens, "labels": tokens.roll(-1, -1)}, str(tmp_path / "batch.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    run_id = f"onecopy-{os.getpid()}-{time.time_ns()}"
    overrides = {
        "train.dtype": "bfloat16",
        "train.seq_len": seq_len,
        "train.micro_batch_size": 1,
        "train.steps": 1,
        "data.vocab_size": _BIG_HF["vocab_size"],  # >= 257 (a byte-level BPE); the batch is given
        "pipeline.microbatches": microbatches,
        "stream.slots": 1,
        "store.dir": str(shm_dir),
    }
    spec = {
        "arch": "LlamaForCausalLM",
        "hf": _BIG_HF,
        "overrides": overrides,
        "model_dir": None,
        "batch_file": str(tmp_path / "batch.safetensors"),
        "out_dir": str(out),
        "run_id": run_id,
        "memory_report": True,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    torchrun(ranks, WORKER, str(tmp_path / "spec.json"), timeout_s=180)

    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    store_nbytes = reports[0]["store_nbytes"]
    # master, grad, exp_avg, exp_avg_sq in fp32 + the bf16 transfer copy, page-aligned per buffer
    assert 18 * num_params <= store_nbytes <= 18 * num_params + 6 * (_BIG_HF["num_hidden_layers"] + 2) * 4096
    assert store_nbytes >= 200e6

    maps = [r["memory"]["store"] for r in reports]
    assert all(m is not None for m in maps), f"a rank does not map the store: {maps}"
    for m in maps:
        assert len(m["maps_lines"]) == 1, m["maps_lines"]
        assert m["path"].endswith(" (deleted)"), f"store name not unlinked after attach: {m['path']}"
        assert m["size"] == store_nbytes
        assert m["perms"].endswith("s") and m["anonymous"] == 0, f"a private (copy-on-write) mapping: {m}"
    assert len({m["path"] for m in maps}) == 1 and len({m["inode"] for m in maps}) == 1, maps
    assert run_id in maps[0]["path"] and maps[0]["inode"] > 0

    for rank, r in enumerate(reports):
        mem = r["memory"]
        # USS counts store pages that only this rank touched (its own units' buffers) as private,
        # although they live once in the shared file; take them out, what remains is the rank's
        # own memory. A per-rank copy of the master weights would add all of master_bytes.
        private_outside = mem["uss_after"] - mem["store"]["private"]
        growth = private_outside - mem["uss_before"]
        assert private_outside - mem["uss_before"] < master_bytes / 2, (
            f"rank {rank}: private memory grew by {growth / 1e6:.0f} MB outside the store "
            f"(master weights: {master_bytes / 1e6:.0f} MB, USS {mem['uss_after'] / 1e6:.0f} MB)"
        )

    leftovers = [p.name for p in Path("/dev/shm").rglob("*") if run_id in p.name]
    assert not leftovers, f"store files left after the job: {leftovers}"


class RecordedCudart:
    """``torch.cuda.cudart()`` stand-in: records (un)registrations; ``fail_at`` makes the n-th
    registration return CUDA error 2 (cudaErrorMemoryAllocation)."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def cudaHostRegister(self, addr: int, size: int, flags: int) -> int:
        self.calls.append(("register", addr, size, flags))
        return 2 if self.fail_at == sum(c[0] == "register" for c in self.calls) else 0

    def cudaHostUnregister(self, addr: int) -> int:
        self.calls.append(("unregister", addr))
        return 0


def test_pin_registers_only_the_given_units_transfer_copies_and_releases_them(shm_dir, monkeypatch) -> None:
    cudart = RecordedCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    layout = StoreLayout((5000, 300, 7000), torch.bfloat16)
    store = HostStore.create(layout, shm_dir, "pin")
    store.unlink()
    assert cudart.calls == []  # mapping a store registers nothing
    store.pin([2, 1, 2])
    want = [(store.compute(u).data_ptr(), -(-store.compute(u).numel() * 2 // 4096) * 4096) for u in (1, 2)]
    assert [c[1:3] for c in cudart.calls] == want and all(c[0] == "register" for c in cudart.calls)
    assert store.pinned_nbytes == 4096 + 16384 < layout.nbytes / 10  # not the store, not unit 0
    assert all(addr % 4096 == 0 for addr, _ in want)
    store.unpin()
    store.unpin()  # idempotent
    assert sorted(c[1] for c in cudart.calls if c[0] == "unregister") == sorted(a for a, _ in want)
    assert store.pinned_nbytes == 0


def test_pin_failure_raises_and_releases_what_it_registered(shm_dir, monkeypatch) -> None:
    cudart = RecordedCudart(fail_at=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    store = HostStore.create(StoreLayout((5000, 300, 7000), torch.bfloat16), shm_dir, "pin-fail")
    store.unlink()
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of unit 1.*CUDA error 2.*ulimit -l"):
        store.pin([0, 1, 2])
    assert [c[0] for c in cudart.calls] == ["register", "register", "unregister"]
    assert cudart.calls[2][1] == store.compute(0).data_ptr() and store.pinned_nbytes == 0


def test_is_pinned_asks_about_the_transfer_copys_own_range(shm_dir, monkeypatch) -> None:
    """``is_pinned(u)`` asks the driver about unit u's own bytes, not the mapping's start (the H200
    run's check of ``store.compute(0).is_pinned()`` was False for a registered range). The stand-in
    driver reports the bytes registered through the recorded ``cudaHostRegister`` as page-locked."""
    store = HostStore.create(StoreLayout((5000, 300, 7000), torch.bfloat16), shm_dir, "is-pinned")
    store.unlink()
    assert not store.is_pinned(0)  # the real question, without CUDA: False, no error
    cudart = RecordedCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)

    def locked(addr: int) -> bool:
        ranges = [(c[1], c[2]) for c in cudart.calls if c[0] == "register"]
        released = {c[1] for c in cudart.calls if c[0] == "unregister"}
        return any(a <= addr < a + n for a, n in ranges if a not in released)

    monkeypatch.setattr(store_module, "_page_locked", locked)
    store.pin([1])
    assert [store.is_pinned(u) for u in range(3)] == [False, True, False]
    store.unpin()
    assert not store.is_pinned(1)


@pytest.mark.parametrize("optim", [{"speculative": True}, {"state": "lean"}], ids=["full", "lean"])
def test_engine_close_unmaps_the_store_while_the_engine_lives(optim, one_rank_world) -> None:
    """``Engine.close`` alone ends this process's mapping of the store (no ``del`` of the engine): the
    optimizer (AdamW's views and speculative backups, or the lean one's) and the window let go of it."""
    from test_overlap import TINY_VOCAB, tiny_engine_config

    from bench._engine import make_engine
    from nodetrain.run.jobs import mapped

    cfg = tiny_engine_config(steps=2, **optim)
    cfg.train.dtype = "bfloat16" if optim.get("state") == "lean" else "float32"
    engine, _ = make_engine(cfg, "close-unmaps")
    inputs = torch.randint(0, TINY_VOCAB, (2, 1, 8))
    labels = torch.randint(0, TINY_VOCAB, (2, 1, 8))
    for step in range(2):
        engine.train_step(step, inputs, labels)
    engine.wait_optimizer()
    assert mapped(engine.store.path) is True
    engine.close()
    assert mapped(engine.store.path) is False
