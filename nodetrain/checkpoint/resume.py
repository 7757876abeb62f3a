"""Resuming: pick a checkpoint, verify it, and load it into this rank's units whatever the stage count.

Owns: choosing what ``checkpoint.resume`` names (``auto``: the newest complete checkpoint that
verifies, falling back to older ones with a warning), reading fp32 master weights, ``exp_avg`` and
``exp_avg_sq`` by HF tensor name into the units this rank owns (names, not stage layouts, are
stored, so any stage count can load any checkpoint), restoring AdamW's update counts, and the RNG
states. Does not own: verification itself (state.py) or reading bytes (tensors.py).

Exactness: everything a step reads is restored bit for bit — master weights (the compute copy is
rebuilt from them, as after every optimizer step), both moments, the fp32 update count, the RNG
of every rank, and the step, from which the learning rate and the batch are pure functions.
"""

from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nodetrain.checkpoint import state as st
from nodetrain.checkpoint.hf_layout import import_pieces
from nodetrain.checkpoint.state import lean_key
from nodetrain.checkpoint.tensors import TensorEntry, read_index, read_into
from nodetrain.model import HFModel, Unit
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.store import LEAN_MOMENT_FIELDS, HostStore, StoreLayout

__all__ = [
    "choose_checkpoint",
    "check_training_state",
    "load_training_state",
    "load_lean_state",
    "training_state_loader",
    "restore_steps",
    "restore_rng",
    "seed_rng",
]

log = logging.getLogger(__name__)


def choose_checkpoint(resume: str, directory: Path) -> Path | None:
    """The checkpoint to resume from, verified (its trainer state's digest, sizes and sha256 of every
    file).

    ``auto`` takes the head of the chain the last run was on: the checkpoint committed last (highest
    ``sequence``, state.py; then the highest step), so a run that resumed an older step and saved
    continues on its own branch, not on the abandoned newer steps. A head that fails verification
    falls back to its parent, then to the others, newest first, with a warning.

    Args:
        resume: ``checkpoint.resume``: empty (none), ``auto``, or a ``step-N`` path.
        directory: ``checkpoint.dir`` (searched by ``auto``).

    Returns:
        The verified checkpoint directory, or None for a fresh start (``resume`` empty, or
        ``auto`` and no complete checkpoint in ``directory``).

    Raises:
        CheckpointError: an explicit path that is incomplete or corrupted (naming the file), or
            ``auto`` when every complete checkpoint is corrupted.
    """
    if not resume:
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        try:
            st.verify(path)
        except st.CheckpointError as e:
            raise st.CheckpointError(
                f"checkpoint.resume={resume}: {e}; pick another step-N or use auto"
            ) from e
        return path
    complete = st.complete_checkpoints(directory)
    if not complete:
        log.info("checkpoint.resume=auto: no complete checkpoint in %s, starting from scratch", directory)
        return None
    errors, states = [], {}
    for _, path in complete[::-1]:
        try:
            states[path] = st.read_state(path)
        except st.CheckpointError as e:
            errors.append(str(e))
            log.warning("checkpoint.resume=auto: refusing %s: %s; falling back to the previous one", path, e)
    for path in _auto_order(states, dict((p, s) for s, p in complete)):
        try:
            st.verify(path)
        except st.CheckpointError as e:
            errors.append(str(e))
            log.warning("checkpoint.resume=auto: refusing %s: %s; falling back to the previous one", path, e)
            continue
        return path
    raise st.CheckpointError(
        f"checkpoint.resume=auto: every checkpoint in {directory} is corrupted:\n  " + "\n  ".join(errors)
    )


def _auto_order(states: dict[Path, dict[str, Any]], steps: dict[Path, int]) -> list[Path]:
    """The head (highest ``sequence``, then step), its ancestors, then every other checkpoint."""
    newest = sorted(states, key=lambda p: (states[p].get("sequence", 0), steps[p]), reverse=True)
    if not newest:
        return []
    on_chain = st.chain(states, newest[0])
    return on_chain + [p for p in newest if p not in on_chain]


