"""What the training loop sees of checkpoints: where a run starts, when it saves, how it ends.

Owns: the decisions — resume (``checkpoint.resume``) beats import (``model.init_from``) beats
random init; save every ``checkpoint.every`` steps, at the last step and before an early stop
(``checkpoint.stop_after_steps``); the run-level fields of ``trainer_state.json`` (step, LR
schedule, data cursor, config + hash, stage layout). Does not own: the files (writer.py), their
verification (state.py) or loading (resume.py, hf_import.py).

    path = choose_resume(cfg, ckpt_dir)                         # rank 0, before the data
    ckpt = Checkpointing(cfg, run_dir, resolved, model, resume_path=path)  # collective, before the store
    engine = Engine(..., init_from=ckpt.init_fn())
    ckpt.check_import()                                         # collective: no NaN/inf imported
    start = ckpt.attach(engine)                                 # AdamW counts, RNG; first step
    for step in range(start, cfg.train.steps):
        ...
        stop, stall_s = ckpt.after_step(step + 1)
        if stop: break
    ckpt.close(ok=True)                                         # waits for and commits the last save
"""

from __future__ import annotations

import json
import logging
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tokenizers import Tokenizer

from nodetrain.checkpoint import state as st
from nodetrain.checkpoint.collective import all_gather_json
from nodetrain.checkpoint.export import run_tokenizer
from nodetrain.checkpoint.hf_import import check_model_dir, load_constants, load_units
from nodetrain.checkpoint.resume import (
    check_training_state,
    choose_checkpoint,
    restore_rng,
    restore_steps,
    seed_rng,
    training_state_loader,
)
from nodetrain.checkpoint.tensors import read_index
from nodetrain.checkpoint.writer import CheckpointWriter
from nodetrain.config.batch import BatchShape
from nodetrain.config.schema import Config
from nodetrain.data.tokenizer import vocabulary_sha256
from nodetrain.model import HFModel
from nodetrain.optim.adamw import lr_at

__all__ = ["Checkpointing", "choose_resume", "dataset_identity"]

log = logging.getLogger(__name__)


def choose_resume(cfg: Config, ckpt_dir: Path) -> str | None:
    """The checkpoint this run resumes (``checkpoint.resume``), verified, or None; removes the
    ``*.tmp`` saves a crash interrupted first. Rank 0 only, before the data is prepared (a resumed
    run keeps the checkpoint's tokenizer, data/checks.py).

    Raises:
        CheckpointError: ``checkpoint.resume`` names a bad checkpoint, or ``auto`` finds only bad ones.
    """
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.is_dir():
        for p in ckpt_dir.glob("*.tmp"):
            log.warning("removing %s, an interrupted checkpoint save", p)
            shutil.rmtree(p, ignore_errors=True)
    try:
        path = choose_checkpoint(cfg.checkpoint.resume, ckpt_dir)
    except (OSError, ValueError) as e:
        raise st.CheckpointError(str(e)) from e
    return None if path is None else str(path)


def dataset_identity(data_dir: Path | None) -> dict[str, Any]:
    """What a checkpoint records of the dataset it was trained on (``data.dataset`` in
    trainer_state.json): its fingerprint, the corpus digest and the tokenizer's vocabulary digest
    (``tokenizer.vocabulary_sha256``); a resume compares them (data/checks.py)."""
    if data_dir is None:
        return {}
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    vocabulary = meta.get("vocabulary_sha256")
    if vocabulary is None and (Path(data_dir) / "tokenizer.json").is_file():  # written before it was kept
        vocabulary = vocabulary_sha256(Tokenizer.from_file(str(Path(data_dir) / "tokenizer.json")))
    return {
        "dir": str(data_dir),
        "fingerprint": meta.get("fingerprint"),
        "corpus_sha256": (meta.get("inputs") or {}).get("corpus_sha256"),
        "vocabulary_sha256": vocabulary,
    }


