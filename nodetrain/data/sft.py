"""Instruction and record data: read records, tokenize them with loss masks, pack.

Owns: ``data.format=records``: reading ``.jsonl``/``.json`` files (with ``json``, as written) and
``.parquet``/``.arrow`` files or a local ``datasets`` directory (``save_to_disk``, through the
``datasets`` library); checking each record and turning it into token ids and a loss mask —
``{"text"}`` (every token a target, pre-training), ``{"prompt", "completion"}`` (only the completion
and its eos), ``{"messages", "tools"?}`` and conversational ``{"prompt": [...], "completion": [...]}``
rendered with the chat template (only assistant turns, segmented by chat.py); packing the documents
into rows (packing.py) and writing them, with the tokenizer, under the datasets' root (cache.py).
Does not own: the plain-text token stream (datasets.py), attention across documents (packing.py) or
which tokens of a conversation are the assistant's (chat.py).

    rows_dir = prepare_records(cfg.data, seq_len, seed)        # rank 0, once
    train = RecordsDataset.open(rows_dir, "train")             # every rank
    x, y, pos = train.batch(seed, step, num_rows)              # [num_rows, T] each

BOS and EOS: a document is tokenized once into what a model sees at inference (the rule in full:
docs/checkpoints.md, "Fine-tuning on chat or instruction data").
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nodetrain.config.schema import DataConfig
from nodetrain.data.cache import data_root
from nodetrain.data.chat import MARKERS_FIX, chat_tokens
from nodetrain.data.corpus import jsonl_records, source_name
from nodetrain.data.packing import IGNORE_INDEX, PackedRows, pack, pairs
from nodetrain.data.progress import TaskProgress

__all__ = [
    "RecordsDataset",
    "document_ends",
    "load_records",
    "prepare_records",
    "read_records",
    "tokenize_record",
]

log = logging.getLogger(__name__)

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_SPLIT_FILES = ("input_ids", "labels", "position_ids")


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


def read_records(source: str | Path) -> list[tuple[str, dict]]:
    """Every record of ``source`` with where it is (``file:line (record N)``, or ``source record N``), in
    order (N counts from 0 over all files).

    ``.jsonl``/``.json`` files are read with ``json`` as written. An Arrow table (parquet, arrow,
    ``save_to_disk``; JSON read by ``datasets`` before 5, which has no ``Json`` feature) gives every
    message and every tool call's ``arguments`` every key any record has, filled with null, and a
    template renders those nulls: such sources go through :func:`load_records` and their nulls
    are dropped.

    Raises:
        ValueError: as :func:`load_records`; a record that is not a JSON object; no record at all.
    """
    path = Path(source).expanduser()
    if path.suffix in (".jsonl", ".json") and not path.is_dir():
        files = sorted(glob.glob(str(path)))
        if not files:
            raise ValueError(f"data.source={str(source)!r} matches no file; fix: point it at a records file")
        read = [rec for file in files for rec in _json_records(Path(file))]
        records = [(f"{where} (record {i})", r) for i, (where, r) in enumerate(read)]
    else:
        records = [(f"{source} record {i}", _drop_nulls(r)) for i, r in enumerate(load_records(source))]
    if not records:
        raise ValueError(
            f"data.source={str(source)!r} holds no records (an empty file); fix: one JSON object per line, "
            'e.g. {"messages": [...]}'
        )
    return records


def _json_records(path: Path) -> list[tuple[str, dict]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = [(f"{path}[{i}]", r) for i, r in enumerate(json.loads(text))]
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"data.source: {path} is not valid JSON ({exc}); fix: a JSON list of records"
            ) from exc
    else:
        items = [(f"{path}:{n}", r) for n, r in jsonl_records(path)]
    for where, record in items:
        if not isinstance(record, dict):
            raise ValueError(
                f"data.source: {where} is not a JSON object; fix: make every line of the file one record "
                "({...})"
            )
    return items


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def document_ends(tok: PreTrainedTokenizerBase, add_bos: bool | None) -> tuple[list[int], list[int]]:
    """The ids that open and close a text document: what the tokenizer's single-sequence encoding
    puts around a text (its post-processor: Llama-3's BOS, Llama-2-with-add_eos's BOS and EOS), the
    opening forced by ``data.add_bos`` (true: that, else the tokenizer's BOS; false: none), and the
    closing the tokenizer's own, else its EOS (none if it has neither).

    Raises:
        ValueError: ``data.add_bos=true`` and the tokenizer has no BOS.
    """
    plain = tok("a", add_special_tokens=False)["input_ids"]
    full = tok("a")["input_ids"]
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    bos, eos = full[:at], full[at + len(plain) :]
    if add_bos is False:
        bos = []
    elif add_bos and not bos:
        if tok.bos_token_id is None:
            raise ValueError(
                "data.add_bos=true: the tokenizer has no BOS token; fix: data.add_bos=null or false, or a "
                "tokenizer with one"
            )
        bos = [tok.bos_token_id]
    if not eos and tok.eos_token_id is not None:
        eos = [tok.eos_token_id]
    return bos, eos


def _text(tok, text: str, completion_at: int | None, ends: tuple[list[int], list[int]]):
    """A text tokenized once, with one BOS/EOS (``ends``) however the text already begins or ends;
    the loss on every token (``completion_at`` None) or on the tokens overlapping
    ``text[completion_at:]`` (TRL's rule: a token across the boundary is the completion's) and the EOS."""
    bos, eos = ends
    if completion_at is None:
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        mask = [True] * len(ids)
    else:
        ids, mask = _split_at(tok, text, completion_at)
    if bos and ids[: len(bos)] != bos:
        ids, mask = bos + ids, [completion_at is None] * len(bos) + mask
    if eos and ids[-len(eos) :] != eos:
        ids, mask = ids + eos, mask + [True] * len(eos)
    return ids, mask


def _split_at(tok, text: str, at: int) -> tuple[list[int], list[bool]]:
    """``text``'s ids and which of them reach past character ``at``: by the fast tokenizer's offsets,
    else (a Python tokenizer has none) after the longest common prefix with ``text[:at]``'s ids."""
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        prompt = list(tok(text[:at], add_special_tokens=False)["input_ids"])
        diverge = (k for k, (a, b) in enumerate(zip(ids, prompt, strict=False)) if a != b)
        same = next(diverge, min(len(ids), len(prompt)))
        return ids, [k >= same for k in range(len(ids))]
    return list(enc["input_ids"]), [end > at for _, end in enc["offset_mapping"]]


def _messages(value: Any, key: str) -> list[dict]:
    """``value`` checked as a list of messages, each a JSON object with a string ``role``.

    Raises:
        ValueError: naming ``key`` and the message.
    """
    if not isinstance(value, list) or not value:
        raise ValueError(
            f'{key!r} must be a non-empty list of messages ({{"role": ..., "content": ...}}), got '
            f"{type(value).__name__} {str(value)[:40]!r}; fix: write it as a JSON list"
        )
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            what = sorted(message) if isinstance(message, dict) else type(message).__name__
            raise ValueError(
                f"{key}[{i}] has no string 'role' (it is {what}); fix: give every message a role "
                "(system, user, assistant or tool) and its content"
            )
    return value


def _tools(record: dict) -> list[dict] | None:
    tools = record.get("tools")
    if isinstance(tools, str):  # datasets often keep tool schemas as JSON text (TRL reads both)
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'tools' is a string but not JSON ({exc.msg}); fix: a list of schemas") from exc
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"'tools' must be a list of JSON schemas, got {type(tools).__name__}")
    return tools or None