def _entries(
    index: dict[str, TensorEntry], ckpt: Path, names: list[tuple[str, tuple[int, ...]]]
) -> list[str]:
    problems = []
    for name, shape in names:
        if name not in index:
            problems.append(f"missing tensor {name}")
        elif index[name].shape != shape:
            problems.append(
                f"{name}: shape {index[name].shape} in {index[name].file.name}, the model needs {shape}"
            )
    return problems


def check_training_state(
    ckpt: Path,
    state: dict[str, Any],
    units: list[Unit],
    optim_state: str = "full",
    model: HFModel | None = None,
) -> tuple[dict[str, TensorEntry], dict[str, TensorEntry]]:
    """Check, from the file headers alone, that a checkpoint holds every tensor of ``units`` (the
    whole model, before the store is allocated) with the right shape, and that its optimizer state
    (``optim_state`` in trainer_state.json, ``full`` when absent) can become this run's. The master
    weights are read by parameter name (``master-*``), or, where the export is them (an fp32 export;
    a lean checkpoint's bf16 one), in transformers' saved layout, experts one per expert
    (``hf_layout.import_pieces`` with ``model``).

    ``full`` → ``lean`` is allowed (the fp32 state is rounded and quantized, logged); ``lean`` →
    ``full`` is refused: the fp32 master and moments were never kept.

    Returns:
        (master index, optimizer index): tensor name -> where its bytes are.

    Raises:
        CheckpointError: a tensor is missing or of another shape (the model changed since the
            checkpoint was written), all listed; or a lean checkpoint resumed with ``full``.
    """
    saved = state.get("optim_state", "full")
    if saved == "lean" and optim_state != "lean":
        raise st.CheckpointError(
            f"{ckpt} holds lean optimizer state (optim.state=lean: bf16 master weights, 4/8-bit "
            f"moments), and this run has optim.state={optim_state}, whose fp32 master and moments it "
            "never kept. Resume it with optim.state=lean, or start a full run from its weights with "
            f"model.init_from={ckpt} (HF export; fresh AdamW moments and step count)"
        )
    master = read_index(ckpt, state["weights"]["master"])
    opt = read_index(ckpt, "optimizer")
    params = [p for u in units for p in u.params]
    problems = _entries(
        master, ckpt, [(q.name, q.shape) for p in params for q in import_pieces(model, p, master)]
    )
    if saved == "lean":
        layout = StoreLayout(tuple(u.numel for u in units), torch.bfloat16, state="lean")
        moments = [
            (lean_key(u, f), (layout.numel(i, f),)) for i, u in enumerate(units) for f in LEAN_MOMENT_FIELDS
        ]
    else:
        moments = [(f"{p.hf_name}.{f}", p.shape) for p in params for f in ("exp_avg", "exp_avg_sq")]
    problems += _entries(opt, ckpt, moments + [(f"{p.hf_name}.step", ()) for p in params])
    if problems:
        raise st.CheckpointError(
            f"{ckpt} does not fit this model (set the model it was written with):\n  " + "\n  ".join(problems)
        )
    return master, opt


def _read_master(master: dict[str, TensorEntry], model: HFModel | None, p, buf) -> None:
    """``p``'s master weights from its pieces (check_training_state) into ``buf`` (its unit's field)."""
    for q in import_pieces(model, p, master):
        read_into(master[q.name], buf[p.offset + q.offset : p.offset + q.offset + q.numel])


def load_training_state(
    ckpt: Path, state: dict[str, Any], store: HostStore, units: list[Unit], model: HFModel | None = None
) -> None:
    """Fill fp32 master weights, ``exp_avg`` and ``exp_avg_sq`` of ``units`` from a ``full`` checkpoint
    (into a ``full`` store, or a optim.lean.FullScratch that is then quantized); ``model``: the run's,
    so that master weights exported one tensor per expert are found (:func:`check_training_state`).

    Raises:
        CheckpointError: as :func:`check_training_state`.
    """
    master, opt = check_training_state(ckpt, state, units, model=model)
    for u in units:
        for p in u.params:
            _read_master(master, model, p, store.buffer(u.index, "master"))
        for field in ("exp_avg", "exp_avg_sq"):
            buf = store.buffer(u.index, field)
            for p in u.params:
                read_into(opt[f"{p.hf_name}.{field}"], buf[p.offset : p.offset + p.numel])