class Checkpointing:
    """One rank's checkpointing for a run (every method is collective unless it says otherwise).

    Args:
        cfg: the validated run config.
        run_dir: the run directory (``checkpoint.dir`` defaults to ``<run_dir>/checkpoints``).
        resolved: the resolved config as plain data (stored, hashed and compared on resume).
        model: the run's model.
        data_dir: the prepared dataset, whose tokenizer every checkpoint carries (None: no tokenizer).
        tokenizer_dir: the tokenizer directory the run uses (``data.tokenizer``, or ``model.init_from``'s
            by default; see ``nodetrain.data.checks.run_data_config``): its special tokens and chat template.
        ckpt_dir: where checkpoints are read and written (default ``checkpoint.dir``, else
            ``<run_dir>/checkpoints``; outputs.py finds another run's for ``resume=auto``).
        resume_path: the checkpoint to resume (:func:`choose_resume` on rank 0, the same on every
            rank), or None for a fresh start or import.
        stop: called while a save is waited for: True = a signal asked the run to stop (logged).
        batch: the run's batch (``config/batch.py``, recorded as the data cursor's sequences per
            step); default ``cfg``'s on one node.

    Raises:
        CheckpointError: the checkpoint to resume does not fit this model, or its state was edited.
        ValueError: ``model.init_from`` cannot initialise this model (every problem listed).
    """

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        resolved: dict[str, Any],
        model: HFModel,
        data_dir: Path | None = None,
        tokenizer_dir: str = "",
        ckpt_dir: Path | None = None,
        resume_path: str | None = None,
        stop=None,
        batch: BatchShape | None = None,
    ):
        self.cfg, self.model, self.resolved, self.run_dir = cfg, model, resolved, Path(run_dir)
        self.batch = batch or BatchShape.of(cfg)
        self.data_dir, self.tokenizer_dir = data_dir, tokenizer_dir
        c = cfg.checkpoint
        self.dir = Path(c.dir).expanduser() if c.dir else self.run_dir / "checkpoints"
        self.dir = Path(ckpt_dir) if ckpt_dir is not None else self.dir
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._dataset = dataset_identity(data_dir) if self.rank == 0 else {}  # in trainer_state (rank 0)
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.dist.timeout_s))
        self.stop = stop
        self.path, self.state = self._resumed(resume_path)
        self.start_step = int(self.state["step"]) if self.state else 0
        self._hf_index = None
        self._nonfinite: list[str] = []  # imported tensors holding NaN/inf, this rank's (check_import)
        if self.path is None and cfg.model.init_from:
            overrides = set(cfg.model.hf_override)
            self._hf_index = check_model_dir(cfg.model.init_from, model, overrides)  # headers only
        elif self.path is not None and cfg.model.init_from:
            log.info("resuming from %s: model.init_from=%s is not read", self.path, cfg.model.init_from)
        self.writer: CheckpointWriter | None = None
        self._stage_blocks: list[range] = []
        self._wait_optimizer = lambda: None  # the engine's, from attach to close
        self.wandb_run_id: str | None = self.state.get("wandb_run_id") if self.state else None
        """The wandb run this training continues (kept in ``trainer_state.json``; set by the caller)."""
        self.metrics_rows: list[dict] = list(self.state.get("metrics_rows", [])) if self.state else []
        """``metrics.jsonl`` rows a save carries in ``trainer_state.json`` (set by the caller before each
        step's ``after_step``: ``MetricsLogger.rows_to_carry``); on resume, the checkpoint's."""

    def _resumed(self, resume_path: str | None) -> tuple[Path | None, dict | None]:
        if resume_path is None:
            return None, None
        path = Path(resume_path)
        state = st.read_state(path)  # every rank reads it: every read checks its digest
        check_training_state(path, state, self.model.units, self.cfg.optim.state, self.model)  # headers only
        if self.rank == 0:
            self._report(path, state)
        return path, state

    def _report(self, path: Path, state: dict) -> None:
        log.info(
            "resuming from %s (step %d, written on %d stages)", path, state["step"], len(state["stages"])
        )
        for diff in st.config_differences(state["config"], self.resolved):
            log.warning("config differs from the checkpoint's: %s", diff)
        newer = [p.name for s, p in st.complete_checkpoints(self.dir) if s > state["step"]]
        if newer:
            log.warning(
                "%s holds newer checkpoints %s than the one resumed from: this run starts a new branch "
                "from %s; it replaces them as it reaches their steps, checkpoint.keep_last prunes only "
                "this branch, and once it has saved, checkpoint.resume=auto continues this branch",
                self.dir,
                newer,
                path.name,
            )

    def init_fn(self):
        """The ``init_from`` callable for ``Engine``: checkpoint state, HF weights, or None (random)."""
        if self.path is not None:
            load = training_state_loader(self.path, self.state, self.cfg.optim.state, self.model)
            if not any(self.model.constants):
                return load
            path = self.path

            def load_with_constants(store, units):  # the router's bias is in the model shards only
                load(store, units)
                load_constants(read_index(path, "model"), self.model, units)

            return load_with_constants
        if self._hf_index is not None:

            def load(store, units) -> None:
                self._nonfinite += load_units(self._hf_index, store, units, model=self.model)

            return load
        return None

    def check_import(self) -> None:
        """After the engine filled the store (collective): refuse imported weights holding NaN/inf.

        Raises:
            CheckpointError: on every rank, naming every such tensor of every rank.
        """
        if self._hf_index is None:
            return
        found = sorted({n for part in all_gather_json(self._nonfinite, self.group) for n in part})
        if found:
            raise st.CheckpointError(
                f"model.init_from={self.cfg.model.init_from}: {len(found)} tensor(s) hold NaN or inf, so "
                "training would start from (and save) non-finite weights:\n  " + "\n  ".join(found) + "\n"
                "fix: use an intact copy of the weights (re-download or re-export them)"
            )

    def attach(self, engine) -> int:
        """Bind to the built engine; on resume restore AdamW's update counts and the RNG states, on
        a fresh start seed the RNGs from (seed, rank). Call right before anything draws random
        numbers (the first evaluation or step). Returns the first step to run (0-based)."""
        self._stage_blocks = engine.run.stage_blocks
        # overlapped AdamW (overlap.py): a save reads the store only after every update is done
        self._wait_optimizer = engine.wait_optimizer
        self.writer = CheckpointWriter(
            self.dir,
            self.cfg.checkpoint,
            self.model,
            engine.store,
            engine.units if engine.topo.replica == 0 else [],  # replicas hold the same weights: one writes
            engine.optimizer,
            self.group,
            tokenizer=run_tokenizer(self.data_dir, self.tokenizer_dir)
            if self.rank == 0 and self.data_dir is not None
            else None,
            source_dir=self.cfg.model.init_from,
            stop=self.stop,
            parent=st.identity(self.path, self.state) if self.path is not None else None,
            before_write=engine.faults.before_write,
        )
        if self.path is not None:
            restore_steps(self.path, engine.optimizer, engine.units)
            restore_rng(self.state, self.rank, self.world, self.cfg.seed, self.model.has_dropout)
            self.writer.last_saved = self.start_step
        else:
            seed_rng(self.cfg.seed, 0, self.rank)
        if self.start_step >= self.cfg.train.steps:
            log.info(
                "the checkpoint is at step %d of train.steps=%d: nothing to run",
                self.start_step,
                self.cfg.train.steps,
            )
        return self.start_step

    def after_step(self, step: int, save: bool = False) -> tuple[bool, float | None]:
        """Save if ``step`` (completed optimizer steps) is due or ``save`` asks for it (the run stops
        on a signal with ``checkpoint.on_signal=save``), and ``checkpoint.enable``; else commit a
        finished save.

        Returns:
            (stop: this launch ends here, ``checkpoint.stop_after_steps``;
             seconds training waited for a save started now, or None).
        """
        c = self.cfg.checkpoint
        stop = bool(c.stop_after_steps) and step - self.start_step >= c.stop_after_steps
        due = save or stop or step == self.cfg.train.steps or (c.every > 0 and step % c.every == 0)
        if not (due and c.enable):
            self.writer.poll()
            return stop and step < self.cfg.train.steps, None
        self._wait_optimizer()
        return stop and step < self.cfg.train.steps, self.writer.save(step, self._run_state(step))

    def close(self, ok: bool = True) -> None:
        """Wait for the save in flight and commit it (``ok``); after an error only wait for it. Lets go
        of the engine (its optimizer's wait)."""
        if self.writer is not None:
            self.writer.close(ok)
        self._wait_optimizer = lambda: None

    def _run_state(self, step: int) -> dict[str, Any]:
        o, t = self.cfg.optim, self.cfg.train
        sequences = self.batch.sequences_per_step
        units = self.model.units
        return {
            "step": step,
            "lr_schedule": {
                "kind": "linear_warmup_cosine",
                "lr": o.lr,
                "min_lr": o.min_lr,
                "warmup_steps": o.warmup_steps,
                "total_steps": t.steps,
                "last_lr": lr_at(step - 1, o, t.steps),
                "next_lr": lr_at(step, o, t.steps),
            },
            "data": {
                "seed": self.cfg.seed,
                "next_batch_index": step,
                "sequences_per_step": sequences,
                "sequences_seen": step * sequences,
                "seq_len": t.seq_len,
                "dataset": self._dataset,
            },
            "config": self.resolved,
            "config_hash": st.config_hash(self.resolved),
            "run_dir": str(self.run_dir),  # named when another run would overwrite this one (outputs.py)
            "stages": [
                {
                    "stage": s,
                    "units": [b.start, b.stop],
                    "names": [units[b.start].name, units[b.stop - 1].name],
                }
                for s, b in enumerate(self._stage_blocks)
            ],
            "num_units": len(units),
            "export_dtype": self.cfg.checkpoint.export_dtype,
            "optim_state": self.cfg.optim.state,
            "weights": {"model": "model", "master": self.writer.master_prefix, "optimizer": "optimizer"},
            "wandb_run_id": self.wandb_run_id,
            "metrics_rows": self.metrics_rows,
        }
