"""safetensors files read by byte range, straight into flat fp32 buffers, with no mmap and no pickle.

Owns: parsing a safetensors header (8-byte little-endian header length, then a JSON header of
``name -> {dtype, shape, data_offsets}``, then the raw little-endian data; the format is
https://github.com/huggingface/safetensors#format), mapping names to files through a HF index
(``<prefix>.safetensors.index.json``), and reading one tensor into a destination buffer. Does not
own: what the tensors mean (hf_import.py, resume.py) or writing (``safetensors.torch.save_file``
in writer.py).

Why not ``safetensors.safe_open``: it maps the whole file, and every page a read touches counts in
the process's RSS until the file is closed, so reading a 5 GB shard for one layer costs 5 GB of
RSS. Here a tensor of the destination dtype is read with ``readinto`` directly into its place in
the host store (no copy at all), and any other float dtype is converted through one reusable
buffer of at most ``CHUNK_BYTES``: the extra memory is a fixed overhead (``bench/import_memory.py``
measures it).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CHUNK_BYTES", "ST_DTYPES", "TensorEntry", "read_header", "read_index", "read_into"]

CHUNK_BYTES = 32 << 20
"""Largest conversion buffer (bytes) used when a file's dtype differs from the destination's."""
_MAX_HEADER_BYTES = 100 << 20  # the format's own limit

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype codes this reader understands."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: ``file[start:end]`` (absolute byte offsets)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size.

    Raises:
        ValueError: the file is not safetensors, its header is corrupt, a tensor's byte range does
            not match its dtype and shape, or the file is shorter than its header says (truncated).
            The message names the file.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"{path}: header of {n} bytes does not fit in the {size}-byte file (truncated?)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from e
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = ST_DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"])
            lo, hi = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name!r} has an unreadable header entry {info!r}") from e
        if hi - lo != math.prod(shape) * dtype.itemsize or lo < 0:
            raise ValueError(f"{path}: tensor {name!r} spans {hi - lo} bytes, not {dtype} × {shape}")
        if base + hi > size:
            raise ValueError(
                f"{path}: tensor {name!r} ends at byte {base + hi} but the file has {size} bytes (truncated)"
            )
        out[name] = TensorEntry(name, path, dtype, shape, base + lo, base + hi)
    return out


def read_index(directory: str | Path, prefix: str = "model") -> dict[str, TensorEntry]:
    """Every tensor of a HF-style weight set: ``<prefix>.safetensors.index.json`` (sharded) or a
    single ``<prefix>.safetensors``.

    Raises:
        FileNotFoundError: neither file exists, or the index names a missing file.
        ValueError: as ``read_header``; or the index maps a name to a file that lacks it.
    """
    directory = Path(directory).expanduser()
    index = directory / f"{prefix}.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / f"{prefix}.safetensors").is_file():
        weight_map, files = None, [f"{prefix}.safetensors"]
    else:
        raise FileNotFoundError(
            f"{directory} holds no {prefix}.safetensors nor {prefix}.safetensors.index.json; "
            "point it at a save_pretrained() directory"
        )
    found: dict[str, TensorEntry] = {}
    for file in files:
        if not (directory / file).is_file():
            raise FileNotFoundError(f"{index} names {file}, which is missing from {directory}")
        found.update(read_header(directory / file))
    if weight_map is None:
        return found
    # The index is authoritative (as for transformers): exactly its names, each from the file it names.
    wrong = sorted(n for n, f in weight_map.items() if n not in found or found[n].file.name != Path(f).name)
    if wrong:
        raise ValueError(f"{index}: {len(wrong)} tensor(s) not in the file it names, e.g. {wrong[:5]}")
    return {n: found[n] for n in weight_map}


def read_into(entry: TensorEntry, out: torch.Tensor) -> None:
    """Read ``entry`` into ``out``, converting its dtype on the way.

    Args:
        entry: the tensor to read (``entry.numel`` elements).
        out: [entry.numel] contiguous CPU destination (e.g. a slice of the host store's fp32
            master weights); any floating dtype.

    Raises:
        ValueError: ``out`` has the wrong size, or a float destination would receive integers.
        OSError: the file ends early.
    """
    if out.numel() != entry.numel or not out.is_contiguous():
        raise ValueError(f"{entry.file}: {entry.name} has {entry.numel} elements, destination {out.numel()}")
    if out.is_floating_point() and not entry.dtype.is_floating_point:
        raise ValueError(f"{entry.file}: {entry.name} is {entry.dtype}, a float tensor is needed")
    with entry.file.open("rb", buffering=0) as f:
        f.seek(entry.start)
        if entry.dtype == out.dtype:
            _readinto(f, out.view(torch.uint8).numpy(), entry)
            return
        per_chunk = max(1, CHUNK_BYTES // entry.dtype.itemsize)
        buf = torch.empty(min(per_chunk, entry.numel), dtype=entry.dtype)
        for lo in range(0, entry.numel, per_chunk):
            hi = min(lo + per_chunk, entry.numel)
            _readinto(f, buf[: hi - lo].view(torch.uint8).numpy(), entry)
            out[lo:hi].copy_(buf[: hi - lo])


def _readinto(f, dst, entry: TensorEntry) -> None:
    view, pos = memoryview(dst).cast("B"), 0
    while pos < len(view):
        n = f.readinto(view[pos:])
        if not n:
            raise OSError(f"{entry.file}: ends inside tensor {entry.name} (truncated)")
        pos += n
