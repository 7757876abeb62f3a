"""The JSON half of a checkpoint: ``trainer_state.json``, RNG states, file manifests, verification.

Owns: the names of a checkpoint's files, the trainer state's schema (step, learning-rate schedule,
every rank's RNG states, data cursor, config and its hash, stage layout, wandb run id, manifest of
every file with its size and sha256, the checkpoint's place in its chain), encoding RNG states as
JSON-safe values (never pickle), and verifying a checkpoint directory: ``trainer_state.json``
carries the sha256 of its own canonical JSON (:data:`STATE_DIGEST`), checked by every read, and its
manifest covers every other file. Does not own: writing tensors (writer.py) or reading them into the
store (resume.py).

A directory ``step-N`` is complete exactly when its ``trainer_state.json`` exists: the writer
renames the directory into place only after every other file and that one are written and fsynced.

Chains: each checkpoint names its ``parent`` (the checkpoint the run that wrote it had resumed from
or saved before it: ``{"name": "step-N", "sha256": <its state digest>}``) and a ``sequence``, one more
than the highest in its directory when it was committed. Resuming an older step starts a new branch;
the newest ``sequence`` is the head of the chain the last run was on (``resume.choose_checkpoint``),
and ``checkpoint.keep_last`` prunes along that chain only (writer.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "FORMAT_VERSION",
    "STATE_DIGEST",
    "TRAINER_STATE",
    "CheckpointError",
    "lean_key",
    "step_dir_name",
    "complete_checkpoints",
    "shard_name",
    "fsync_dir",
    "write_json",
    "file_record",
    "rng_state",
    "set_rng_state",
    "config_hash",
    "config_differences",
    "read_state",
    "write_state",
    "identity",
    "chain",
    "verify",
    "verify_import",
]

FORMAT_VERSION = 2
"""2: trainer_state.json carries :data:`STATE_DIGEST`, ``parent`` and ``sequence``; 1 (read, with a
warning that it is not verified) had neither."""
TRAINER_STATE = "trainer_state.json"
STATE_DIGEST = "state_sha256"
"""Key of trainer_state.json holding the sha256 of its other keys' canonical JSON (:func:`_digest`)."""
_MODEL_ONLY = ("master", "optimizer")
"""Name prefixes of the files a resume reads and an import (``model.init_from``) does not."""
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Keys that do not change the arithmetic of a run: left out of the config hash and not reported as
# differences on resume (a resume may change the stage count, the wave, the store path, logging ...;
# stages and waves change only the order of fp32 sums, as stream.* placements do).
_VOLATILE = (
    "checkpoint",
    "logging",
    "store",
    "stream",
    "pipeline.stages",
    "pipeline.wave",
    "data.dir",
    "train.eval_every",
)


log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete or corrupted; the message names the file."""


def lean_key(unit, field: str) -> str:
    """Checkpoint tensor name of a lean store's moment ``field`` of ``unit`` (its flat codes or block
    scales; blocks span the unit's HF tensors, so they are saved per unit, not per tensor)."""
    return f"nodetrain.lean.{unit.name}.{field}"


def step_dir_name(step: int) -> str:
    return f"step-{step}"


