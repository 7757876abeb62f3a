"""The tokenizer of a dataset: loaded from a model directory, or a byte-level BPE trained on the corpus.

Owns: loading ``data.tokenizer`` (a ``tokenizer.json``, or whatever ``transformers.AutoTokenizer``
loads from the directory), training the byte-level BPE with pre-tokens bounded to
``MAX_PIECE_BYTES`` (BPE training time grows with the square of the longest pre-token: a 3 MB line
without spaces would otherwise run for tens of minutes), its end-of-text id, and whether encoding may
be split at line breaks. Does not own: reading the corpus (corpus.py) or writing tokens (datasets.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "EOT_TOKEN",
    "MAX_PIECE_BYTES",
    "has_tokenizer",
    "load_tokenizer",
    "train_bpe",
    "eot_id",
    "bos_ids",
    "is_chunk_safe",
    "tokenizer_sha256",
    "vocabulary_sha256",
]

EOT_TOKEN = "<|endoftext|>"
"""End-of-text token of a trained tokenizer; its id separates documents in the token stream."""

MAX_PIECE_BYTES = 64
"""Longest pre-token of the trained BPE (bytes of UTF-8): a longer run without whitespace is split
into pieces of this many bytes, so no token is longer and training stays linear in the text."""

_EOS_NAMES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # GPT-2's regex split into byte-level pieces, then each piece cut into runs of at most
    # MAX_PIECE_BYTES byte-level characters (one per byte; "." matches all: a newline is "Ċ" here).
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False),
            pre_tokenizers.Split(Regex(f".{{1,{MAX_PIECE_BYTES}}}"), behavior="isolated"),
        ]
    )


def has_tokenizer(directory: str | Path) -> bool:
    """Whether ``directory`` holds tokenizer files (``tokenizer.json``, a sentencepiece model, ...)."""
    path = Path(directory).expanduser()
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(directory: str | Path, key: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer in ``directory``: its ``tokenizer.json``, else the fast tokenizer that
    ``transformers.AutoTokenizer`` builds from the files there (offline).

    Raises:
        FileNotFoundError: no tokenizer can be loaded from ``directory``, naming ``key``.
    """
    path = Path(directory).expanduser()
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    if has_tokenizer(path):
        from transformers import AutoTokenizer  # slow import, only for such directories

        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"{key}={str(directory)!r}: cannot load its tokenizer ({exc})") from exc
        if getattr(hf, "backend_tokenizer", None) is not None:
            return hf.backend_tokenizer
    raise FileNotFoundError(
        f"{key}={str(directory)!r} holds no tokenizer.json (nor files AutoTokenizer loads); fix: point "
        "data.tokenizer at a directory with one (e.g. a Hugging Face model dir), or set data.tokenizer=bpe "
        "to train a byte-level BPE on the corpus"
    )


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ids (the end-of-text token, 256 bytes, merges) trained on
    ``texts``, with pre-tokens of at most ``MAX_PIECE_BYTES`` bytes.

    Args:
        texts: the corpus (documents or pieces of them split where pre-tokens end).
        vocab_size: ids of the result, >= 257.
        show_progress: let the ``tokenizers`` trainer draw its progress bars (on a terminal).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def eot_id(tok: Tokenizer, key_value: str) -> int:
    """The id of the first known end-of-text token name the tokenizer has.

    Raises:
        ValueError: none of the known names is in the vocabulary (``key_value`` names the setting).
    """
    for name in _EOS_NAMES:
        if (token_id := tok.token_to_id(name)) is not None:
            return token_id
    raise ValueError(
        f"{key_value} has none of the end-of-text tokens {_EOS_NAMES}; fix: use a tokenizer with one, or "
        "set data.tokenizer=bpe to train a BPE"
    )


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


def bos_ids(tok: Tokenizer, add_bos: bool | None) -> list[int]:
    """The ids put before each document of a stream dataset (``data.add_bos``).

    None: what the tokenizer's post-processor puts before a text (Llama-3's ``<|begin_of_text|>``;
    nothing for a byte-level BPE or GPT-2's). True: that, or else the first of the known BOS names
    the tokenizer has. False: nothing.

    Raises:
        ValueError: ``data.add_bos=true`` and the tokenizer has no BOS token.
    """
    if add_bos is False:
        return []
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a").ids
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
    prefix = full[: starts[0]] if starts else []
    if prefix or add_bos is None:
        return prefix
    for name in _BOS_NAMES:
        if (token_id := tok.token_to_id(name)) is not None:
            return [token_id]
    raise ValueError(
        f"data.add_bos=true: the tokenizer has none of the BOS tokens {_BOS_NAMES}; fix: data.add_bos=null "
        "or false, or a tokenizer with one"
    )


def is_chunk_safe(tok: Tokenizer) -> bool:
    """Whether ``tok`` pre-tokenizes like GPT-2's byte-level regex (optionally followed by the fixed
    length split of ``train_bpe``), so that splitting a text after a newline that ends a non-space
    run and precedes one cannot change its tokens (datasets.py's ``_chunks`` relies on it)."""
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence":
        if pre.get("pretokenizers") != _trained_pre_tokenizer_spec()["pretokenizers"]:
            return False
        pre = pre["pretokenizers"][0]
    byte_level = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    return spec.get("normalizer") is None and byte_level and not pre.get("add_prefix_space", True)


def _trained_pre_tokenizer_spec() -> dict:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    return json.loads(tok.to_str())["pre_tokenizer"]


def tokenizer_sha256(tok: Tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON (vocabulary, merges, pre-tokenizer, ...)."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def vocabulary_sha256(tok: Tokenizer) -> str:
    """SHA-256 of what gives a text its ids without added special tokens: normalizer, pre-tokenizer,
    model (vocabulary and merges) and the added tokens' ids and contents; a checkpoint's copy of a
    dataset's tokenizer (``save_pretrained``, which adds a post-processor and special-token roles)
    has the same digest as the original (``checkpointing.dataset_identity``)."""
    spec = json.loads(tok.to_str())
    added = sorted((t["id"], t["content"]) for t in spec.get("added_tokens") or [])
    keyed = {k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "model")} | {"added_tokens": added}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()
