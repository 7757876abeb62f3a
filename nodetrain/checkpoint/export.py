"""What makes a checkpoint usable on its own: the tokenizer it was trained with and its special ids.

Owns: building the run's tokenizer as a ``transformers`` fast tokenizer (the prepared dataset's
``tokenizer.json``, with the special tokens and chat template of the tokenizer directory it came
from when that is a Hugging Face directory), the bos/eos/pad ids written into ``config.json`` and
``generation_config.json`` (eos: the stop list, :func:`stop_ids`), and writing those files plus the
tokenizer files into a checkpoint directory. Does not own: the weights (writer.py) or when a
checkpoint is written (checkpointing.py).

    tok = run_tokenizer(data_dir, cfg.data.tokenizer)         # once, rank 0
    write_export_files(step_dir, hf_config, tok, init_from)   # per checkpoint: config + tokenizer
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerFast

from nodetrain.data.chat import turn_terminators

__all__ = ["run_tokenizer", "special_token_ids", "stop_ids", "write_export_files"]

_SPECIAL = ("bos", "eos", "pad")


def run_tokenizer(data_dir: str | Path, tokenizer_dir: str | Path = "") -> PreTrainedTokenizerFast:
    """The tokenizer a run trains with, as a ``transformers`` fast tokenizer.

    Args:
        data_dir: the prepared dataset (its ``tokenizer.json`` defines the ids; ``meta.json``'s
            ``eot_id`` is the token that separates documents). A records dataset holds the whole
            tokenizer it was tokenized with (``data.chat_template`` included): that one is used.
        tokenizer_dir: ``data.tokenizer``; when it holds a ``tokenizer_config.json`` (a Hugging
            Face directory) its special tokens and chat template are kept.

    Returns:
        A tokenizer whose eos is the document separator unless the HF directory names one, and
        whose bos and pad default to that eos (GPT-2's convention) for a trained BPE.

    Raises:
        FileNotFoundError: ``data_dir`` lacks ``tokenizer.json`` or ``meta.json``.
    """
    data_dir = Path(data_dir)
    hf_dirs = [data_dir, *([Path(tokenizer_dir).expanduser()] if tokenizer_dir else [])]
    for hf_dir in hf_dirs:
        if (hf_dir / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(hf_dir)
            if tok.eos_token is None and (eot := _eot_token(tok, data_dir)) is not None:
                tok.eos_token = eot
            return tok
    tok = PreTrainedTokenizerFast(tokenizer_file=str(data_dir / "tokenizer.json"))
    eot = _eot_token(tok, data_dir)
    tok.add_special_tokens({"bos_token": eot, "eos_token": eot, "pad_token": eot})
    return tok


def _eot_token(tok: PreTrainedTokenizerFast, data_dir: Path) -> str | None:
    eot_id = json.loads((data_dir / "meta.json").read_text())["eot_id"]
    return None if eot_id is None else tok.convert_ids_to_tokens(eot_id)


def _ids(value) -> list[int]:
    return [] if value is None else [int(v) for v in (value if isinstance(value, list | tuple) else [value])]


def stop_ids(tok: PreTrainedTokenizerFast, imported=()) -> list[int]:
    """The ids ``generate`` must stop on, in a stable order: the imported model's own eos ids
    (``imported``: its ``config.json``'s, then its ``generation_config.json``'s; kept where the run's
    tokenizer has them as special tokens: a BPE trained for the run has another vocabulary), the
    tokenizer's eos, then the chat template's turn terminators (``chat.turn_terminators``: a
    reply's and a tool call's), each once.

    Args:
        tok: the run's tokenizer.
        imported: eos ids of the imported model (ints, lists or None); empty for a model from scratch.

    Returns:
        The union, first occurrence first (e.g. Llama-3.1-Instruct's ``[<|end_of_text|>, <|eom_id|>,
        <|eot_id|>]`` kept with a base tokenizer whose eos is ``<|end_of_text|>``).
    """
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
    ours = [i for value in imported for i in _ids(value) if i in special]
    ours += _ids(tok.eos_token_id) + turn_terminators(tok)
    return list(dict.fromkeys(ours))


def special_token_ids(
    tok: PreTrainedTokenizerFast, hf_config: PretrainedConfig, generation_eos=None
) -> dict[str, int | list[int] | None]:
    """``{bos,eos,pad}_token_id`` for the exported config and generation config: the tokenizer's
    ids; where the tokenizer has none, an imported config's own value (a model built from scratch
    has none to keep). eos is :func:`stop_ids` of the imported config's eos and ``generation_eos``
    (the imported ``generation_config.json``'s): one id, or the list ``generate`` stops on any of."""
    imported = bool(getattr(hf_config, "name_or_path", ""))
    ids = {}
    for name in _SPECIAL:
        token_id = getattr(tok, f"{name}_token_id")
        if token_id is None and imported:
            token_id = getattr(hf_config, f"{name}_token_id", None)
        ids[f"{name}_token_id"] = token_id
    stops = stop_ids(tok, (getattr(hf_config, "eos_token_id", None), generation_eos) if imported else ())
    if stops:
        ids["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return ids


def write_export_files(
    directory: Path,
    hf_config: PretrainedConfig,
    tok: PreTrainedTokenizerFast | None,
    dtype,
    source_dir: str | Path = "",
) -> list[Path]:
    """Write ``config.json``, ``generation_config.json`` and the tokenizer files into ``directory``.

    Args:
        directory: the checkpoint directory being written.
        hf_config: the run's model config (not modified).
        tok: the run's tokenizer (None: config only, with the config's own special ids).
        dtype: the export dtype (``torch.dtype``), recorded as ``config.json``'s ``dtype``.
        source_dir: the imported model directory (``model.init_from``); its
            ``generation_config.json``'s sampling defaults are kept when present, its special ids
            replaced by the run's tokenizer's (``special_token_ids``: another tokenizer's after
            ``data.tokenizer=`` a chat tokenizer or ``bpe``), its eos ids joining the stop list.

    Returns:
        The files written (for the checkpoint's manifest).
    """
    written = [directory / "config.json", directory / "generation_config.json"]
    hf = hf_config.__class__.from_dict(hf_config.to_dict())
    hf.use_cache, hf.dtype = True, dtype
    source = Path(source_dir).expanduser() / "generation_config.json" if source_dir else None
    generation = GenerationConfig.from_pretrained(source.parent) if source and source.is_file() else None
    generation_eos = None if generation is None else generation.eos_token_id
    ids = special_token_ids(tok, hf_config, generation_eos) if tok is not None else {}
    for key, value in ids.items():
        setattr(hf, key, value)
    if tok is not None:
        written += [Path(f) for f in tok.save_pretrained(directory) if Path(f).is_file()]
    hf.to_json_file(directory / "config.json")
    if generation is not None:
        for key, value in ids.items():
            setattr(generation, key, value)
    else:
        generation = GenerationConfig.from_model_config(hf)
    generation.save_pretrained(directory)
    return sorted(set(written))