def shard_name(kind: str, unit: int, num_units: int) -> str:
    """File of unit ``unit`` (0-based) of a ``kind`` (model, master, optimizer), as HF names shards."""
    return f"{kind}-{unit + 1:05d}-of-{num_units:05d}.safetensors"


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-N`` directory holding a ``trainer_state.json``, oldest first."""
    directory, found = Path(directory), []
    if directory.is_dir():
        for p in directory.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / TRAINER_STATE).is_file():
                found.append((int(m[1]), p))
    return sorted(found)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON and fsync it."""
    with path.open("w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)  # hashlib releases the GIL for large updates: threads hash in parallel
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of a file (read back from the page cache after writing)."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


# ----------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-safe values: torch CPU and every CUDA device (base64 of
    their byte states), Python's ``random`` and numpy's global generator."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {
        "torch_cpu": _b64(torch.get_rng_state()),
        "torch_cuda": cuda,
        "python": [version, list(words), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA states only where this process has CUDA)."""
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if torch.cuda.is_available() and state["torch_cuda"]:
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["torch_cuda"]])
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ----------------------------------------------------------------------------- config


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _relevant(resolved: dict) -> dict[str, Any]:
    flat = _flatten(resolved)
    return {k: v for k, v in flat.items() if not any(k == p or k.startswith(p + ".") for p in _VOLATILE)}


def config_hash(resolved: dict) -> str:
    """sha256 of the resolved config's keys that change the arithmetic (not checkpoint.*, logging.*,
    store.*, stream.*, pipeline.stages, pipeline.wave ...), as canonical JSON."""
    text = json.dumps(_relevant(resolved), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def config_differences(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for each arithmetic-relevant key that differs."""
    a, b = _relevant(saved), _relevant(current)
    return [
        f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


# ----------------------------------------------------------------------------- verification


def _digest(state: dict[str, Any]) -> str:
    """sha256 of ``state`` without :data:`STATE_DIGEST`, as canonical JSON (sorted keys, no spaces):
    JSON numbers round-trip exactly, so the digest of a parsed file is the digest it was written with."""
    body = {k: v for k, v in state.items() if k != STATE_DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def write_state(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Write ``state`` as trainer_state.json with its own digest (:data:`STATE_DIGEST`), fsynced.

    Returns:
        The state as written (with ``format_version`` and the digest).
    """
    sealed = {**state, "format_version": FORMAT_VERSION}
    sealed[STATE_DIGEST] = _digest(sealed)
    write_json(path, sealed)
    return sealed


def identity(ckpt: Path, state: dict[str, Any]) -> dict[str, str]:
    """``{"name": "step-N", "sha256": state digest}``: what a child checkpoint names as its ``parent``
    (the digest tells a step-N of one branch from the step-N of another)."""
    return {"name": Path(ckpt).name, "sha256": state.get(STATE_DIGEST) or _digest(state)}


def chain(states: dict[Path, dict[str, Any]], head: Path) -> list[Path]:
    """``head`` and its ancestors found in ``states`` (checkpoint -> its parsed trainer state), newest
    first: each step follows ``parent`` to the checkpoint of that name whose digest matches."""
    by_id = {(p.name, identity(p, s)["sha256"]): p for p, s in states.items()}
    found, path = [], head
    while path is not None and path not in found:
        found.append(path)
        parent = states[path].get("parent") or {}
        path = by_id.get((parent.get("name"), parent.get("sha256")))
    return found


def read_state(ckpt: Path) -> dict[str, Any]:
    """Parse ``trainer_state.json`` and check its digest (:data:`STATE_DIGEST`).

    Raises:
        CheckpointError: it is missing, unreadable, of another format version, or its digest does
            not match its contents (edited or corrupted).
    """
    path = ckpt / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: missing or unreadable ({e}); the checkpoint is incomplete") from e
    version = state.get("format_version") if isinstance(state, dict) else None
    if version not in (1, FORMAT_VERSION):
        raise CheckpointError(f"{path}: format_version {version!r}, expected {FORMAT_VERSION}")
    if version == 1:
        log.warning("%s: written before trainer_state.json carried its own digest; it is not verified", path)
        return state
    if state.get(STATE_DIGEST) != _digest(state):
        raise CheckpointError(
            f"{path}: its contents do not match its {STATE_DIGEST} (edited or corrupted: step, RNG, "
            "data cursor and manifest cannot be trusted); resume another step-N, or use auto to fall "
            "back to the previous one"
        )
    return state


def verify(ckpt: str | Path, threads: int = 4, only=None) -> dict[str, Any]:
    """Check a checkpoint: ``trainer_state.json`` against its own digest, then every file of its
    manifest (size, then sha256).

    Args:
        ckpt: a ``step-N`` directory.
        threads: files hashed in parallel.
        only: when given, a predicate on file names: only those files are checked (an import reads
            no master or optimizer files, :func:`verify_import`).

    Returns:
        The parsed trainer state.

    Raises:
        CheckpointError: ``trainer_state.json`` is missing, unreadable or edited, or a file is
            missing, has the wrong size (truncated) or the wrong checksum; the message names the file.
    """
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    files = {n: r for n, r in state["files"].items() if only is None or only(n)}
    for name, rec in files.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(
                f"{path}: missing (listed in {TRAINER_STATE}); the checkpoint is incomplete"
            )
        if path.stat().st_size != rec["size"]:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes, the manifest says {rec['size']} "
                "(truncated or overwritten)"
            )
    with ThreadPoolExecutor(max(1, threads)) as pool:
        digests = dict(zip(files, pool.map(lambda n: _sha256(ckpt / n), files), strict=True))
    for name, rec in files.items():
        if digests[name] != rec["sha256"]:
            raise CheckpointError(
                f"{ckpt / name}: sha256 {digests[name][:16]}… differs from the manifest (corrupted)"
            )
    return state


def verify_import(model_dir: str | Path) -> bool:
    """Verify a ``model.init_from`` directory that is a nodetrain checkpoint (it holds
    ``trainer_state.json``): its digest, and the manifest's sha256 of every file an import reads
    (config, tokenizer, model shards and index; not ``master-*``/``optimizer-*``). A plain Hugging
    Face directory carries no manifest: nothing to check.

    Returns:
        Whether the directory was a checkpoint (and so was verified).

    Raises:
        CheckpointError: as :func:`verify`, prefixed with ``model.init_from=``.
    """
    model_dir = Path(model_dir).expanduser()
    if not (model_dir / TRAINER_STATE).is_file():
        return False
    try:
        verify(model_dir, only=lambda name: not name.startswith(_MODEL_ONLY))
    except CheckpointError as e:
        raise CheckpointError(f"model.init_from={model_dir}: {e}") from e
    log.info("model.init_from=%s: a nodetrain checkpoint, verified against its manifest", model_dir)
    return True
