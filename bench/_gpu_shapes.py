"""The models, batches and learning rates of the GPU check, shared by its benchmarks.

``bench/gpu_train.py`` trains them with nodetrain and ``bench/gpu_peers.py`` with plain PyTorch and
FSDP2, so both sides of every comparison use one definition: the same model (with the same layer
count), sequence length, micro-batch size, micro-batches per step and FLOPs per token (nodetrain's
own count, ``run.breakdown.flops_per_token``: active parameters for a mixture of experts).

Not a benchmark itself.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["DENSE", "MOE", "SHAPES", "GpuShape", "fit_layers", "store_bytes"]


@dataclass(frozen=True)
class GpuShape:
    """One model of the GPU check.

    Attributes:
        name: ``dense`` or ``moe`` (``--shape`` of the benchmarks).
        model: ``conf/model/<model>.yaml``.
        layers: decoder layers on the GPU machine (``gpu_train.fit_layers`` may shorten it further).
        dry_run_hf: ``model.hf`` fields of the CPU dry run's tiny version; dry_run_layers: its layers.
        lr: constant learning rate on the GPU (no warm-up; ``optim.min_lr`` = ``optim.lr``): AdamW at
            1e-5 takes a randomly initialised 3B model's loss from 12.4 to 8.3 in 5 steps (the fp32-master
            peers of the 2026-12-04 H200 run), where the default 3e-3 with 2 warm-up steps spiked it to 27.6.
    """

    name: str
    model: str
    layers: int
    dry_run_hf: dict = field(default_factory=dict)
    dry_run_layers: int = 2
    lr: float = 1e-5

    def batch(self, dry_run: bool) -> tuple[int, int, int]:
        """(sequence length, micro-batch size, micro-batches per step): 32,768 tokens per step on the GPU."""
        return (64, 2, 2) if dry_run else (4096, 2, 4)

    def train_lr(self, dry_run: bool) -> float:
        """The learning rate: ``lr`` on the GPU; 1e-3 for the dry run's tiny model (whose loss moves
        visibly in 3 steps there)."""
        return 1e-3 if dry_run else self.lr

    def model_cfg(self, layers: int, dry_run: bool):
        """``conf/model/<model>.yaml`` as a typed ``ModelConfig`` with ``layers`` decoder layers (and the
        dry run's fields)."""
        from omegaconf import OmegaConf

        from nodetrain.config.schema import ModelConfig

        yaml = OmegaConf.load(ROOT / "conf" / "model" / f"{self.model}.yaml")
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml))
        cfg.hf["num_hidden_layers"] = layers
        if dry_run:
            cfg.hf.update(self.dry_run_hf)
        return cfg

    def overrides(self, layers: int, dry_run: bool) -> list[str]:
        """The Hydra overrides that select this model with ``layers`` decoder layers."""
        out = [f"model={self.model}", f"model.hf.num_hidden_layers={layers}"]
        if dry_run:
            out += [f"model.hf.{k}={v}" for k, v in self.dry_run_hf.items()]
        return out

    def hf_model(self, layers: int, dry_run: bool):
        """nodetrain's adapter of the model (templates on the meta device: no memory)."""
        from nodetrain.model import HFModel, build_hf_config

        return HFModel(build_hf_config(self.model_cfg(layers, dry_run)))

    def flops_per_token(self, layers: int, dry_run: bool) -> float:
        """Model FLOPs per trained token, as nodetrain's MFU counts them (6·N active + attention)."""
        from nodetrain.run.breakdown import flops_per_token

        model = self.hf_model(layers, dry_run)
        n = sum(model.block_cost(i) for i in range(len(model.units)))
        seq, _, _ = self.batch(dry_run)
        return flops_per_token(model.config, n, model.num_layers, seq)


_TINY = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 128,
}

DENSE = GpuShape("dense", "llama3_2_3b", 28, {**_TINY, "intermediate_size": 512}, dry_run_layers=4)
"""Llama-3.2-3B (3.2B parameters, tied): its host store (~59 GB) fits a 128 GiB node's /dev/shm."""

MOE = GpuShape(
    "moe",
    "qwen3_30b_a3b",
    2,
    {
        **_TINY,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
)
"""Qwen3-30B-A3B shortened to 2 of its 48 layers (1.87B parameters, 0.43B active per token of which
0.31B are the untied 151,936 × 2048 head): a host store of ~35 GB, so its start-up and steps fit the
check's 7 minutes next to the dense runs."""

SHAPES = {s.name: s for s in (DENSE, MOE)}


def store_bytes(shape: GpuShape, layers: int, dry_run: bool) -> int:
    """Host store bytes of ``shape`` with ``layers`` decoder layers (bf16 transfer copies, full state)."""
    import torch

    from nodetrain.store import StoreLayout

    model = shape.hf_model(layers, dry_run)
    units = tuple(u.numel for u in model.units)
    return StoreLayout(units, torch.bfloat16, tied_units=(0,) if model.tied else ()).nbytes


def fit_layers(shape: GpuShape, store_dirs: list[str], dry_run: bool) -> tuple[int, int, int, str]:
    """(layers, store bytes, room, directory): the most layers (at most ``shape.layers``, or its dry
    run's) whose host store fits 90% of the available memory and the free space of the roomiest of
    ``store_dirs`` (a container's /dev/shm may be small; a disk-backed directory then holds the store
    in the page cache)."""
    import psutil

    free = {d: shutil.disk_usage(d).free for d in store_dirs if os.path.isdir(d)}
    store_dir = max(free, key=free.get)
    room = min(free[store_dir], int(0.9 * psutil.virtual_memory().available))
    layers = shape.dry_run_layers if dry_run else shape.layers
    while layers > 1 and store_bytes(shape, layers, dry_run) > room:
        layers -= 1
    return layers, store_bytes(shape, layers, dry_run), room, store_dir