def _conversation(tok, messages: list[dict], tools, first: int, what: str, template: str = ""):
    if not tok.chat_template:
        raise ValueError(
            f"records with {what} need a tokenizer with a chat template (data.tokenizer), and "
            f"{tok.name_or_path or 'this tokenizer'} has none; fix: data.tokenizer=<a tokenizer directory "
            "whose chat_template.jinja or tokenizer_config.json has a chat_template, e.g. the model's own>, "
            "or data.chat_template=<a .jinja file>"
        )
    if not any(m["role"] == "assistant" for m in messages[first:]):
        roles = ", ".join(m["role"] for m in messages[first:])
        raise ValueError(
            f"{what} hold no assistant turn to train on (roles: {roles}); fix: add one or drop it"
        )
    ids, mask = chat_tokens(tok, messages, tools, first, template)
    if not any(mask):
        raise ValueError(f"the chat template renders no token of its assistant turns; {MARKERS_FIX}")
    return ids, mask


def tokenize_record(
    record: dict[str, Any], tok: PreTrainedTokenizerBase, add_bos: bool | None = None, template: str = ""
) -> tuple[list[int], list[bool]]:
    """Token ids of one record, exactly as a model sees it at inference, and its loss mask (True = a
    training target).

    ``text``: BOS (``document_ends``) + the text + EOS, all targets. ``prompt`` + ``completion``
    strings: tokenized once as one text, targets the completion's tokens and the EOS. ``messages``
    (with ``tools``), or ``prompt`` + ``completion`` as message lists (TRL's conversational
    format): ``apply_chat_template``'s tokens (the template writes its own BOS and terminators),
    targets the assistant turns (of the completion) as chat.py segments them (after a last assistant
    turn of a template that closes no turn itself, GLM-4.5's, the next role's marker is appended and
    trained). ``template`` names the chat template in refusals.

    Raises:
        ValueError: a record of no known kind, a malformed field, a conversation without an
            assistant turn, or a chat template that cannot render or segment it.
    """
    tools = _tools(record)
    if record.get("messages") is not None:
        return _conversation(tok, _messages(record["messages"], "messages"), tools, 0, "'messages'", template)
    prompt, completion = record.get("prompt"), record.get("completion")
    if prompt is not None and completion is not None:
        if isinstance(prompt, str) and isinstance(completion, str):
            return _text(tok, prompt + completion, len(prompt), document_ends(tok, add_bos))
        if isinstance(prompt, list) and isinstance(completion, list):
            prompt, completion = _messages(prompt, "prompt"), _messages(completion, "completion")
            return _conversation(
                tok, prompt + completion, tools, len(prompt), "'completion' messages", template
            )
        raise ValueError(
            f"'prompt' ({type(prompt).__name__}) and 'completion' ({type(completion).__name__}) must both be "
            "strings or both be lists of messages"
        )
    if isinstance(record.get("text"), str):
        return _text(tok, record["text"], None, document_ends(tok, add_bos))
    keys = sorted(k for k, v in record.items() if v is not None)  # datasets fills others' keys with None
    raise ValueError(
        f"record with keys {keys}: expected text, prompt+completion or messages; fix: give "
        "each record one of these"
    )


