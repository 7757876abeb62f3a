"""The embedding by rows (items 4/5 of issue 14): gathered rows in, a sparse row gradient out.

Window level: ``gather_rows`` returns exactly the transfer copy's rows and counts only their bytes;
``offload_rows`` scatter-adds into the fp32 accumulator, which the sequence's first write zeroes
(rows no micro-batch used end at zero, not at last step's value), in either order with the tied
head's dense gradient of the same weight. Stage level, in process: one stage (embedding by rows,
a decoder layer, the chunked head) gives the loss and every weight gradient of plain
``transformers`` autograd, tied and untied, with a padding id whose row gets no gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from nodetrain.cost import memory as cost_memory
from nodetrain.engine.device.window import Window
from nodetrain.engine.linear_ce import IGNORE_INDEX
from nodetrain.engine.stage import StageRunner
from nodetrain.model import Binding, HFModel
from nodetrain.run.inject import Faults
from nodetrain.store import HostStore, StoreLayout

V, D = 8, 4
UNIT_NUMELS = (V * D, 20, 20)
BINDINGS = [
    (Binding("weight", 0, 0, (V, D)),),
    (Binding("a", 1, 0, (4, 4)), Binding("b", 1, 16, (4,))),
    (Binding("w", 2, 0, (4, 4)), Binding("n", 2, 16, (4,)), Binding("lm_head.weight", 0, 0, (V, D))),
]


@pytest.fixture
def store(shm_dir):
    s = HostStore.create(StoreLayout(UNIT_NUMELS, torch.float32, tied_units=(0,)), shm_dir, "rows-test")
    s.unlink()
    return s


@pytest.fixture
def window(store):
    w = Window(store, BINDINGS, [0, 1, 2], 2, "cpu", faults=Faults(copy_delay_s=0.002), rows=[0])
    yield w
    w.close()


def test_gather_rows_reads_the_transfer_copy_and_counts_its_rows(store, window) -> None:
    store.compute(0).copy_(torch.randn(V * D))
    index = torch.tensor([1, 5, 6])
    window.begin([])
    rows = window.gather_rows(0, index)
    torch.testing.assert_close(rows, store.compute(0).view(V, D)[index], rtol=0, atol=0)
    assert window.take_stats()["h2d_bytes"] == 3 * D * 4  # not V × D
    window.flush()


@pytest.mark.parametrize("head_first", [True, False], ids=["dense-then-rows", "rows-then-dense"])
def test_row_gradients_scatter_add_and_the_first_write_zeroes(store, window, head_first: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    store.grad(0).fill_(7.0)  # last step's gradient: must not survive
    idx1, idx2 = torch.tensor([0, 3, 5]), torch.tensor([3, 6])
    g1, g2 = torch.randn(3, D, generator=gen), torch.randn(2, D, generator=gen)
    dense = torch.randn(V, D, generator=gen)
    window.begin([])
    if head_first:
        window.offload(2, {"lm_head.weight": dense})
    window.offload_rows(0, idx1, g1)
    window.offload_rows(0, idx2, g2)
    if not head_first:
        window.offload(2, {"lm_head.weight": dense})
    window.flush()
    want = dense.clone()
    want[idx1] += g1
    want[idx2] += g2  # row 3 twice; rows 1, 2, 4, 7 only the dense part
    torch.testing.assert_close(store.grad(0).view(V, D), want)
    assert window.take_stats()["d2h_bytes"] == (3 + 2) * D * 4 + V * D * 4
    window.begin([])  # the next step: its first write zeroes again
    window.offload_rows(0, idx2, g2)
    window.flush()
    want = torch.zeros(V, D)
    want[idx2] = g2
    torch.testing.assert_close(store.grad(0).view(V, D), want)


# ---- one stage against transformers ---------------------------------------------------------


def _hf(tied: bool) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        tie_word_embeddings=tied,
        max_position_embeddings=32,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(cfg).float()


def _engine_grads(hf, shm_dir, ids, labels, scale: float, rows: bool):
    model = HFModel(hf.config)
    layout = StoreLayout(tuple(u.numel for u in model.units), torch.float32, (0,) if model.tied else ())
    store = HostStore.create(layout, shm_dir, "rows-stage")
    store.unlink()
    state = hf.state_dict()
    for u in model.units:
        for p in u.params:
            store.master(u.index)[p.offset : p.offset + p.numel].copy_(state[p.hf_name].reshape(-1))
        store.compute(u.index).copy_(store.master(u.index))
    blocks = range(len(model.units))
    window = Window(store, model.bindings, blocks, 1, "cpu", rows=[0] if rows else [])
    try:
        runner = StageRunner(model, blocks, window, torch.float32)
        window.begin(runner.loads("F") + runner.loads("B"))
        loss = runner.forward(0, ids, labels, True, None, scale)
        assert runner.backward(0, None) is None
        window.flush()
        stats = window.take_stats()
        window.begin(runner.loads("F"))  # evaluation: the loss only, nothing offloaded or kept
        assert runner.forward(1, ids, labels, keep=False) == loss
        window.flush()
        assert window.take_stats()["d2h_bytes"] == 0 and not runner._saved
    finally:
        window.close()
    grads = {
        p.hf_name: store.grad(u.index)[p.offset : p.offset + p.numel].view(p.shape).clone()
        for u in model.units
        for p in u.params
    }
    return loss, grads, stats


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("rows", [True, False], ids=["rows", "dense"])
def test_one_stage_matches_transformers_autograd(shm_dir, monkeypatch, tied: bool, rows: bool) -> None:
    monkeypatch.setattr(cost_memory, "CHUNK_LOGITS_BYTES", 5 * 48 * 4)  # 5-token chunks: 24 tokens in 5
    hf = _hf(tied)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 48, (2, 12), generator=gen)
    ids[1, :4] = 0  # left padding, attended to by later tokens, but its row gets no gradient (padding_idx=0)
    labels = torch.randint(0, 48, (2, 12), generator=gen)
    labels[1, :4] = IGNORE_INDEX
    scale = 1.0 / int((labels != IGNORE_INDEX).sum())
    logits = hf(input_ids=ids).logits
    want_loss = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    (want_loss * scale).backward()
    loss, grads, stats = _engine_grads(hf, shm_dir, ids, labels, scale, rows)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=0)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    emb = grads["model.embed_tokens.weight"]
    if not tied:  # unused rows and the padding row: exactly zero
        used = torch.zeros(48, dtype=torch.bool)
        used[ids[ids != 0]] = True
        assert emb[~used].abs().sum() == 0 and emb[used].abs().sum() > 0
    if rows:  # the embedding crossed as its distinct rows, once each way
        rows_bytes = len(torch.unique(ids)) * 16 * 4
        layer = sum(p.numel() for n, p in hf.named_parameters() if ".layers." in n) * 4
        head = (16 + 48 * 16) * 4  # final norm + lm_head (the tied one binds the embedding's V × D)
        assert stats["h2d_bytes"] == rows_bytes + 2 * layer + head  # layer: forward + recompute; head once
        assert stats["d2h_bytes"] == rows_bytes + layer + head
