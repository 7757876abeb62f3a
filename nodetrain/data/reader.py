"""Reading a prepared dataset: map a split read-only and sample deterministic, resumable batches from it.

Owns: :class:`TokenDataset` (``train.bin`` / ``val.bin`` checked against ``meta.json``), :func:`read_meta`
and :func:`batch`, the seeded epoch-by-epoch shuffle of non-overlapping windows. Does not own writing
a dataset (datasets.py), which rank reads which batch (the training loop passes ``index``),
torch.distributed, or moving tensors to a device.

Shapes: B = batch size (sequences), T = sequence length (tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["TokenDataset", "batch", "read_meta"]


def read_meta(directory: Path) -> dict | None:
    """meta.json of ``directory``, or None if it is missing or unreadable."""
    try:
        return json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class TokenDataset:
    """One split of a prepared dataset, mapped read-only.

    Attributes:
        path: the split's ``.bin`` file.
        tokens: [num_tokens] uint16 or uint32 read-only np.memmap, the flat token stream.
        vocab_size: every id is in ``[0, vocab_size)``.
        eot_id: the end-of-text id that separates documents.
        num_tokens: length of ``tokens``.
    """

    path: Path
    tokens: np.memmap
    vocab_size: int
    eot_id: int
    num_tokens: int

    @classmethod
    def open(cls, dir: str | Path, split: str) -> TokenDataset:
        """Map ``train.bin`` or ``val.bin`` of the dataset in ``dir`` and check it against meta.json.

        Args:
            dir: a directory written by ``prepare``.
            split: ``"train"`` or ``"val"``.

        Returns:
            The mapped split.

        Raises:
            FileNotFoundError: meta.json is missing or unreadable.
            ValueError: ``split`` is neither train nor val; the split file is missing, truncated or
                corrupt (its size disagrees with meta.json, or it holds an id >= vocab_size).
        """
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r} must be 'train' or 'val'")
        directory = Path(dir).expanduser()
        if (meta := read_meta(directory)) is None:
            raise FileNotFoundError(
                f"data.dir={str(directory)!r} holds no readable meta.json; fix: run prepare(cfg) or "
                f"`python -m nodetrain.data --dir {directory}` first"
            )
        path, dtype = directory / f"{split}.bin", np.dtype(meta["dtype"])
        num_tokens, vocab_size = int(meta[f"num_{split}_tokens"]), int(meta["vocab_size"])
        size_bytes = path.stat().st_size if path.is_file() else None
        if size_bytes != num_tokens * dtype.itemsize:
            raise ValueError(
                f"{path} holds {size_bytes} bytes but meta.json says {num_tokens} tokens x {dtype.itemsize} "
                f"bytes: it is missing, truncated or corrupt; fix: delete {directory} and run prepare again"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))
        if (max_id := int(np.max(tokens))) >= vocab_size:
            raise ValueError(
                f"{path} holds token id {max_id} >= vocab_size {vocab_size} from meta.json: it is corrupt; "
                f"fix: delete {directory} and run prepare again"
            )
        return cls(path, tokens, vocab_size, int(meta["eot_id"]), num_tokens)


def _epoch_seed(seed: int, epoch: int) -> int:
    # A stable hash (unlike hash(), independent of PYTHONHASHSEED and platform), < 2**63.
    digest = hashlib.sha256(f"nodetrain.data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, num_windows: int) -> np.ndarray:
    """[num_windows] int64, read-only: the window order of one epoch."""
    generator = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    order = torch.randperm(num_windows, generator=generator).numpy()
    order.flags.writeable = False  # cached: no caller may change it
    return order


def batch(
    ds: TokenDataset, seed: int, index: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``index``-th batch of a seeded, epoch-by-epoch shuffle; a pure function of its arguments.

    Windows are the non-overlapping slices ``[k*T, k*T + T + 1)`` of the stream, k in ``[0, W)`` with
    ``W = (num_tokens - 1) // T``. Sample ``c = index*B + b`` is window ``perm_e[c % W]`` of epoch
    ``e = c // W``, where ``perm_e`` is ``torch.randperm(W)`` seeded by a hash of ``(seed, e)``: consecutive
    indices walk an epoch without repeats, and each epoch is reshuffled. Targets follow nanoGPT:
    ``x = w[:-1]``, ``y = w[1:]``.

    Args:
        ds: the split to read.
        seed: the run seed.
        index: batch counter (the step, or ``step * grad_accum + k``), >= 0.
        batch_size: B, sequences per batch, >= 1.
        seq_len: T, tokens per sequence, >= 1.

    Returns:
        inputs: [B, T] int64 on CPU, token ids.
        labels: [B, T] int64 on CPU; ``labels[b, t]`` is the token after ``inputs[b, t]``.

    Raises:
        ValueError: the split has fewer than T + 1 tokens, or an argument is out of range.
    """
    if index < 0 or batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"batch: need index >= 0, batch_size >= 1, seq_len >= 1; got {index}, {batch_size}, {seq_len}"
        )
    num_windows = (ds.num_tokens - 1) // seq_len
    if num_windows < 1:
        raise ValueError(
            f"{ds.path} holds {ds.num_tokens} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; "
            "fix: a smaller train.seq_len or more data"
        )
    counters = index * batch_size + np.arange(batch_size, dtype=np.int64)  # (B,)
    epochs, positions = np.divmod(counters, num_windows)  # (B,), (B,)
    windows = np.empty(batch_size, dtype=np.int64)  # (B,)
    for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        windows[in_epoch] = _permutation(seed, int(epoch), num_windows)[positions[in_epoch]]
    offsets = windows[:, None] * seq_len + np.arange(seq_len + 1)  # (B, T+1)
    w = torch.from_numpy(ds.tokens[offsets].astype(np.int64))  # (B, T+1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T), (B, T)
