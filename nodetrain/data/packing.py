"""Document-aware packing: tokenized documents with loss masks → fixed-shape rows with position ids.

Owns: turning documents (token ids + a mask of which tokens are training targets) into rows of
``seq_len`` (input ids, next-token labels with -100 where no loss is taken, position ids that
restart at 0 for every document), with several documents per row (``packing``) or one document per
row padded on the right; and drawing a step's rows as a pure function of (seed, step). Does not
own: reading or tokenizing records (sft.py) or the attention mask: transformers' mask functions
find the documents from the restarting position ids (``find_packed_sequence_indices``) and make
the causal mask block-diagonal, so a token never attends across a document boundary and a packed
row gives the loss and gradients of its documents run one by one.

Shapes: R = rows, T = ``seq_len``, n = tokens of one document.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["IGNORE_INDEX", "PackedRows", "pack", "pairs"]

IGNORE_INDEX = -100
"""Label of a position that takes no loss (``torch.nn.functional.cross_entropy``'s default)."""


def pairs(ids: np.ndarray, loss_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A document's (inputs [n-1], labels [n-1]): label i is token i+1 where it is a target, else -100.

    Args:
        ids: [n] token ids of the document.
        loss_mask: [n] bool, True where the token is a training target (e.g. completion tokens).
    """
    ids = np.asarray(ids, dtype=np.int64)
    labels = np.where(np.asarray(loss_mask, dtype=bool)[1:], ids[1:], IGNORE_INDEX)
    return ids[:-1], labels


@dataclass
class PackedRows:
    """Rows of equal length: ``input_ids``, ``labels`` and ``position_ids``, each [R, T] int64."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    num_truncated: int = 0
    """Documents longer than T that were cut to their first T positions."""
    num_tokens: np.ndarray | None = None
    """[R] int64: the positions of each row that hold documents (the rest is padding); None = all T."""

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def _take(self, seed: int, index: int, num_rows: int) -> list[int]:
        if self.num_rows < num_rows:
            raise ValueError(f"{self.num_rows} packed rows, fewer than the {num_rows} of one batch")
        take = []
        start = index * num_rows
        while len(take) < num_rows:
            epoch, offset = divmod(start + len(take), self.num_rows)
            perm = np.random.default_rng([seed, epoch]).permutation(self.num_rows)
            take.extend(perm[offset : offset + num_rows - len(take)].tolist())
        return take

    def batch(self, seed: int, index: int, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of batch ``index`` (a pure function of seed and index): each epoch is a fresh
        permutation of the rows, and batch ``index`` takes the next ``num_rows`` of that stream.

        Returns:
            (input_ids, labels, position_ids), each [num_rows, T] int64.

        Raises:
            ValueError: fewer rows than one batch needs.
        """
        take = self._take(seed, index, num_rows)
        return self.input_ids[take], self.labels[take], self.position_ids[take]

    def token_mask(self, seed: int, index: int, num_rows: int) -> np.ndarray | None:
        """Which positions of batch ``index``'s rows (those of :meth:`batch`) hold document tokens,
        not padding: [num_rows, T] bool, transformers' ``attention_mask`` of right-padded rows; None
        when no row of the batch is padded.

        Raises:
            ValueError: fewer rows than one batch needs.
        """
        if self.num_tokens is None:
            return None
        lengths = self.num_tokens[self._take(seed, index, num_rows)]  # [num_rows]
        width = self.input_ids.shape[1]
        if (lengths == width).all():
            return None
        return np.arange(width)[None, :] < lengths[:, None]


def pack(
    docs: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int, packing: bool = True
) -> PackedRows:
    """Lay (inputs, labels) pairs of documents (see :func:`pairs`) into rows of ``seq_len``.

    With ``packing`` a document goes into the current row if it fits, else it starts a new one
    (order kept; no document is split across rows); without, each document has a row of its own.
    The rest of a row is padding: ``pad_id`` inputs, -100 labels, positions restarting at 0 (a
    block of its own, which no real token attends to), counted out by ``num_tokens`` (a mixture of
    experts' router statistics leave it out, as transformers' ``attention_mask`` does). Documents
    longer than ``seq_len`` are cut.

    Raises:
        ValueError: ``seq_len`` < 1, or no document with at least one pair.
    """
    if seq_len < 1:
        raise ValueError(f"train.seq_len={seq_len}: must be >= 1")
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used, truncated = seq_len, 0  # used = positions taken in the current row
    for inputs, labels in docs:
        if len(inputs) == 0:
            continue
        if len(inputs) > seq_len:
            inputs, labels, truncated = inputs[:seq_len], labels[:seq_len], truncated + 1
        if not packing or used + len(inputs) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((inputs, labels))
        used += len(inputs)
    if not rows:
        raise ValueError("no document has two or more tokens: nothing to train on")
    shape = (len(rows), seq_len)
    out = PackedRows(
        np.full(shape, pad_id, np.int64), np.full(shape, IGNORE_INDEX, np.int64), np.zeros(shape, np.int64)
    )
    out.num_tokens = np.zeros(len(rows), np.int64)
    for r, row in enumerate(rows):
        at = 0
        for inputs, labels in row:
            n = len(inputs)
            out.input_ids[r, at : at + n], out.labels[r, at : at + n] = inputs, labels
            out.position_ids[r, at : at + n] = np.arange(n)
            at += n
        out.position_ids[r, at:] = np.arange(seq_len - at)
        out.num_tokens[r] = at
    out.num_truncated = truncated
    return out
