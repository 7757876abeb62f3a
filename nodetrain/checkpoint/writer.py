"""Writing a checkpoint: a snapshot of this rank's units, files in a background thread, atomic commit.

Owns: what each rank writes for the units it owns (per unit: ``model-*`` in the export dtype,
``master-*`` fp32 unless the export is fp32, ``optimizer-*`` with ``exp_avg``, ``exp_avg_sq`` and
AdamW's update count, all keyed by HF tensor name), what rank 0 adds (``config.json``,
``generation_config.json``, the tokenizer files (export.py) and the three
``*.safetensors.index.json``), and the commit protocol. Does not own: when to save
(checkpointing.py) or the trainer state's contents beyond files and RNG (the caller passes them).

Protocol for step N (DESIGN invariant 6):
    1. every rank copies its units' fp32 master, exp_avg and exp_avg_sq into private memory (the
       only time training waits) and hands them to a writer thread;
    2. the thread writes its files into ``step-N.tmp/`` and fsyncs each, recording size + sha256;
    3. after each later step the ranks agree (one tiny all-reduce) whether every thread is done;
       then manifests and RNG states are gathered to rank 0, which writes ``trainer_state.json``
       (fsynced, with its own digest, its parent and sequence: state.py), renames ``step-N.tmp`` to
       ``step-N``, fsyncs the parent and prunes old ones of the same chain (``keep_last``).
A crash at any point leaves either no ``step-N`` or a complete one; ``*.tmp`` leftovers are
removed at the next start. All collectives run on the caller's thread, on a gloo group of their
own, so they never interleave with the training's.

A full ``checkpoint.dir`` is a refusal (``DiskFullError``, every rank, naming the path and the
bytes): checked before a save writes anything (the ranks' shares against the free space), and
again if a write still runs out of space (the partial ``step-N.tmp`` is removed at once). The
previous checkpoint is never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from nodetrain.checkpoint import state as st
from nodetrain.checkpoint.collective import all_gather_json, broadcast_json
from nodetrain.checkpoint.export import write_export_files
from nodetrain.checkpoint.hf_layout import checkpoint_pieces
from nodetrain.checkpoint.state import lean_key
from nodetrain.config.constants import DTYPES
from nodetrain.config.disk import DiskFullError, is_disk_full
from nodetrain.config.schema import CheckpointConfig
from nodetrain.model import HFModel, Unit
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.store import LEAN_MOMENT_FIELDS, HostStore

__all__ = ["CheckpointWriter", "EXPORT_DTYPES"]

log = logging.getLogger(__name__)

EXPORT_DTYPES = DTYPES  # checkpoint.export_dtype name -> torch dtype: the config's dtype table
_SNAPSHOT_FIELDS = ("master", "exp_avg", "exp_avg_sq")
_LEAN_SNAPSHOT_FIELDS = ("compute", *LEAN_MOMENT_FIELDS)
_META = {"format": "pt"}  # transformers refuses safetensors files without it


@dataclass
class _Pending:
    step: int
    tmp: Path
    future: Future
    rng: dict
    run_state: dict
    stall_s: float


class _Abandoned(Exception):
    """The writer thread stops between files: the run is ending without this save (a second signal)."""


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


class CheckpointWriter:
    """This rank's side of saving checkpoints into ``directory``.

    Args:
        directory: where ``step-N`` directories go (shared by all ranks).
        cfg: the checkpoint config (export dtype, async write, test delay, keep_last).
        model: the model (names, units, HF config for ``config.json``).
        store: the host store.
        units: the units this rank owns.
        optimizer: this rank's AdamW (its update counts are saved).
        group: a gloo process group of all ranks, used only by checkpointing.
        tokenizer: the run's tokenizer (export.run_tokenizer), saved into every checkpoint by rank 0
            with its bos/eos/pad ids in config.json and generation_config.json; None = none.
        source_dir: the imported model directory (``model.init_from``), whose generation_config.json
            is kept.
        stop: called while training waits for a save; True = a stop was requested (a signal), which
            is then acknowledged in the log at once (the save is finished first).
        parent: the checkpoint this run continues (``state.identity`` of the one resumed), named as
            the first save's ``parent``; None for a fresh run.
        before_write: called on the writer thread before each file is written (test-only fault
            injection, ``Faults.before_write``); default nothing.
    """

    def __init__(
        self,
        directory: Path,
        cfg: CheckpointConfig,
        model: HFModel,
        store: HostStore,
        units: list[Unit],
        optimizer: StoreAdamW,
        group,
        tokenizer=None,
        source_dir: str = "",
        stop: Callable[[], bool] | None = None,
        parent: dict | None = None,
        before_write: Callable[[], None] | None = None,
    ):
        self.dir, self.cfg, self.model = Path(directory), cfg, model
        self.stop, self.parent = stop or (lambda: False), parent
        self._before_write = before_write or (lambda: None)
        self.tokenizer, self.source_dir = tokenizer, source_dir
        self.store, self.units, self.optimizer, self.group = store, units, optimizer, group
        self.rank = dist.get_rank()
        self.export_dtype = EXPORT_DTYPES[cfg.export_dtype]
        self.lean = store.layout.state == "lean"  # bf16 master weights: the bf16 export is them
        self.master_dtype = torch.bfloat16 if self.lean else torch.float32
        # the export doubles as the master weights when it has their dtype: resume reads them in
        # either layout (experts one per expert too, hf_layout.import_pieces), bit for bit
        self.master_prefix = "model" if self.export_dtype == self.master_dtype else "master"
        self._fields = _LEAN_SNAPSHOT_FIELDS if self.lean else _SNAPSHOT_FIELDS
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._pending: _Pending | None = None
        self._abandon = threading.Event()
        self.last_saved: int | None = None
        """Step of the newest checkpoint committed by this writer (or resumed from)."""

    # ---- main thread ---------------------------------------------------------------------------

    def save(self, step: int, run_state: dict[str, Any]) -> float:
        """Start saving the state after ``step`` optimizer steps; returns the seconds training waited.

        A previous save still in flight is finished (waited for and committed) first. Collective:
        every rank calls it at the same step.

        Args:
            step: completed optimizer steps (the directory is ``step-<step>``).
            run_state: the trainer state's run-level fields (used on rank 0).
        """
        t0 = time.perf_counter()
        self.finish()
        self._check_space(step)
        tmp = self.dir / f"{st.step_dir_name(step)}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        rng, steps = st.rng_state(), self.optimizer.steps_by_name()
        tiered = hasattr(self.optimizer, "read_fields")  # store.tier=nvme: a unit at a time, in order
        snapshot = self.cfg.async_write and self._snapshot_fits() and not tiered
        bufs = {
            u.index: {
                f: (self.store.buffer(u.index, f).clone() if snapshot else self.store.buffer(u.index, f))
                for f in self._fields
                if not tiered or f == "compute"
            }
            for u in self.units
        }
        if snapshot:
            future = self._pool.submit(self._write_files, tmp, bufs, steps)
        else:
            future = Future()
            try:
                future.set_result(self._write_files(tmp, bufs, steps))
            except Exception as e:  # reported collectively at commit
                future.set_exception(e)
        stall_s = time.perf_counter() - t0
        self._pending = _Pending(step, tmp, future, rng, run_state, stall_s)
        return stall_s

    def _nbytes(self) -> int:
        """Bytes of the tensor files this rank writes per checkpoint (headers and JSON not counted)."""
        layout, total = self.store.layout, 0
        for u in self.units:
            total += u.numel * self.export_dtype.itemsize
            total += u.numel * self.master_dtype.itemsize if self.master_prefix == "master" else 0
            moments = LEAN_MOMENT_FIELDS if self.lean else ("exp_avg", "exp_avg_sq")
            total += sum(layout.field_nbytes(u.index, f) for f in moments) + 4 * len(u.params)
        return total

    def _check_space(self, step: int) -> None:
        """Refuse a save that cannot fit (collective): every rank's share against the free space each
        rank sees in ``checkpoint.dir``, before any file is written.

        Raises:
            DiskFullError: on every rank, naming the path, the bytes needed and free.
        """
        free = (
            shutil.disk_usage(self.dir).free if self.dir.is_dir() else shutil.disk_usage(self.dir.parent).free
        )
        parts = all_gather_json([self._nbytes(), free], self.group)
        need, free = sum(n for n, _ in parts), min(f for _, f in parts)
        if need > free:
            raise DiskFullError(self._full_message(step, need, free))

    def _full_message(self, step: int, need: int, free: int) -> str:
        kept = (
            f"the newest checkpoint, {st.step_dir_name(self.last_saved)}, is intact"
            if self.last_saved is not None
            else "no checkpoint of this run was written"
        )
        return (
            f"checkpoint.dir={self.dir}: the filesystem is full: checkpoint {st.step_dir_name(step)} needs "
            f"{need / 1e6:,.1f} MB and {free / 1e6:,.1f} MB is free, so the run stopped after step {step} "
            f"without it ({kept}); free space there, lower checkpoint.keep_last or set another "
            "checkpoint.dir, then relaunch with checkpoint.resume=auto"
        )

    def _snapshot_fits(self) -> bool:
        need = sum(self.store.layout.field_nbytes(u.index, f) for u in self.units for f in self._fields)
        avail = psutil.virtual_memory().available
        if need * 2 > avail:
            log.warning(
                "checkpoint snapshot needs %.2f GB, %.2f GB free: writing from the host store while "
                "training waits (checkpoint.async_write)",
                need / 1e9,
                avail / 1e9,
            )
            return False
        return True

    def poll(self) -> None:
        """Commit the save in flight if every rank's writer is done (collective; cheap when idle)."""
        if self._pending is None:
            return
        flag = torch.tensor([int(self._pending.future.done())], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if int(flag):
            self._commit()

    def finish(self) -> None:
        """Wait for the save in flight (if any) and commit it (collective)."""
        if self._pending is not None:
            self._wait(self._pending)
            self._commit()

    def _wait(self, p: _Pending) -> None:
        """Wait for ``p``'s files; a stop requested meanwhile is acknowledged at once (logged), and the
        save is finished first: it is the state the run stops with (a second signal abandons it)."""
        told = False
        while True:
            try:
                p.future.exception(timeout=0.5)
                return
            except TimeoutError:
                if not told and self.stop():
                    told = True
                    log.warning(
                        "stop requested while checkpoint %s is being written: finishing it first (a second "
                        "signal abandons it; the previous checkpoint stays)",
                        st.step_dir_name(p.step),
                    )

    def close(self, ok: bool = True) -> None:
        """Finish the save in flight when ``ok``; otherwise (an error or a second signal is unwinding,
        other ranks may be gone) stop the thread after the file it is writing, leaving ``step-N.tmp``
        for the next start to remove."""
        try:
            if ok:
                self.finish()
            elif self._pending is not None:
                self._abandon.set()
                self._pending.future.exception()
                log.warning(
                    "checkpoint %s abandoned before its commit: not written",
                    st.step_dir_name(self._pending.step),
                )
        finally:
            self._pending = None
            self._pool.shutdown(wait=True)

    def _commit(self) -> None:
        p, self._pending = self._pending, None
        full = False
        try:
            manifest, write_s = p.future.result()
            error = None
        except Exception as e:
            manifest, write_s, error = {}, 0.0, f"rank {self.rank}: {type(e).__name__}: {e}"
            full = is_disk_full(e)
        parts = all_gather_json(
            {
                "files": manifest,
                "rng": p.rng,
                "error": error,
                "full": full,
                "stall_s": p.stall_s,
                "write_s": write_s,
            },
            self.group,
        )
        errors = [q["error"] for q in parts if q["error"]]
        full = any(q["full"] for q in parts)
        if self.rank == 0 and not errors:
            try:
                self._install(p, parts)
            except Exception as e:
                errors.append(f"rank 0: {type(e).__name__}: {e}")
                full = full or is_disk_full(e)
        if self.rank == 0 and errors:
            shutil.rmtree(p.tmp, ignore_errors=True)  # every rank's thread is done: free what it took
        errors, full = broadcast_json([errors, full], self.group)
        if full:
            need = sum(all_gather_json(self._nbytes(), self.group))
            raise DiskFullError(self._full_message(p.step, need, shutil.disk_usage(self.dir).free))
        if errors:
            raise RuntimeError(f"checkpoint {st.step_dir_name(p.step)} failed: " + "; ".join(errors))
        self.last_saved = p.step

    def _install(self, p: _Pending, parts: list[dict]) -> None:
        files = {name: rec for q in parts for name, rec in q["files"].items()}
        stall, write = [q["stall_s"] for q in parts], [q["write_s"] for q in parts]
        states = self._states()
        trainer_state = {
            **p.run_state,
            "rng": [q["rng"] for q in parts],
            "save_timing_s": {"stall": stall, "write": write},
            "files": files,
            "parent": self.parent,
            "sequence": 1 + max((s.get("sequence", 0) for s in states.values()), default=0),
        }
        sealed = st.write_state(p.tmp / st.TRAINER_STATE, trainer_state)
        st.fsync_dir(p.tmp)
        final = self.dir / st.step_dir_name(p.step)
        old = None
        if final.exists():  # resumed from an older checkpoint into a directory that has this step
            old = final.with_name(final.name + ".old.tmp")
            final.rename(old)
        p.tmp.rename(final)
        st.fsync_dir(self.dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.parent = st.identity(final, sealed)
        log.info(
            "checkpoint %s: training stalled %.3f s (snapshot copy), files written in %.2f s (ranks' max)",
            final,
            max(stall),
            max(write),
        )
        self._prune(final)

    def _states(self) -> dict[Path, dict]:
        """Every complete checkpoint of the directory whose trainer state reads and verifies."""
        states = {}
        for _, path in st.complete_checkpoints(self.dir):
            try:
                states[path] = st.read_state(path)
            except st.CheckpointError:
                continue  # not this writer's to judge: resume refuses it by name
        return states

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``keep_last`` checkpoints of the chain ``keep`` is on (itself and its
        ancestors); another branch's checkpoints (a resume from an older step) are left alone."""
        if self.cfg.keep_last <= 0:
            return
        states = self._states()
        on_chain = st.chain(states, keep)
        for path in on_chain[self.cfg.keep_last :]:
            shutil.rmtree(path, ignore_errors=True)
            log.info("checkpoint.keep_last=%d: removed %s", self.cfg.keep_last, path)
        others = sorted(p.name for p in states if p not in on_chain)
        if others:
            log.info(
                "checkpoint.keep_last: %s belong to another branch than %s (a resume from an older step): "
                "kept, not counted",
                ", ".join(others),
                keep.name,
            )

    # ---- writer thread ---------------------------------------------------------------------------

    def _save(self, tensors: dict[str, torch.Tensor], path: Path, manifest: dict) -> None:
        if self._abandon.is_set():
            raise _Abandoned(f"{path.parent.name}: abandoned")
        self._before_write()
        save_file(tensors, str(path), metadata=_META)
        _fsync(path)
        manifest[path.name] = st.file_record(path)

    def _write_files(self, tmp: Path, bufs: dict, steps: dict[str, float]) -> tuple[dict, float]:
        t0, manifest, n = time.perf_counter(), {}, len(self.model.units)
        for u in self.units:
            if hasattr(self.optimizer, "read_fields"):  # the tier's fields, read from its file now
                bufs[u.index] = {**bufs[u.index], **self.optimizer.read_fields(u.index)}
            master, named, exported = bufs[u.index]["compute" if self.lean else "master"], {}, {}
            for p in u.params:
                named[p.hf_name] = master[p.offset : p.offset + p.numel].view(p.shape)
                for q in checkpoint_pieces(self.model, p):  # transformers' saved layout (hf_layout.py)
                    exported[q.name] = named[p.hf_name].view(-1)[q.offset : q.offset + q.numel].view(q.shape)
            model = {k: v.to(self.export_dtype) for k, v in exported.items()}
            model.update(dict(self.model.constants[u.index].values()))  # the router's bias, fp32 (hf.py)
            self._save(model, tmp / st.shard_name("model", u.index, n), manifest)
            del model
            if self.master_prefix == "master":
                self._save(named, tmp / st.shard_name("master", u.index, n), manifest)
            opt = {lean_key(u, f): bufs[u.index][f] for f in LEAN_MOMENT_FIELDS} if self.lean else {}
            for p in u.params:
                for f in () if self.lean else ("exp_avg", "exp_avg_sq"):
                    opt[f"{p.hf_name}.{f}"] = bufs[u.index][f][p.offset : p.offset + p.numel].view(p.shape)
                opt[f"{p.hf_name}.step"] = torch.tensor(steps[p.hf_name], dtype=torch.float32)
            self._save(opt, tmp / st.shard_name("optimizer", u.index, n), manifest)
            bufs[u.index] = None  # a tier unit's copies go now (RAM holds one unit's)
        if self.rank == 0:
            self._write_shared(tmp, manifest)
        return manifest, time.perf_counter() - t0

    def _write_shared(self, tmp: Path, manifest: dict) -> None:
        """config.json and the indexes (pure functions of the model: no rank needs another's)."""
        n = len(self.model.units)
        for path in write_export_files(
            tmp, self.model.config, self.tokenizer, self.export_dtype, self.source_dir
        ):
            _fsync(path)
            manifest[path.name] = st.file_record(path)
        kinds = [("model", self.export_dtype.itemsize, ("",))]
        if self.master_prefix == "master":
            kinds.append(("master", self.master_dtype.itemsize, ("",)))
        kinds.append(("optimizer", 4, () if self.lean else (".exp_avg", ".exp_avg_sq")))
        for kind, itemsize, suffixes in kinds:
            weight_map, total = {}, 0
            for u in self.model.units:
                if kind == "optimizer" and self.lean:
                    layout = self.store.layout
                    for f in LEAN_MOMENT_FIELDS:
                        weight_map[lean_key(u, f)] = st.shard_name(kind, u.index, n)
                        total += layout.numel(u.index, f) * layout.itemsize(f)
                if kind == "model":  # constants (the router's bias): fp32, as transformers keeps them
                    for hf_name, t in self.model.constants[u.index].values():
                        weight_map[hf_name] = st.shard_name(kind, u.index, n)
                        total += t.numel() * 4
                for p in u.params:
                    names = (
                        [q.name for q in checkpoint_pieces(self.model, p)] if kind == "model" else [p.hf_name]
                    )
                    for s in suffixes:
                        weight_map.update({name + s: st.shard_name(kind, u.index, n) for name in names})
                        total += p.numel * itemsize
                    if kind == "optimizer":
                        weight_map[p.hf_name + ".step"] = st.shard_name(kind, u.index, n)
                        total += 4
            path = tmp / f"{kind}.safetensors.index.json"
            st.write_json(path, {"metadata": {"total_size": total}, "weight_map": weight_map})
            manifest[path.name] = st.file_record(path)
