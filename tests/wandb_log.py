"""Read an offline wandb run back from its ``run-<id>.wandb`` file (test helper, not a test).

The file is wandb's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks of LevelDB-log chunks (4-byte CRC, 2-byte length, 1-byte type: full / first /
middle / last), each record a ``wandb_internal_pb2.Record`` protobuf. The records are decoded with
wandb's own protobuf classes, so what is checked is what ``wandb sync`` would upload.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

__all__ = ["OfflineRun", "read_run"]

_HEADER = b":W&B\xe1\xbe\x00"
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    assert data[: len(_HEADER)] == _HEADER, f"not a wandb log: {data[:8]!r}"
    out, pending, pos = [], b"", len(_HEADER)
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
        elif kind == 0 and length == 0:
            break
    return out


@dataclass
class OfflineRun:
    """What an offline run recorded."""

    run_id: str = ""
    name: str = ""
    group: str = ""
    project: str = ""
    tags: list[str] = field(default_factory=list)
    notes: str = ""
    config: dict = field(default_factory=dict)
    """Top-level config keys, JSON-decoded."""
    history: list[dict] = field(default_factory=list)
    """One dict per ``log`` call, keys as logged (plus wandb's ``_step``, ``_runtime``, ...)."""
    exit_code: int | None = None
    """Set when the run was finished (its ``exit`` record); None for an incomplete run."""


def read_run(path: Path) -> OfflineRun:
    """Decode ``run-<id>.wandb``."""
    run = OfflineRun()
    for raw in _records(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.run_id, run.name, run.group, run.project = r.run_id, r.display_name, r.run_group, r.project
            run.tags, run.notes = list(r.tags), r.notes
            run.config.update({c.key: json.loads(c.value_json) for c in r.config.update})
        elif kind == "config":
            run.config.update({c.key: json.loads(c.value_json) for c in rec.config.update})
        elif kind == "history":
            run.history.append(
                {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
            )
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    return run
