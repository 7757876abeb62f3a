"""Start-up checks of a prepared dataset against the run that is about to use it.

Owns: which tokenizer a run uses (``model.init_from``'s own, unless ``data.tokenizer`` says
otherwise: a new BPE's ids would mean other things than the imported embedding rows; on resume, the
one the checkpoint was trained with: :func:`resume_data_config`, :func:`check_resumed_tokenizer`),
opening both splits for training, and refusing — before the host store exists — a split too short
for one batch and a tokenizer whose vocabulary the model cannot embed. Does not own: preparing
or validating the files themselves (reader.py refuses a missing meta.json, a truncated or corrupt
``.bin`` and ids >= the tokenizer's vocabulary when it opens a split).

Rule for "too short": a split must hold at least as many non-overlapping windows of
``train.seq_len + 1`` tokens (``reader.batch``'s windows) as one batch has sequences: the global
batch of one optimizer step for ``train.bin``, one evaluation batch for ``val.bin`` (checked only
when ``train.eval_every`` > 0). A shorter split would repeat windows inside one batch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from tokenizers import Tokenizer

from nodetrain.config.batch import BatchShape
from nodetrain.config.schema import Config, DataConfig, ModelConfig
from nodetrain.data import datasets as data
from nodetrain.data import reader
from nodetrain.data.tokenizer import has_tokenizer, vocabulary_sha256

__all__ = [
    "check_init_vocab",
    "check_resumed_tokenizer",
    "check_vocab",
    "open_splits",
    "resume_data_config",
    "run_data_config",
]

log = logging.getLogger("nodetrain")


def run_data_config(cfg: Config) -> DataConfig:
    """``cfg.data`` with the tokenizer a run uses: ``data.tokenizer`` when set (``bpe`` = train a
    BPE), else ``model.init_from``'s tokenizer when that is set, else a BPE trained on the corpus.

    Raises:
        ValueError: ``model.init_from`` holds no tokenizer and ``data.tokenizer`` is empty (a new
            BPE would silently give ids that the imported embedding rows do not mean).
    """
    init_from, tokenizer = cfg.model.init_from, cfg.data.tokenizer
    if not init_from or tokenizer not in ("", "bpe"):
        return cfg.data
    if tokenizer == "bpe":
        log.warning(
            "data.tokenizer=bpe with model.init_from=%s: a new BPE's ids do not mean what the imported "
            "embedding rows learnt; expect the loss to start near the random level",
            init_from,
        )
        return cfg.data
    if not has_tokenizer(init_from):
        raise ValueError(
            f"model.init_from={init_from!r} holds no tokenizer (tokenizer.json or files AutoTokenizer loads) "
            "and data.tokenizer is empty: training a new BPE would give ids that mean other things than the "
            "imported embedding rows; fix: data.tokenizer=<the model's tokenizer directory>, or "
            "data.tokenizer=bpe to train a new one on purpose"
        )
    log.info("data.tokenizer: the tokenizer of model.init_from=%s", init_from)
    return dataclasses.replace(cfg.data, tokenizer=init_from)


_TRAINED = ("", "bpe")


def _changes(recorded: dict, record: dict, cfg: DataConfig) -> str:
    """What differs between the dataset a checkpoint was trained on and the one ``cfg`` gives now."""
    was = recorded.get("corpus_sha256")
    if was and was != record.get("corpus_sha256"):
        return (
            f"the contents of data.source={cfg.source} changed (corpus sha256 {was[:12]}… -> "
            f"{str(record.get('corpus_sha256'))[:12]}…)"
        )
    return "the data settings changed (tokenization, val_fraction, jsonl_field or add_bos)"


def resume_data_config(cfg: DataConfig, recorded: dict, ckpt: Path) -> DataConfig:
    """``cfg`` for a run that resumes ``ckpt``: its tokenizer is the one the checkpoint was trained with.

    A BPE trained on the corpus (``data.tokenizer`` empty or ``bpe``) is trained again only when the
    corpus and settings are the checkpoint's (the dataset fingerprints match): it is then the same
    BPE. When they changed, a new BPE would give every token id another meaning, so the new text is
    tokenized with the checkpoint's own tokenizer instead (``data.tokenizer=<ckpt>``), with a warning
    naming what changed. A given tokenizer is kept (:func:`check_resumed_tokenizer` compares it).

    Args:
        cfg: the run's data config (:func:`run_data_config`).
        recorded: ``data.dataset`` of the checkpoint's trainer state (checkpointing.dataset_identity);
            empty for a checkpoint written before it was recorded (nothing is compared then).
        ckpt: the checkpoint resumed.
    """
    if cfg.format == "records" or cfg.tokenizer not in _TRAINED or not recorded.get("fingerprint"):
        return cfg
    now, record = data.fingerprint(cfg)
    if now == recorded["fingerprint"]:
        return cfg
    log.warning(
        "data: %s since %s was written; a new BPE would give its token ids other meanings, so this run "
        "tokenizes data.source with the checkpoint's own tokenizer (data.tokenizer=%s) and trains on the "
        "new text",
        _changes(recorded, record, cfg),
        ckpt.name,
        ckpt,
    )
    return dataclasses.replace(cfg, tokenizer=str(ckpt))


def check_resumed_tokenizer(data_dir: Path, recorded: dict, ckpt: Path) -> None:
    """Refuse a prepared dataset whose tokenizer gives other ids than the one ``ckpt`` was trained with;
    say so when the text differs from the checkpoint's but is tokenized with its tokenizer.

    Raises:
        ValueError: the vocabularies differ (``tokenizer.vocabulary_sha256``), naming both and the fix.
    """
    if not recorded.get("vocabulary_sha256"):
        return
    data_dir = Path(data_dir)
    meta = json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))
    vocabulary = meta.get("vocabulary_sha256")
    if vocabulary is None:  # a records dataset, or one prepared before it was kept
        vocabulary = vocabulary_sha256(Tokenizer.from_file(str(data_dir / "tokenizer.json")))
    if vocabulary != recorded["vocabulary_sha256"]:
        raise ValueError(
            f"checkpoint.resume: {ckpt} was trained with another tokenizer than "
            f"{data_dir / 'tokenizer.json'} (vocabulary sha256 {recorded['vocabulary_sha256'][:12]}… -> "
            f"{vocabulary[:12]}…): its token ids would mean other things than the ones the weights "
            "learnt; fix: data.tokenizer=<the tokenizer it was trained with> (its own copy: "
            f"data.tokenizer={ckpt}), or start a new run from its weights "
            f"with model.init_from={ckpt}"
        )
    if recorded.get("fingerprint") and meta.get("fingerprint") != recorded["fingerprint"]:
        log.warning(
            "data: %s is not the dataset %s was trained on (%s), but it is tokenized with the same "
            "tokenizer: training continues on this data",
            data_dir,
            ckpt.name,
            recorded.get("dir"),
        )


def _embedding_rows(model_dir: Path) -> int | None:
    """``vocab_size`` of the HF ``config.json`` in ``model_dir`` (or its ``text_config``), or None."""
    try:
        hf = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the import's own checks name the problem (checkpoint/hf_import.py)
    rows = hf.get("vocab_size") or (hf.get("text_config") or {}).get("vocab_size")
    return int(rows) if rows else None


def _same_dir(a: str, b: str) -> bool:
    return bool(a and b) and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def check_init_vocab(model: ModelConfig, ds: reader.TokenDataset, tokenizer: str = "") -> int | None:
    """Refuse a tokenizer with more ids than ``model.init_from``'s embedding has rows.

    An embedding with more rows than the tokenizer has ids is accepted (checkpoints pad their
    vocabulary, e.g. Qwen's: the extra rows never see a token).

    Args:
        model: the run's model config.
        ds: a split of the prepared dataset (its tokenizer's vocabulary).
        tokenizer: the run's ``data.tokenizer`` (``run_data_config``'s): when it is
            ``model.init_from`` itself, the directory's tokenizer and checkpoint disagree, and the
            fix is another tokenizer or checkpoint, not "the model's own tokenizer".

    Returns:
        The embedding rows of ``model.init_from`` (the model's vocab_size unless ``model.hf`` sets
        one), or None without ``model.init_from`` or a readable config.json there.

    Raises:
        ValueError: the tokenizer has more ids than the embedding rows, naming both and the fix.
    """
    if not model.init_from or (rows := _embedding_rows(Path(model.init_from).expanduser())) is None:
        return None
    if ds.vocab_size <= rows:
        return rows
    if _same_dir(tokenizer, model.init_from):
        raise ValueError(
            f"model.init_from={model.init_from!r} embeds {rows} token ids (config.json vocab_size) but the "
            f"tokenizer in that same directory has {ds.vocab_size}: a mismatched checkpoint, ids >= {rows} "
            f"have no embedding row; fix: data.tokenizer=<a tokenizer that matches the checkpoint (at most "
            f"{rows} ids)>, or a model.init_from checkpoint whose embedding covers {ds.vocab_size} ids"
        )
    raise ValueError(
        f"model.init_from={model.init_from!r} embeds {rows} token ids (config.json vocab_size) but the "
        f"tokenizer {ds.path.parent / 'tokenizer.json'} has {ds.vocab_size}: ids >= {rows} have no "
        "embedding row; fix: use the model's own tokenizer (leave data.tokenizer empty, or "
        f"data.tokenizer=<model.init_from>), or a tokenizer of at most {rows} ids"
    )


def _check_length(ds: reader.TokenDataset, num_sequences: int, seq_len: int, batch: str, fix: str) -> None:
    windows = (ds.num_tokens - 1) // seq_len
    if windows < num_sequences:
        raise ValueError(
            f"{ds.path} holds {ds.num_tokens} tokens = {windows} window(s) of train.seq_len + 1 = "
            f"{seq_len + 1} tokens, fewer than the {num_sequences} sequences of {batch}; fix: {fix}"
        )


def open_splits(data_dir: str | Path, cfg: Config, batch: BatchShape | None = None):
    """Open ``train.bin`` and ``val.bin`` of a prepared dataset and check their length.

    Args:
        data_dir: the directory ``data.prepare`` wrote.
        cfg: the validated run config (evaluation, ``data.format``).
        batch: the run's batch (``config/batch.py``); default ``cfg``'s on one node.

    Returns:
        (train, val) ``reader.TokenDataset``.

    Raises:
        FileNotFoundError, ValueError: as ``reader.TokenDataset.open`` (missing, truncated or corrupt
            files); a split shorter than one batch (see the module docstring), naming the file.
    """
    batch = batch or BatchShape.of(cfg)
    if cfg.data.format == "records":
        return _open_records(Path(data_dir), cfg, batch)
    train = reader.TokenDataset.open(data_dir, "train")
    val = reader.TokenDataset.open(data_dir, "val")
    step = "one optimizer step (grad_accum × pipeline.microbatches × train.micro_batch_size × nodes)"
    fix = "more text in data.source, or a smaller batch/seq_len"
    _check_length(train, batch.sequences_per_step, batch.seq_len, step, fix)
    if cfg.train.eval_every:
        fix = "a larger data.val_fraction, more text, or train.eval_every=0"
        _check_length(val, batch.eval_sequences, batch.seq_len, "one evaluation batch", fix)
    return train, val


def _open_records(data_dir: Path, cfg: Config, batch: BatchShape):
    from nodetrain.data.sft import RecordsDataset

    t, b = cfg.train, batch
    train, val = RecordsDataset.open(data_dir, "train"), RecordsDataset.open(data_dir, "val")
    shape = (
        f"train.grad_accum={b.grad_accum} × pipeline.microbatches={b.microbatches} × train.micro_batch_size="
        f"{b.micro_batch_size} × {b.num_replicas} node(s)"
    )
    for ds, need, what in (
        (train, b.sequences_per_step, f"one optimizer step ({shape})"),
        (val, b.eval_sequences, "one eval (pipeline.microbatches × train.micro_batch_size)"),
    ):
        if ds.num_rows < need and (ds is train or t.eval_every):
            records = f"{ds.num_records} record(s)" if ds.num_records is not None else "its records"
            packed = "packed several to a row" if cfg.data.packing else "one per row"
            fix = f"at least {need} rows of records (more records" + (
                ", or data.packing=false: one record per row)" if cfg.data.packing else ")"
            )
            if ds is val:
                fix += ", a larger data.val_fraction, or train.eval_every=0"
            raise ValueError(
                f"{ds.path} holds {ds.num_rows} row(s) of train.seq_len={t.seq_len} tokens ({records}, "
                f"{packed}), fewer than the {need} sequences of {what}; fix: {fix}, or a smaller batch"
            )
    return train, val


def check_vocab(model_vocab: int, ds: reader.TokenDataset, tokenizer: str = "", init_from: str = "") -> None:
    """Refuse a model whose embedding has fewer rows than the dataset's tokenizer has ids.

    A larger model vocabulary is accepted (padded vocabularies are common: unused rows never see a
    token).

    Args:
        model_vocab: the model's embedding rows.
        ds: a split of the prepared dataset.
        tokenizer, init_from: the run's ``data.tokenizer`` and ``model.init_from``: when they are
            the same directory the tokenizer already is the model's own, and the fix does not say so.

    Raises:
        ValueError: ``model_vocab`` < the tokenizer's vocabulary, naming the dataset and the fix.
    """
    if model_vocab < ds.vocab_size:
        own = _same_dir(tokenizer, init_from)
        raise ValueError(
            f"model.hf.vocab_size={model_vocab} is smaller than the vocabulary of "
            f"{ds.path.parent / 'tokenizer.json'} ({ds.vocab_size} ids"
            + (f", the tokenizer of model.init_from={init_from!r}" if own else "")
            + f"; ids >= {model_vocab} would index past the embedding); fix: remove model.hf.vocab_size so "
            + "the tokenizer's size is used, or raise it"
            + ("" if own else ", or use the model's own tokenizer (data.tokenizer=<model dir>)")
        )
