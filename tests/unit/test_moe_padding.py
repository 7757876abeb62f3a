"""Padding does not vote in a mixture of experts' router auxiliary loss (issue 32, item 4), end to end.

tests/parity/test_families.py holds the stage code to transformers' ``load_balancing_loss_func`` with an
``attention_mask`` (PR #28517). Here the path from the data to the engine: packed rows know their
padding (``PackedRows.num_tokens``, written with the records and read back), the training loop
hands a step's ``token_mask`` to ``Engine.train_step``, and a one-stage engine (a gloo world of
one, fp32, Qwen3-MoE with ``model.router_aux_loss=per_layer``) reports the step's ``aux_loss`` and
loss that transformers computes on the same weights and right-padded rows with their attention mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from chat_fixtures import MULTI_TURN, qwen3_tokenizer, save
from family_configs import FIELDS, TINY
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from bench._engine import base_config
from nodetrain import train
from nodetrain.config.batch import BatchShape
from nodetrain.config.schema import DataConfig, ModelConfig
from nodetrain.data.packing import IGNORE_INDEX, pack, pairs
from nodetrain.data.sft import RecordsDataset, prepare_records
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config, router_aux_of

ARCH = "Qwen3MoeForCausalLM"
M, B, T = 2, 2, 12


def test_packed_rows_know_their_padding() -> None:
    docs = [pairs(np.arange(n), np.ones(n, bool)) for n in (6, 9, 4)]  # inputs of 5, 8 and 3 tokens
    rows = pack(docs, 10, pad_id=0, packing=False)
    assert rows.num_tokens.tolist() == [5, 8, 3]
    mask = rows.token_mask(0, 0, 3)
    x, _, _ = rows.batch(0, 0, 3)
    assert sorted(mask.sum(1).tolist()) == [3, 5, 8] and (x[~mask] == 0).all()
    full = pack([pairs(np.arange(11), np.ones(11, bool))] * 2, 10, pad_id=0, packing=True)
    assert full.token_mask(0, 0, 2) is None, "no padding: nothing to leave out"


def test_the_training_loop_hands_the_records_padding_to_the_engine(tmp_path: Path) -> None:
    """Unpacked records, read back from disk: ``train._step_batch`` gives each row's mask."""
    tok_dir = save(qwen3_tokenizer(), tmp_path / "tok")
    chats = [MULTI_TURN[:3], MULTI_TURN] * 2
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    cfg = DataConfig(source=str(tmp_path / "r.jsonl"), dir=str(tmp_path / "rows"), tokenizer=str(tok_dir))
    cfg.format, cfg.val_fraction, cfg.packing = "records", 0.25, False
    ds = RecordsDataset.open(prepare_records(cfg, seq_len=160), "train")
    shape = BatchShape(micro_batch_size=1, seq_len=160, microbatches=3, grad_accum=1)
    x, y, _, mask = train._step_batch(ds, shape, 0, 0, 3)
    lengths = sorted(int(n) for n in mask.sum(dim=(1, 2)))
    assert mask.shape == x.shape == (3, 1, 160) and lengths == sorted(ds.num_tokens.tolist())
    assert (y[~mask] == IGNORE_INDEX).all() and lengths[0] < lengths[-1] < 160


def _reference(model: HFModel, store) -> transformers.PreTrainedModel:
    """transformers' model with the engine's initial master weights."""
    ref = transformers.Qwen3MoeForCausalLM(model.config).float().train()
    state = {}
    for u in model.units:
        for p in u.params:
            state[p.hf_name] = store.master(u.index)[p.offset : p.offset + p.numel].view(p.shape).clone()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in n for n in missing), missing
    return ref


@pytest.mark.usefixtures("one_rank_world")
def test_an_engine_step_leaves_padding_out_of_the_router_statistics(shm_dir) -> None:
    hf = {**TINY, **FIELDS[ARCH], "router_aux_loss_coef": 0.5}
    cfg = base_config(
        ModelConfig(name="moe", arch=ARCH, hf=hf, router_aux_loss="per_layer"),
        train={"seq_len": T, "micro_batch_size": B, "dtype": "float32", "steps": 1},
        pipeline={"stages": 1, "microbatches": M},
    )
    cfg.store.dir, cfg.data.vocab_size, cfg.optim.max_grad_norm = str(shm_dir), hf["vocab_size"], 0.0
    config = build_hf_config(cfg.model)
    model = HFModel(config, router_aux_of(cfg, config, M))
    engine = build_engine(
        cfg, model, rank=0, world_size=1, local_rank=0, run_id="moe-pad", device=torch.device("cpu")
    )
    try:
        ref = _reference(model, engine.store)
        gen = torch.Generator().manual_seed(4)
        ids = torch.randint(0, hf["vocab_size"], (M, B, T), generator=gen)
        labels = torch.randint(0, hf["vocab_size"], (M, B, T), generator=gen)
        keep = torch.tensor([[9, 12], [5, 11]])  # tokens per row, the rest padding
        mask = torch.arange(T)[None, None, :] < keep[..., None]  # [M, B, T]
        labels[~mask] = IGNORE_INDEX
        ce, aux, num_moe = 0.0, 0.0, 2  # layers 1 and 2 route (layer 0 is dense)
        with torch.no_grad():
            for mb in range(M):
                out = ref(input_ids=ids[mb], attention_mask=mask[mb].long(), output_router_logits=True)
                target = labels[mb].flatten()
                ce += float(F.cross_entropy(out.logits.flatten(0, 1), target, reduction="sum"))
                layers = [z for z in out.router_logits if z is not None]
                assert len(layers) == num_moe
                aux += sum(float(load_balancing_loss_func((z,), 4, 2, mask[mb].long())) for z in layers)
        aux /= num_moe * M
        r = engine.train_step(0, ids, labels, token_mask=mask)
    finally:
        engine.close()
    tokens = int((labels != IGNORE_INDEX).sum())
    assert r.aux_loss == pytest.approx(aux, rel=1e-6)
    assert r.loss == pytest.approx(ce / tokens + 0.5 * aux, rel=1e-6)
