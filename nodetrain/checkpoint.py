"""Hugging Face safetensors import into the host store.

Owns: reading a HF model directory (``model.safetensors`` or sharded ``*.safetensors`` with
``model.safetensors.index.json``) tensor by tensor straight into the fp32 master weights of the
units a rank owns, so no process ever holds a second full copy. safetensors and JSON only: no
pickle is ever loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from nodetrain.model import Unit
from nodetrain.store import HostStore

__all__ = ["safetensors_index", "load_hf_weights"]


def safetensors_index(model_dir: str | Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file of a HF model directory.

    Raises:
        FileNotFoundError: no ``model.safetensors`` nor ``model.safetensors.index.json`` in the dir.
    """
    model_dir = Path(model_dir).expanduser()
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"model.init_from={str(model_dir)!r} holds no model.safetensors or "
            "model.safetensors.index.json; point it at a save_pretrained() directory"
        )
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_hf_weights(model_dir: str | Path, store: HostStore, units: list[Unit]) -> None:
    """Fill the fp32 master weights of ``units`` from a HF model directory, converting dtype.

    Raises:
        ValueError: tensors missing from the checkpoint or of the wrong shape (all listed).
    """
    index = safetensors_index(model_dir)
    problems, handles = [], {}
    try:
        for u in units:
            master = store.master(u.index)
            for p in u.params:
                if p.hf_name not in index:
                    problems.append(f"missing tensor {p.hf_name}")
                    continue
                file = index[p.hf_name]
                if file not in handles:
                    handles[file] = safe_open(file, framework="pt")
                t = handles[file].get_tensor(p.hf_name)
                if tuple(t.shape) != p.shape:
                    problems.append(
                        f"{p.hf_name}: shape {tuple(t.shape)} in the checkpoint, model needs {p.shape}"
                    )
                    continue
                master[p.offset : p.offset + p.numel].copy_(t.reshape(-1).to(torch.float32))
    finally:
        handles.clear()
    if problems:
        raise ValueError(
            f"model.init_from={str(model_dir)!r} does not match model.arch/model.hf:\n  "
            + "\n  ".join(problems)
        )
