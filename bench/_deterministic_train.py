"""``nodetrain.train`` with PyTorch's deterministic algorithms (``torchrun`` runs this file).

Same command line as ``python -m nodetrain.train``, one rank. Before anything touches CUDA it sets
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's reproducible workspace, which the CUDA docs require
for deterministic cuBLAS on CUDA >= 10.2) and ``torch.use_deterministic_algorithms(True,
warn_only=True)``: kernels with a deterministic variant (flash/efficient attention's backward,
index_add, scatter_add, cuBLAS) use it, and an op without one warns (``UserWarning: ... does not have
a deterministic implementation``) instead of failing, so ``bench/gpu_resume.py`` can name it. Not a
benchmark itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from nodetrain.config.registry import register_configs
from nodetrain.run.jobs import exit_process
from nodetrain.train import main

if __name__ == "__main__":  # as nodetrain/train.py's own, for one rank
    torch.use_deterministic_algorithms(True, warn_only=True)
    register_configs()
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_process(0)
