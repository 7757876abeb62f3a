"""Instruction and record data: read records with ``datasets``, tokenize them with loss masks, pack.

Owns: ``data.format=records``: reading ``.jsonl``/``.json``/``.parquet``/``.arrow`` files or a
local ``datasets`` directory (``save_to_disk``) through the ``datasets`` library; turning each
record into token ids and a loss mask — ``{"text"}`` (every token a target, pre-training),
``{"prompt", "completion"}`` (only completion tokens and the closing eos), ``{"messages": [{role,
content}, ...]}`` rendered with the tokenizer's own chat template (only assistant turns); packing
the documents into rows (packing.py) and writing them, with the tokenizer, into ``data.dir``.
Does not own: the plain-text token stream (datasets.py) or attention across documents (packing.py).

    rows_dir = prepare_records(cfg.data, seq_len, seed)        # rank 0, once
    train = RecordsDataset.open(rows_dir, "train")             # every rank
    x, y, pos = train.batch(seed, step, num_rows)              # [num_rows, T] each

BOS: ``data.add_bos`` null = what the tokenizer's post-processor does (Llama-3 adds one per
document); true/false force it. EOS closes every text and completion (a chat template writes its
own end-of-turn tokens).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nodetrain.config.schema import DataConfig
from nodetrain.data.corpus import jsonl_records, source_name
from nodetrain.data.packing import IGNORE_INDEX, PackedRows, pack, pairs

__all__ = ["RecordsDataset", "load_records", "prepare_records", "tokenize_record"]

log = logging.getLogger(__name__)

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_SPLIT_FILES = ("input_ids", "labels", "position_ids")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def load_records(source: str | Path):
    """The records of ``source`` as a ``datasets.Dataset``.

    Args:
        source: a ``.jsonl``/``.json``/``.parquet``/``.arrow`` file or glob, or a directory written
            by ``Dataset.save_to_disk``.

    Raises:
        ValueError: an unknown file type, naming ``data.source`` and the supported ones; a
            ``.jsonl`` line that is not a JSON object (``file:line``); any error of ``datasets``
            while loading, naming ``data.source`` and the format.
    """
    import datasets  # heavy import: only runs that read records pay for it

    path = Path(source).expanduser()
    builder = "save_to_disk" if path.is_dir() else _BUILDERS.get(path.suffix)
    if builder is None:
        raise ValueError(
            f"data.source={str(source)!r}: not a records file; use {', '.join(_BUILDERS)} or a "
            "datasets directory (save_to_disk)"
        )
    if path.suffix == ".jsonl":  # datasets/pyarrow would fail with a traceback and no line number
        for file in sorted(glob.glob(str(path))):
            for line_number, record in jsonl_records(Path(file)):
                if not isinstance(record, dict):
                    raise ValueError(
                        f"data.source: {file}:{line_number} is not a JSON object; fix: make every line "
                        "of the file one record ({...})"
                    )
    try:
        if builder == "save_to_disk":
            loaded = datasets.load_from_disk(str(path))
            return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets and pyarrow raise many types; name the input instead
        raise ValueError(
            f"data.source={str(source)!r} (read as {builder} records) cannot be loaded: "
            f"{type(exc).__name__}: {str(exc)[:300]}; fix: point data.source at a valid "
            f"{', '.join(_BUILDERS)} file or a datasets directory written by save_to_disk"
        ) from exc


def _encode(tok: PreTrainedTokenizerBase, text: str, add_bos: bool | None) -> list[int]:
    ids = tok(text, add_special_tokens=add_bos is None)["input_ids"]
    if add_bos and tok.bos_token_id is not None and ids[:1] != [tok.bos_token_id]:
        ids = [tok.bos_token_id, *ids]
    return ids


def _chat(tok: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Render with the chat template and mark the assistant's tokens.

    A template with ``{% generation %}`` markers says itself which tokens are the assistant's
    (transformers' ``return_assistant_tokens_mask``). Otherwise an assistant turn is what it adds
    to the rendering of the conversation before it (with the generation prompt) — when the
    template renders every conversation as the prefix of its continuation (ChatML); else (Qwen3's
    template re-renders the last assistant turn) its content as written in the full rendering,
    found message by message in order, plus the end-of-turn (eos) text right after it.

    Raises:
        ValueError: no chat template, or a message whose content the template does not render.
    """
    if not tok.chat_template:
        raise ValueError(
            f"records with 'messages' need a tokenizer with a chat template (data.tokenizer), and "
            f"{tok.name_or_path or 'this tokenizer'} has none; fix: data.tokenizer=<a tokenizer directory "
            "whose tokenizer_config.json has a chat_template, e.g. the model's own>"
        )
    if _GENERATION_TAG.search(tok.chat_template):
        enc = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        return list(enc["input_ids"]), [bool(m) for m in enc["assistant_masks"]]
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = _prefix_spans(tok, messages, full)
    if spans is None:
        spans = _content_spans(tok, messages, full)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def _prefix_spans(tok, messages: list[dict], full: str) -> list[tuple[int, int]] | None:
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            return None
        spans.append((len(before), len(upto)))
    return spans


