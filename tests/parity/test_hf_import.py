"""Importing Hugging Face directories as published checkpoints ship them (issue 10, items 1-3, 6).

The reference is always what ``transformers`` itself builds from the same directory
(``AutoModelForCausalLM.from_pretrained``): a hub-style Llama-3 ``config.json`` (legacy top-level
``rope_scaling: {rope_type: llama3}`` and ``rope_theta``), a padded vocabulary (320 embedding rows,
a 300-id tokenizer) and Llama-2-era ``rotary_emb.inv_freq`` buffers in the weights, imported with
the one key ``model.init_from`` while the default model group (``llama_10m``, plain RoPE, 8 layers)
is selected. The model that trains must give transformers' logits and loss.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import TINY_RUN, job_env, prepared_dir, torchrun_cmd
from safetensors.torch import load_file, save_file

from nodetrain.checkpoint.hf_import import check_model_dir, load_hf_weights
from nodetrain.config.schema import ModelConfig
from nodetrain.data import reader
from nodetrain.data.checks import check_vocab
from nodetrain.model import HFModel, build_hf_config
from nodetrain.store import HostStore, StoreLayout

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,  # short, so that 16-token sequences feel the scaling
}
GROUP_HF = {  # conf/model/llama_10m.yaml: the default group, whose shape must not win
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _hub_llama(path: Path, inv_freq: bool = True) -> None:
    """A tiny Llama-3-style checkpoint as the hub ships it: legacy rope keys, vocab padded to 320,
    and (``inv_freq``) one rotary ``inv_freq`` buffer per layer in the weights file."""
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(raw))
    if inv_freq:
        weights = load_file(str(path / "model.safetensors"))
        for i in range(2):
            weights[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def _reference(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model: HFModel, store: HostStore, x: torch.Tensor) -> torch.Tensor:
    """Every block in order with the store's fp32 master weights bound: [B, T] ids -> [B, T, V]."""
    h = x
    for i in range(len(model.units)):
        params = {
            b.local_name: store.master(b.unit)[b.offset : b.offset + b.numel].view(b.shape)
            for b in model.bindings[i]
        }
        ctx = model.context(h) if 0 < i < len(model.units) - 1 else None
        h = model.forward_block(i, params, h, ctx)
    return h


def test_hub_llama3_imports_as_transformers_builds_it(tmp_path: Path, shm_dir: Path, caplog) -> None:
    _hub_llama(tmp_path / "hf")
    cfg = ModelConfig(name="llama_10m", hf=dict(GROUP_HF), init_from=str(tmp_path / "hf"))
    model = HFModel(build_hf_config(cfg, vocab_size=300))  # 300: the tokenizer's ids
    assert model.config.vocab_size == 320, "the checkpoint's embedding rows win over the tokenizer"
    assert model.config.rope_parameters["rope_type"] == "llama3"
    with caplog.at_level(logging.INFO):
        index = check_model_dir(tmp_path / "hf", model)
    assert "skipping 2 non-parameter buffer(s)" in caplog.text
    assert not any(n.endswith("inv_freq") for u in model.units for n in (p.hf_name for p in u.params))
    store = HostStore.create(StoreLayout(tuple(u.numel for u in model.units), torch.float32), shm_dir, "imp")
    try:
        load_hf_weights(tmp_path / "hf", store, model.units, model)
        x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))  # [2, 16]
        with torch.no_grad():
            got = _logits(model, store, x)  # [2, 16, 320]
            want = _reference(tmp_path / "hf")(input_ids=x).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        store.unlink()
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in index


def test_unknown_tensor_is_still_refused(tmp_path: Path) -> None:
    _hub_llama(tmp_path / "hf", inv_freq=False)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq_extra"] = torch.ones(8)
    weights["model.layers.0.mlp.adapter.weight"] = torch.ones(2, 2)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    model = HFModel(build_hf_config(ModelConfig(name="x", init_from=str(tmp_path / "hf"))))
    with pytest.raises(ValueError) as info:
        check_model_dir(tmp_path / "hf", model)
    assert "unexpected tensor model.layers.0.mlp.adapter.weight" in str(info.value)
    assert "unexpected tensor model.layers.0.self_attn.rotary_emb.inv_freq_extra" in str(info.value)


