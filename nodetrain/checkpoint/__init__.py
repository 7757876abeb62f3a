"""Checkpoints: Hugging Face safetensors import, atomic save, exact resume (no pickle anywhere).

Modules: ``tensors`` (safetensors by byte range, no mmap), ``hf_import`` (``model.init_from``),
``state`` (trainer_state.json, RNG, manifests, verification), ``writer`` (snapshot, background
write, atomic commit), ``resume`` (pick, verify, load by HF name for any stage count),
``collective`` (JSON between ranks), ``checkpointing`` (what train.py calls).
Must not import data, run, engine, plan or train (only config, store, model, optim).
"""

from nodetrain.checkpoint.checkpointing import Checkpointing
from nodetrain.checkpoint.hf_import import check_model_dir, load_hf_weights, load_units
from nodetrain.checkpoint.state import CheckpointError, complete_checkpoints, verify
from nodetrain.checkpoint.tensors import read_header, read_index, read_into

__all__ = [
    "Checkpointing",
    "CheckpointError",
    "check_model_dir",
    "complete_checkpoints",
    "load_hf_weights",
    "load_units",
    "read_header",
    "read_index",
    "read_into",
    "verify",
]
