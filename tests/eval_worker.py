"""Evaluate a saved HF model twice with nodetrain's Engine and report what changed; started by torchrun.

Not a test itself: ``test_eval.py`` launches it (gloo, one stage per rank) and compares the losses
with plain ``transformers`` in eval mode. One spec (JSON):

    {"arch": ..., "hf": {...}, "model_dir": "<save_pretrained dir>", "batch_file": "<safetensors
     with inputs, labels: int64 [N, B, T]>", "out_dir": "<dir>", "store_dir": "<dir>"}

Writes ``<out_dir>/rank<r>.json``: ``losses`` (the two evaluations' mean losses, nats/token),
``tokens``, ``rng_unchanged`` (the CPU RNG state after both equals the one before) and
``train_mode`` (every template module is back in train mode).

    python -m torch.distributed.run --nproc_per_node 2 tests/eval_worker.py spec.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from nodetrain.checkpoint import load_hf_weights
from nodetrain.config.schema import Config, ModelConfig, validate
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config
from nodetrain.run.jobs import exit_process


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = load_file(spec["batch_file"])
    inputs, labels = batch["inputs"], batch["labels"]  # [N, B, T] int64
    cfg = Config()
    cfg.model = ModelConfig(name="eval", arch=spec["arch"], hf=dict(spec["hf"]))
    num_mb, cfg.train.micro_batch_size, cfg.train.seq_len = inputs.shape
    cfg.train.dtype = "float32"
    cfg.pipeline.stages, cfg.pipeline.microbatches = world, num_mb
    cfg.data.vocab_size, cfg.store.dir = spec["hf"]["vocab_size"], spec["store_dir"]
    cfg.data.tokenizer = spec["model_dir"]  # save_seeded_model's VOCAB-id tokenizer
    validate(cfg, world, int(os.environ["LOCAL_WORLD_SIZE"]))
    model = HFModel(build_hf_config(cfg.model))
    assert model.has_dropout, "the spec must set attention_dropout > 0"

    def init_from(store, units):
        load_hf_weights(spec["model_dir"], store, units, model)

    engine = build_engine(
        cfg,
        model,
        rank=rank,
        world_size=world,
        local_rank=int(os.environ["LOCAL_RANK"]),
        run_id=f"eval-{os.getppid()}",
        device=torch.device("cpu"),
        init_from=init_from,
    )
    torch.manual_seed(1234 + rank)
    rng_before = torch.get_rng_state()
    results = [engine.eval_loss(inputs, labels) for _ in range(2)]
    report = {
        "losses": [loss for loss, _ in results],
        "tokens": results[0][1],
        "rng_unchanged": bool(torch.equal(torch.get_rng_state(), rng_before)),
        "train_mode": all(m.training for t in model.templates for m in t.modules()),
    }
    (Path(spec["out_dir"]) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # skip the interpreter's teardown: ~0.8 s of CPU per rank (run/jobs.py)