def test_rope_dialect_difference_is_an_error_unless_overridden(tmp_path: Path, caplog) -> None:
    """A run whose config comes from elsewhere (model.config_path) with plain RoPE, weights from the
    hub-style directory: the legacy ``rope_scaling`` is compared (as transformers reads it)."""
    _hub_llama(tmp_path / "hf", inv_freq=False)
    plain = json.loads((tmp_path / "hf" / "config.json").read_text())
    del plain["rope_scaling"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(plain))
    cfg = ModelConfig(name="x", config_path=str(tmp_path / "plain"), init_from=str(tmp_path / "hf"))
    model = HFModel(build_hf_config(cfg))
    with pytest.raises(ValueError, match=r"rope_parameters: .*'rope_type': 'llama3'.*in the run"):
        check_model_dir(tmp_path / "hf", model)
    with caplog.at_level(logging.WARNING):
        check_model_dir(tmp_path / "hf", model, overrides={"rope_parameters"})
    assert "config differs from the run's model: rope_parameters" in caplog.text


def test_one_key_import_trains_transformers_model(tmp_path: Path, corpus: list[str]) -> None:
    """``model.init_from=<dir>`` alone, default model group selected: step-1 loss on 2 stages equals
    transformers' loss on the same batch (issue 10: 5.937778, not plain RoPE's 5.938977)."""
    _hub_llama(tmp_path / "hf")
    run = tmp_path / "run"
    overrides = [*TINY_RUN, *corpus, "train.dtype=float32", "train.steps=1", "train.eval_every=0", "seed=0"]
    overrides += ["logging.wandb=false", f"store.dir={tmp_path}", f"model.init_from={tmp_path / 'hf'}"]
    overrides += ["data.tokenizer=bpe"]  # the directory holds no tokenizer: a BPE on purpose (issue 15)
    cmd = torchrun_cmd(2, "-m", "nodetrain.train", f"hydra.run.dir={run}", *overrides)
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    got = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert "model.hf of model=llama_10m" in (run / "rank0.log").read_text(), "the unused group is logged"

    prepared = prepared_dir(corpus[1].split("=", 1)[1])
    x, y = reader.batch(reader.TokenDataset.open(prepared, "train"), 0, 0, 4, 16)  # step 0, seed 0
    with torch.no_grad():
        logits = _reference(tmp_path / "hf")(input_ids=x).logits  # [4, 16, 320]
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert got == pytest.approx(want, rel=1e-5, abs=0)


def test_tokenizer_with_more_ids_than_the_checkpoint_rows_is_the_error(tmp_path: Path) -> None:
    """Padded vocabularies are fine (320 rows, 300 ids: above); the reverse (280 rows) is refused."""
    _hub_llama(tmp_path / "hf", inv_freq=False)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps({**raw, "vocab_size": 280}))
    rows = build_hf_config(
        ModelConfig(name="x", init_from=str(tmp_path / "small")), vocab_size=300
    ).vocab_size
    assert rows == 280
    tokenizer = SimpleNamespace(vocab_size=300, path=tmp_path / "prepared" / "train.bin")
    with pytest.raises(ValueError, match=r"vocab_size=280 is smaller than the vocabulary .* \(300 ids"):
        check_vocab(rows, tokenizer)
    check_vocab(320, tokenizer)


def test_a_tied_checkpoint_that_stores_only_lm_head_imports_as_transformers_loads_it(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Issue 32, item 6: ``tie_word_embeddings: true`` and the one stored matrix named
    ``lm_head.weight`` (no ``model.embed_tokens.weight``): transformers fills the tied pair from it,
    and so does the import (the logits are transformers')."""
    _hub_llama(tmp_path / "hf", inv_freq=False)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ref = _reference(tmp_path / "hf")
    assert torch.equal(ref.model.embed_tokens.weight, weights["lm_head.weight"])
    model = HFModel(build_hf_config(ModelConfig(name="x", init_from=str(tmp_path / "hf"))))
    assert model.tied
    store = HostStore.create(StoreLayout(tuple(u.numel for u in model.units), torch.float32), shm_dir, "lmh")
    try:
        load_hf_weights(tmp_path / "hf", store, model.units, model)
        x = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))  # [2, 16]
        with torch.no_grad():
            torch.testing.assert_close(
                _logits(model, store, x), ref(input_ids=x).logits, rtol=1e-5, atol=1e-5
            )
    finally:
        store.unlink()
