"""The JSON half of a checkpoint: ``trainer_state.json``, RNG states, file manifests, verification.

Owns: the names of a checkpoint's files, the trainer state's schema (step, learning-rate schedule,
every rank's RNG states, data cursor, config and its hash, stage layout, wandb run id, manifest of
every file with its size and sha256), encoding RNG states as JSON-safe values (never pickle),
and verifying a checkpoint directory against its manifest. Does not own: writing tensors
(writer.py) or reading them into the store (resume.py).

A directory ``step-N`` is complete exactly when its ``trainer_state.json`` exists: the writer
renames the directory into place only after every other file and that one are written and fsynced.
"""

from __future__ import annotations

import base64
import hashlib
import json
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
    "verify",
]

FORMAT_VERSION = 1
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Keys that do not change the arithmetic of a run: left out of the config hash and not reported as
# differences on resume (a resume may change the stage count, the store path, logging ...).
_VOLATILE = ("checkpoint", "logging", "store", "stream", "pipeline.stages", "data.dir", "train.eval_every")


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
    store.*, stream.*, pipeline.stages ...), as canonical JSON."""
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


def read_state(ckpt: Path) -> dict[str, Any]:
    """Parse ``trainer_state.json``.

    Raises:
        CheckpointError: it is missing, unreadable, or of another format version.
    """
    path = ckpt / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: missing or unreadable ({e}); the checkpoint is incomplete") from e
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {state.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    return state


def verify(ckpt: str | Path, threads: int = 4) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest (size, then sha256).

    Args:
        ckpt: a ``step-N`` directory.
        threads: files hashed in parallel.

    Returns:
        The parsed trainer state.

    Raises:
        CheckpointError: ``trainer_state.json`` is missing or unreadable, or a file is missing,
            has the wrong size (truncated) or the wrong checksum; the message names the file.
    """
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    files = state["files"]
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