def _content_spans(tok, messages: list[dict], full: str) -> list[tuple[int, int]]:
    spans, cursor, eos = [], 0, tok.eos_token or ""
    for m in messages:
        content = m["content"].strip()
        start = full.find(content, cursor)
        if start < 0:
            raise ValueError(
                f"the chat template does not render the {m['role']} message {content[:40]!r} as "
                "written, so its tokens cannot be located; fix: a template with {% generation %} markers"
            )
        cursor = start + len(content)
        if m["role"] == "assistant":
            end = cursor + len(eos) if eos and full.startswith(eos, cursor) else cursor
            spans.append((start, end))
    return spans


def tokenize_record(
    record: dict[str, Any], tok: PreTrainedTokenizerBase, add_bos: bool | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids of one record and its loss mask (True = a training target).

    Raises:
        ValueError: a record with none of ``text``, ``prompt``+``completion``, ``messages``.
    """
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if record.get("messages") is not None:
        return _chat(tok, record["messages"])
    if record.get("completion") is not None and record.get("prompt") is not None:
        prompt = _encode(tok, record["prompt"], add_bos)
        completion = tok(record["completion"], add_special_tokens=False)["input_ids"] + eos
        return prompt + completion, [False] * len(prompt) + [True] * len(completion)
    if record.get("text") is not None:
        ids = _encode(tok, record["text"], add_bos) + eos
        return ids, [True] * len(ids)
    keys = sorted(k for k, v in record.items() if v is not None)  # datasets fills others' keys with None
    raise ValueError(
        f"record with keys {keys}: expected text, prompt+completion or messages; fix: give "
        "each record one of these"
    )


def _tokenizer(cfg: DataConfig) -> PreTrainedTokenizerBase:
    if not cfg.tokenizer:
        raise ValueError(
            "data.format=records needs data.tokenizer=<a Hugging Face tokenizer directory> (e.g. the "
            "model directory): its special tokens and chat template define the records' tokens"
        )
    return AutoTokenizer.from_pretrained(Path(cfg.tokenizer).expanduser())


def prepare_records(cfg: DataConfig, seq_len: int, seed: int = 0) -> Path:
    """Read, tokenize and pack the records of ``data.source`` into
    ``<data.dir>/<source name>-records-<settings hash>`` (rank 0, once per launch: the rows are
    rebuilt each time, so an edited source is always read again; ``datasets`` caches the tokenizing).

    Writes ``{train,val}.{input_ids,labels,position_ids}.npy`` ([R, seq_len] int64), the tokenizer
    (``save_pretrained``) and ``meta.json`` (vocab size, eot id, rows, truncated documents). The
    last ``data.val_fraction`` of the documents (at least one) is the validation split.

    Raises:
        ValueError: no tokenizer, an unreadable record, or too few documents for both splits.
    """
    import datasets

    tok = _tokenizer(cfg)
    add_bos = None if cfg.add_bos is None else bool(cfg.add_bos)
    records = load_records(cfg.source)

    def tokenize(record: dict, index: int) -> dict:
        try:
            return dict(zip(("ids", "mask"), tokenize_record(record, tok, add_bos), strict=True))
        except ValueError as exc:
            raise ValueError(f"data.source={cfg.source!r}, record {index}: {exc}") from exc

    records = records.map(
        tokenize, with_indices=True, remove_columns=records.column_names, desc="tokenizing records"
    )
    assert isinstance(records, datasets.Dataset)
    docs = [pairs(np.asarray(r["ids"]), np.asarray(r["mask"])) for r in records]
    num_val = max(1, int(len(docs) * cfg.val_fraction))
    if len(docs) <= num_val:
        raise ValueError(f"data.source={cfg.source!r} holds {len(docs)} record(s): too few for train and val")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = records_dir(cfg, seq_len)
    if out.is_dir() and any(out.iterdir()) and _meta(out).get("format") != "records":
        raise ValueError(f"{out} holds other files; fix: point data.dir at another directory")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    meta = {"format": "records", "vocab_size": len(tok), "eot_id": tok.eos_token_id, "seq_len": seq_len}
    for split, part in (("train", docs[:-num_val]), ("val", docs[-num_val:])):
        rows = _supervised(pack(part, seq_len, pad_id, cfg.packing), split, seq_len)
        for name in _SPLIT_FILES:
            np.save(out / f"{split}.{name}.npy", getattr(rows, name))
        meta[f"num_{split}_rows"], meta[f"num_{split}_truncated"] = rows.num_rows, rows.num_truncated
        if rows.num_truncated:
            log.warning(
                "%s: %d document(s) longer than train.seq_len=%d were cut", split, rows.num_truncated, seq_len
            )
    tok.save_pretrained(out)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def _supervised(rows: PackedRows, split: str, seq_len: int) -> PackedRows:
    """``rows`` without the rows that hold no target token: such a row gives loss 0 and no gradient,
    yet would take an optimizer step.

    Raises:
        ValueError: no row of ``split`` holds a target.
    """
    keep = (rows.labels != IGNORE_INDEX).any(axis=1)  # [R]
    if keep.all():
        return rows
    if not keep.any():
        raise ValueError(
            f"train.seq_len={seq_len}: no {split} row holds a target token (every record's prompt fills "
            "the first train.seq_len tokens, so no completion or assistant token is left); fix: a larger "
            "train.seq_len"
        )
    log.warning(
        "%s: dropped %d of %d row(s) without a target token (a prompt longer than train.seq_len=%d)",
        split,
        int((~keep).sum()),
        rows.num_rows,
        seq_len,
    )
    arrays = (rows.input_ids[keep], rows.labels[keep], rows.position_ids[keep])
    return PackedRows(*arrays, num_truncated=rows.num_truncated)


def records_dir(cfg: DataConfig, seq_len: int) -> Path:
    """The directory of the packed rows of ``cfg``: one per source and settings under ``data.dir``
    (as stream datasets are), so a records run never replaces another dataset."""
    settings = {
        "source": str(Path(cfg.source).expanduser().absolute()),
        "tokenizer": str(Path(cfg.tokenizer).expanduser().absolute()),
        "seq_len": seq_len,
        "packing": cfg.packing,
        "add_bos": cfg.add_bos,
        "val_fraction": cfg.val_fraction,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.dir).expanduser().absolute() / f"{source_name(cfg.source)}-records-{key}"


def _meta(directory: Path) -> dict:
    try:
        return json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


class RecordsDataset(PackedRows):
    """One split of a prepared records directory, with the fields the run's checks read."""

    path: Path
    vocab_size: int

    @classmethod
    def open(cls, directory: str | Path, split: str) -> RecordsDataset:
        """Raises: FileNotFoundError: a missing file of the split (prepare it again)."""
        directory = Path(directory)
        ds = cls(*(np.load(directory / f"{split}.{name}.npy") for name in _SPLIT_FILES))
        ds.path = directory / f"{split}.input_ids.npy"
        ds.vocab_size = json.loads((directory / "meta.json").read_text())["vocab_size"]
        return ds
