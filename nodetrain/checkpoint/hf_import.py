"""Hugging Face model directory import: check it against the model, then read it into the host store.

Owns: refusing a directory that cannot be this model (``config.json`` architecture, missing or
unexpected tensor names, shapes, non-float dtypes — every problem listed in one message, from the
file headers alone, before the host store is allocated) and filling the fp32 master weights of
the units a rank owns, tensor by tensor, converting the dtype on the way (tensors.py), so no
process ever holds a second full copy; each tensor is checked for NaN/inf as it lands (the values
are only known then; checkpointing.check_import refuses them by name). Does not own: the trainer's
own checkpoints (resume.py). safetensors and JSON only: no pickle is ever loaded.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection
from pathlib import Path

import torch
from transformers import AutoConfig

from nodetrain.checkpoint.hf_layout import Piece, import_pieces
from nodetrain.checkpoint.tensors import TensorEntry, read_index, read_into
from nodetrain.model import SUPPORTED_ARCHS, HFModel, Unit
from nodetrain.store import HostStore

__all__ = ["check_model_dir", "load_constants", "load_hf_weights", "load_units"]

log = logging.getLogger(__name__)

# Fields whose difference between the directory's config (as transformers builds it, so every
# dialect is compared in one form: legacy ``rope_scaling``/``rope_theta`` become ``rope_parameters``)
# and the run's model changes the math without changing any tensor shape: an error, unless the
# run changes the field on purpose with ``model.hf_override`` (then a warning).
_MATH_KEYS = (
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "attention_dropout",
    "attention_bias",
    "mlp_bias",
    "head_dim",
)
# Non-parameter buffers older checkpoints saved (Llama-2 era: one rotary ``inv_freq`` per layer);
# transformers ignores them on load (``PreTrainedModel._adjust_missing_and_unexpected_keys``).
_BUFFER_PATTERNS = (re.compile(r"rotary_emb\.inv_freq$"), re.compile(r"(^|\.)position_ids$"))


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"model.init_from={str(model_dir)!r}: cannot read {path} ({e}); point it at a "
            "save_pretrained() directory"
        ) from e


def _check_arch(model_dir: Path, source: dict, model: HFModel) -> list[str]:
    archs, arch = source.get("architectures") or [], model.config.architectures[0]
    if not archs:
        return [f"config.json names no architectures; expected {arch}"]
    if archs[0] not in SUPPORTED_ARCHS:
        return [f"architecture {archs[0]} is not supported; nodetrain trains {', '.join(SUPPORTED_ARCHS)}"]
    if arch not in archs:
        return [
            f"config.json says {archs[0]} but the run's model is model.arch={arch}; remove "
            "model.config_path (model.init_from alone builds the directory's model)"
        ]
    return []


def _config_differences(model_dir: Path, model: HFModel, overrides: Collection[str]) -> tuple[list, list]:
    """(problems, warnings): math fields where the directory's config and the run's model differ."""
    theirs = AutoConfig.from_pretrained(model_dir).to_dict()
    ours, problems, warnings = model.config.to_dict(), [], []
    for k in _MATH_KEYS:
        if k in theirs and k in ours and theirs[k] != ours[k]:
            diff = f"{k}: {theirs[k]!r} in {model_dir}/config.json, {ours[k]!r} in the run"
            if k in overrides:
                warnings.append(diff + f" (model.hf_override.{k})")
            else:
                fix = "remove model.config_path, or set +model.hf_override.<key> to choose the run's value"
                problems.append(f"{diff}: the weights were trained with the other value; {fix}")
    return problems, warnings


def _ignored_buffers(index: dict[str, TensorEntry]) -> set[str]:
    return {n for n in index if any(p.search(n) for p in _BUFFER_PATTERNS)}


def _check_tensors(index: dict[str, TensorEntry], model: HFModel, source: dict) -> list[str]:
    # a parameter may be several checkpoint tensors (one per expert: hf_layout.py)
    problems = []
    wanted = {q.name: q for u in model.units for p in u.params for q in import_pieces(model, p, index)}
    wanted.update({hf: Piece(hf, 0, tuple(t.shape)) for c in model.constants for hf, t in c.values()})
    for name, p in wanted.items():
        entry = index.get(name)
        if entry is None:
            problems.append(f"missing tensor {name}")
        elif entry.shape != p.shape:
            problems.append(f"{name}: shape {entry.shape} in {entry.file.name}, the model needs {p.shape}")
        elif not entry.dtype.is_floating_point:
            problems.append(f"{name}: dtype {entry.dtype} in {entry.file.name} is not a float dtype")
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding); transformers ignores it.
    ignored = {"lm_head.weight"} if model.tied and source.get("tie_word_embeddings") else set()
    buffers = _ignored_buffers(index) | {n for n in index if any(re.search(k, n) for k in model.ignored_keys)}
    if buffers:
        log.info(
            "skipping %d non-parameter buffer(s) transformers also ignores, e.g. %s",
            len(buffers),
            min(buffers),
        )
    unexpected = sorted(set(index) - set(wanted) - ignored - buffers)
    problems += [f"unexpected tensor {n} (in {index[n].file.name})" for n in unexpected]
    if "lm_head.weight" in unexpected and model.tied:
        problems.append(
            "the model ties lm_head to the embedding; set +model.hf_override.tie_word_embeddings=false"
        )
    elif "lm_head.weight" in wanted and "lm_head.weight" not in index and source.get("tie_word_embeddings"):
        problems.append(
            "the checkpoint ties lm_head to the embedding; set +model.hf_override.tie_word_embeddings=true"
        )
    return problems


def check_model_dir(
    model_dir: str | Path, model: HFModel, overrides: Collection[str] = ()
) -> dict[str, TensorEntry]:
    """Check a HF model directory against ``model`` from its ``config.json`` and file headers only.

    Args:
        model_dir: a ``save_pretrained`` directory (config.json + model.safetensors, or sharded
            ``*.safetensors`` with ``model.safetensors.index.json``), any float dtype.
        model: the run's model (its units say which tensors, with which shapes, are needed).
        overrides: HF config fields the run changes on purpose (``model.hf_override``): a
            difference in these is a warning, not a problem.

    Returns:
        HF tensor name -> where its bytes are, for :func:`load_hf_weights`.

    Raises:
        ValueError: listing every problem: unreadable config.json, an architecture that is not
            supported or not the run's, a math field (rope, norm eps, ...) that differs from the
            run's model and is not in ``overrides``, missing or unexpected tensors (known
            non-parameter buffers such as ``rotary_emb.inv_freq`` are skipped), shape mismatches,
            non-float tensors, truncated or corrupt files.
        FileNotFoundError: no safetensors weights in the directory.
    """
    model_dir = Path(model_dir).expanduser()
    source = _read_config(model_dir)
    problems, warnings = _check_arch(model_dir, source, model), []
    if not problems:
        problems, warnings = _config_differences(model_dir, model, overrides)
        try:
            index = read_index(model_dir)
        except ValueError as e:
            problems.append(str(e))
        else:
            problems += _check_tensors(index, model, source)
    if problems:
        raise ValueError(
            f"model.init_from={str(model_dir)!r} cannot initialise this model "
            f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems)
        )
    for diff in warnings:
        log.warning("model.init_from=%s: config differs from the run's model: %s", model_dir, diff)
    return index


def load_units(
    index: dict[str, TensorEntry],
    store: HostStore,
    units: list[Unit],
    field: str = "master",
    model: HFModel | None = None,
) -> list[str]:
    """Read every parameter of ``units`` from ``index`` into the store's ``field`` buffers (fp32),
    converting dtype on the way; extra memory is bounded by ``tensors.CHUNK_BYTES``. With ``model``,
    a parameter is read from the checkpoint tensors it is saved as (experts one per expert:
    hf_layout.py); without, by its own name.

    Returns:
        One line per tensor that holds NaN or inf (``name: k of n values are NaN/inf (file)``); empty
        when every value is finite. The caller refuses them (the values are in the store already).

    Raises:
        KeyError: a parameter missing from ``index`` (callers check first).
    """
    nonfinite = []
    for u in units:
        buf = store.buffer(u.index, field)
        for p in u.params:
            for q in import_pieces(model, p, index):
                entry = index[q.name]
                dst = buf[p.offset + q.offset : p.offset + q.offset + q.numel]
                read_into(entry, dst)
                if not bool(torch.isfinite(dst).all()):
                    bad = int((~torch.isfinite(dst)).sum())
                    nonfinite.append(f"{q.name}: {bad} of {q.numel} values are NaN/inf ({entry.file.name})")
    if model is not None:
        load_constants(index, model, units)
    return nonfinite


def load_constants(index: dict[str, TensorEntry], model: HFModel, units: list[Unit]) -> None:
    """Read the constants of ``units`` (DeepSeek-V3's router ``e_score_correction_bias``: buffers
    transformers saves but never trains, held by the model, not the store; hf.py) from ``index``
    (an HF directory, or a checkpoint's model shards at resume).

    Raises:
        KeyError: a constant missing from ``index``.
    """
    for u in units:
        for local, (hf_name, value) in model.constants[u.index].items():
            fresh = torch.empty_like(value)
            read_into(index[hf_name], fresh.view(-1))
            model.set_constant(u.index, local, fresh)


def load_hf_weights(
    model_dir: str | Path, store: HostStore, units: list[Unit], model: HFModel | None = None
) -> None:
    """Fill the fp32 master weights of ``units`` from a HF model directory, converting dtype.

    Args:
        model_dir: a ``save_pretrained`` directory.
        store: the host store.
        units: the units this rank owns.
        model: when given, the whole directory is checked first (:func:`check_model_dir`);
            otherwise only the tensors of ``units`` are checked for presence and shape.

    Raises:
        ValueError: as :func:`check_model_dir` (all problems listed); a tensor holds NaN or inf
            (every such tensor named).
    """
    if model is not None:
        index = check_model_dir(model_dir, model)
    else:
        index = read_index(model_dir)
        problems = []
        for p in (p for u in units for p in u.params):
            if p.hf_name not in index:
                problems.append(f"missing tensor {p.hf_name}")
            elif index[p.hf_name].shape != p.shape:
                problems.append(f"{p.hf_name}: shape {index[p.hf_name].shape}, the model needs {p.shape}")
        if problems:
            raise ValueError(
                f"model.init_from={str(model_dir)!r} does not match the model:\n  " + "\n  ".join(problems)
            )
    nonfinite = load_units(index, store, units, model=model)
    if nonfinite:
        raise ValueError(
            f"model.init_from={str(model_dir)!r}: {len(nonfinite)} tensor(s) hold NaN or inf:\n  "
            + "\n  ".join(nonfinite)
        )
