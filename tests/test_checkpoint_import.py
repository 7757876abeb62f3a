"""``model.init_from``: a sharded HF directory written by ``transformers`` is imported into the host
store, and nodetrain's step-0 loss on a fixed batch equals ``transformers``' own loss for that
model and batch (fp32 compute, 1e-5) — Llama from fp32 shards on one stage, tied Qwen3 from bf16
shards on two. Launched with torchrun through ``parity_worker.py``, which imports with the
whole-directory check (names, shapes, architecture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

WORKER = Path(__file__).resolve().parent / "parity_worker.py"
SEQ_LEN, MICRO_BATCH, MICROBATCHES, VOCAB = 16, 2, 2, 256
HF = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
CASES = [
    # id, arch, dtype of the saved shards, stages, extra HF fields
    ("llama-fp32-1stage", "LlamaForCausalLM", torch.float32, 1, {"tie_word_embeddings": False}),
    (
        "qwen3-bf16-tied-2stages",
        "Qwen3ForCausalLM",
        torch.bfloat16,
        2,
        {"tie_word_embeddings": True, "head_dim": 16},
    ),
]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """inputs, labels: [1 step, N micro-batches, B, T] int64; a few labels ignored (-100)."""
    gen = torch.Generator().manual_seed(3)
    shape = (1, MICROBATCHES, MICRO_BATCH, SEQ_LEN)
    inputs = torch.randint(0, VOCAB, shape, generator=gen)
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < 0.1] = -100
    return inputs, labels


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_step0_loss_of_imported_model_equals_transformers(
    case, tmp_path: Path, shm_dir: Path, torchrun
) -> None:
    name, arch, dtype, stages, extra = case
    hf = {**HF, **extra}
    torch.manual_seed(11)
    model = getattr(transformers, arch)(getattr(transformers, arch.replace("ForCausalLM", "Config"))(**hf))
    model.to(dtype).save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2, "the import must read several shards"
    inputs, labels = _batch()
    save_file({"inputs": inputs, "labels": labels}, str(tmp_path / "batch.safetensors"))
    (tmp_path / "out").mkdir()
    spec = {
        "arch": arch,
        "hf": hf,
        "overrides": {
            "train.dtype": "float32",
            "train.seq_len": SEQ_LEN,
            "train.micro_batch_size": MICRO_BATCH,
            "train.steps": 1,
            "data.vocab_size": VOCAB,
            "pipeline.stages": stages,
            "pipeline.microbatches": MICROBATCHES,
            "store.dir": str(shm_dir),
        },
        "model_dir": str(tmp_path / "hf"),
        "batch_file": str(tmp_path / "batch.safetensors"),
        "out_dir": str(tmp_path / "out"),
        "run_id": f"import-{name}",
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    torchrun(stages, WORKER, str(tmp_path / "spec.json"), timeout_s=150)
    got = json.loads((tmp_path / "out" / "steps.json").read_text())[0]["loss"]

    ref = getattr(transformers, arch).from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids, lab = inputs[0].flatten(0, 1), labels[0].flatten(0, 1)  # [N·B, T]
    with torch.no_grad():
        logits = ref.train()(input_ids=ids).logits  # train mode as nodetrain; no dropout configured
    want = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100).item()
    assert got == pytest.approx(want, rel=1e-5, abs=0)