def load_lean_state(
    ckpt: Path, state: dict[str, Any], store: HostStore, units: list[Unit], model: HFModel | None = None
) -> None:
    """Fill a lean store's bf16 master weights and quantized moments of ``units`` from a lean
    checkpoint, byte for byte (``model``: as :func:`load_training_state`).

    Raises:
        CheckpointError: as :func:`check_training_state`.
    """
    master, opt = check_training_state(ckpt, state, units, "lean", model)
    for u in units:
        for p in u.params:
            _read_master(master, model, p, store.buffer(u.index, "compute"))
        for f in LEAN_MOMENT_FIELDS:
            read_into(opt[lean_key(u, f)], store.buffer(u.index, f))


def training_state_loader(ckpt: Path, state: dict[str, Any], optim_state: str, model: HFModel | None = None):
    """The ``init_from`` callable of a resume: ``(store, units) -> None``. A lean checkpoint into a lean
    run loads bytes (``lean_loader``); a full one into a lean run is quantized unit by unit (logged).
    ``model``: the run's (master weights exported one tensor per expert, :func:`check_training_state`)."""
    if state.get("optim_state", "full") == "lean":
        fn = lambda store, units: load_lean_state(ckpt, state, store, units, model)  # noqa: E731
        fn.lean_loader = True
        return fn
    if optim_state == "lean":
        log.warning(
            "resuming the full checkpoint %s with optim.state=lean: master weights are rounded to bf16 "
            "and exp_avg / exp_avg_sq quantized to 4 / 8 bits (optim/lean.py)",
            ckpt,
        )
    return lambda store, units: load_training_state(ckpt, state, store, units, model)


def restore_steps(ckpt: Path, optimizer: StoreAdamW, units: list[Unit]) -> None:
    """Restore AdamW's per-tensor update counts (fp32 scalars ``<name>.step``) of ``units``.

    Raises:
        CheckpointError: a count is missing or the counts of one parameter disagree.
    """
    opt = read_index(ckpt, "optimizer")
    steps = {}
    for p in (p for u in units for p in u.params):
        entry = opt.get(p.hf_name + ".step")
        if entry is None:
            raise st.CheckpointError(f"{ckpt}: missing tensor {p.hf_name}.step (AdamW update count)")
        one = torch.empty(1, dtype=torch.float32)
        read_into(entry, one)
        steps[p.hf_name] = float(one)
    try:
        optimizer.load_steps(steps)
    except ValueError as e:
        raise st.CheckpointError(f"{ckpt}: {e}") from e


def seed_rng(seed: int, step: int, rank: int) -> None:
    """Seed this rank's torch (CPU and CUDA), Python and numpy generators from (seed, step, rank).

    A fresh run calls it with step 0 before anything draws (dropout in training; evaluation runs in
    eval mode and draws nothing): torch seeds its default generator nondeterministically per
    process, so without this two runs of one config would draw different dropout masks.
    """
    digest = hashlib.sha256(f"nodetrain.rng:{seed}:{step}:{rank}".encode()).digest()
    s = int.from_bytes(digest[:8], "little") >> 1
    torch.manual_seed(s)  # also every CUDA device
    random.seed(s)
    np.random.seed(s % 2**32)


def restore_rng(state: dict[str, Any], rank: int, world_size: int, seed: int, dropout: bool) -> None:
    """Restore this rank's RNG states.

    Same stage count: rank r gets exactly the states rank r saved, so dropout masks continue as
    in an uninterrupted run. Different stage count: a rank's stream belonged to a different set
    of layers, so no saved state is right; every generator is seeded from (seed, step, rank)
    instead — never replaying a fresh run's stream — and, when the model has dropout, a warning
    says the masks (not the data, weights or schedule) differ from an uninterrupted run.
    """
    saved = state["rng"]
    if len(saved) == world_size:
        st.set_rng_state(saved[rank])
        return
    seed_rng(seed, state["step"], rank)
    if dropout:
        log.warning(
            "resuming on %d stages from a checkpoint written on %d: dropout masks are drawn from a "
            "fresh per-rank seed, so they differ from an uninterrupted run (everything else is exact)",
            world_size,
            len(saved),
        )
