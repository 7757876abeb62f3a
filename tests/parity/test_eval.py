"""Validation runs in eval mode: with attention dropout, nodetrain's validation loss equals plain
``transformers`` after ``model.eval()``, is the same twice in a row, draws no random numbers (the
training RNG stream is untouched) and leaves the templates in train mode.

A seeded tiny Llama with ``attention_dropout`` = 0.5 is saved with ``save_pretrained``; a 2-stage
gloo run (``eval_worker.py``) evaluates one batch of padded, variable-length micro-batches twice;
the reference is the same directory loaded by ``transformers``, one forward over the batch with
the attention mask, loss = Σ token cross-entropy / valid tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from test_parity import IGNORE, SEQ_LEN, Case, make_batches, save_seeded_model

WORKER = Path(__file__).resolve().parents[1] / "eval_worker.py"
CASE = Case(
    "llama-2stage-eval-dropout", "LlamaForCausalLM", 2, "1f1b", 2, 1, 4, hf={"attention_dropout": 0.5}
)


def _reference_loss(model_dir: Path, inputs, labels, lengths, train: bool) -> float:
    """Token-weighted mean cross-entropy of the batch ([N, B, T]) under plain transformers."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train(train)
    ids, lab = inputs.flatten(0, 1), labels.flatten(0, 1)  # [N·B, T]
    mask = (torch.arange(SEQ_LEN) < lengths.flatten()[:, None]).long()  # [N·B, T]
    with torch.no_grad():
        torch.manual_seed(0)
        logits = model(input_ids=ids, attention_mask=mask).logits  # [N·B, T, V]
    loss_sum = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss_sum.item() / int((lab != IGNORE).sum())


def test_validation_loss_is_eval_mode_and_draws_no_random_numbers(
    tmp_path: Path, shm_dir: Path, torchrun
) -> None:
    model_dir, out_dir = tmp_path / "model", tmp_path / "out"
    out_dir.mkdir()
    save_seeded_model(CASE, model_dir)
    inputs, labels, lengths = (t[0] for t in make_batches(CASE))  # one step's batch: [N, B, T]
    save_file({"inputs": inputs, "labels": labels}, str(tmp_path / "batch.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["attention_dropout"] == 0.5
    spec = {
        "arch": CASE.arch,
        "hf": {
            k: config[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
                "max_position_embeddings",
                "rms_norm_eps",
                "attention_dropout",
            )
        },
        "model_dir": str(model_dir),
        "batch_file": str(tmp_path / "batch.safetensors"),
        "out_dir": str(out_dir),
        "store_dir": str(shm_dir),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    torchrun(CASE.stages, WORKER, str(tmp_path / "spec.json"), timeout_s=150)
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(CASE.stages)]

    want = _reference_loss(model_dir, inputs, labels, lengths, train=False)
    dropped = _reference_loss(model_dir, inputs, labels, lengths, train=True)
    assert abs(dropped - want) > 1e-3, "dropout 0.5 should change the loss: the check below could not fail"
    for r in reports:
        first, second = r["losses"]
        assert first == second, "two evaluations in a row differ"
        torch.testing.assert_close(first, want, rtol=1e-5, atol=0.0)
        assert r["tokens"] == int((labels != IGNORE).sum())
        assert r["rng_unchanged"], "evaluation drew random numbers (the training stream moved)"
        assert r["train_mode"], "templates left in eval mode after evaluation"