def _tokenizer(cfg: DataConfig) -> PreTrainedTokenizerBase:
    """``data.tokenizer``, with ``data.chat_template`` (a Jinja file) as its chat template when set.

    Raises:
        ValueError: no ``data.tokenizer``; a ``data.chat_template`` that is not a readable file.
    """
    if not cfg.tokenizer:
        raise ValueError(
            "data.format=records needs data.tokenizer=<a Hugging Face tokenizer directory> (e.g. the "
            "model directory): its special tokens and chat template define the records' tokens"
        )
    tok = AutoTokenizer.from_pretrained(Path(cfg.tokenizer).expanduser())
    if cfg.chat_template:
        try:
            tok.chat_template = Path(cfg.chat_template).expanduser().read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(
                f"data.chat_template={cfg.chat_template!r} cannot be read ({exc.strerror}); fix: the path of "
                "a Jinja chat template file, e.g. trl/chat_templates/qwen3_training.jinja"
            ) from exc
    return tok


def _tokenize_all(cfg: DataConfig, tok: PreTrainedTokenizerBase) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every record of ``data.source`` as a document's (inputs, labels) pair (packing.py ``pairs``).

    Raises:
        ValueError: a record that cannot be tokenized, naming ``data.source`` and where the record is.
    """
    add_bos = None if cfg.add_bos is None else bool(cfg.add_bos)
    template = f"data.chat_template={cfg.chat_template}" if cfg.chat_template else ""
    template = template or f"the chat template of data.tokenizer={cfg.tokenizer}"
    records, docs = read_records(cfg.source), []
    with TaskProgress("data: tokenizing records", len(records), "records") as bar:
        for where, record in records:
            try:
                ids, mask = tokenize_record(record, tok, add_bos, template)
            except ValueError as exc:
                raise ValueError(f"data.source: {where}: {exc}") from exc
            docs.append(pairs(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
            bar.advance(1)
    return docs


def prepare_records(cfg: DataConfig, seq_len: int, seed: int = 0) -> Path:
    """Read, tokenize and pack the records of ``data.source`` into
    ``<root>/<source name>-records-<settings hash>`` (``root``: ``data.dir``, cache.py; rank 0, once
    per launch: the rows are rebuilt each time, so an edited source is always read again).

    Writes ``{train,val}.{input_ids,labels,position_ids}.npy`` ([R, seq_len] int64) and
    ``{train,val}.num_tokens.npy`` ([R] int64: each row's positions before its padding), the tokenizer
    (``save_pretrained``, with ``data.chat_template`` when set: checkpoints carry it) and
    ``meta.json`` (vocab size, eot id, rows, truncated documents). The last ``data.val_fraction`` of
    the documents (at least one) is the validation split.

    Raises:
        ValueError: no tokenizer, an unreadable or malformed record (naming it), or too few
            documents for both splits.
    """
    tok = _tokenizer(cfg)
    docs = _tokenize_all(cfg, tok)
    num_val = max(1, int(len(docs) * cfg.val_fraction))
    if len(docs) <= num_val:
        raise ValueError(
            f"data.source={cfg.source!r} holds {len(docs)} record(s): too few for train and val "
            f"(data.val_fraction holds out {num_val}); fix: more records"
        )
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = records_dir(cfg, seq_len)
    if out.is_dir() and any(out.iterdir()) and _meta(out).get("format") != "records":
        raise ValueError(f"{out} holds other files; fix: point data.dir at another directory")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    meta = {"format": "records", "vocab_size": len(tok), "eot_id": tok.eos_token_id, "seq_len": seq_len}
    meta |= {"packing": cfg.packing}
    for split, part in (("train", docs[:-num_val]), ("val", docs[-num_val:])):
        rows = _supervised(pack(part, seq_len, pad_id, cfg.packing), split, seq_len)
        for name in (*_SPLIT_FILES, "num_tokens"):
            np.save(out / f"{split}.{name}.npy", getattr(rows, name))
        meta[f"num_{split}_rows"], meta[f"num_{split}_truncated"] = rows.num_rows, rows.num_truncated
        meta[f"num_{split}_records"] = len(part)
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
    lengths = None if rows.num_tokens is None else rows.num_tokens[keep]
    return PackedRows(*arrays, num_truncated=rows.num_truncated, num_tokens=lengths)


def records_dir(cfg: DataConfig, seq_len: int) -> Path:
    """The directory of the packed rows of ``cfg``: one per source and settings under the datasets' root
    (as stream datasets are), so a records run never replaces another dataset."""
    settings = {
        "source": str(Path(cfg.source).expanduser().absolute()),
        "tokenizer": str(Path(cfg.tokenizer).expanduser().absolute()),
        "seq_len": seq_len,
        "packing": cfg.packing,
        "add_bos": cfg.add_bos,
        "val_fraction": cfg.val_fraction,
    }
    if cfg.chat_template:  # unset keeps the directories of earlier runs
        settings["chat_template"] = str(Path(cfg.chat_template).expanduser().absolute())
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return data_root(cfg.dir) / f"{source_name(cfg.source)}-records-{key}"


def _meta(directory: Path) -> dict:
    try:
        return json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


class RecordsDataset(PackedRows):
    """One split of a prepared records directory, with the fields the run's checks read."""

    path: Path
    vocab_size: int
    num_records: int | None
    """Records of the split (None: a directory prepared before this was recorded)."""

    @classmethod
    def open(cls, directory: str | Path, split: str) -> RecordsDataset:
        """Raises: FileNotFoundError: a missing file of the split (prepare it again)."""
        directory = Path(directory)
        ds = cls(*(np.load(directory / f"{split}.{name}.npy") for name in _SPLIT_FILES))
        if (lengths := directory / f"{split}.num_tokens.npy").is_file():  # absent: written before it was kept
            ds.num_tokens = np.load(lengths)
        ds.path = directory / f"{split}.input_ids.npy"
        meta = json.loads((directory / "meta.json").read_text())
        ds.vocab_size, ds.num_records = meta["vocab_size"], meta.get(f"num_{split}_records")
        return ds
