"""Host syncs and data moves per step, not per action (issue 19, part 5, "Per-action host syncs").

On one real engine step (one stage, gloo, in this process), ``bench/_sync_count.SyncCounter``
counts on the training thread the scalar reads (``aten._local_scalar_dense``: a device sync each
on CUDA) and the moves of the step's data (integer tensors ``.to(device)`` / ``copy_``), and:

* neither grows with the number of micro-batches (M = 2 against M = 8), for a streamed embedding
  (rows) and a resident (dense) one, training and evaluation; the moves are exactly one per
  tensor the step needs on the device;
* transformers' packed-sequence detection (``find_packed_sequence_indices``, whose ``.all()`` is a
  device sync) runs only on packed micro-batches: never without position ids, and in a batch
  mixing packed and unpacked micro-batches only on the packed ones;
* the loss of such a mixed batch (training step and evaluation) equals plain ``transformers``
  run on the same micro-batches with their position ids (fp32, 1e-5);
* the streamed embedding's row indices and padding flags, made for the whole step at once, are
  those of each micro-batch alone (``torch.unique``).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import single_process_world
from transformers import masking_utils

from bench._engine import base_config, model_config
from bench._sync_count import SyncCounter
from nodetrain.engine.engine import Engine
from nodetrain.engine.linear_ce import IGNORE_INDEX
from nodetrain.engine.stage import StageRunner
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config

V, T = 256, 8
HF = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "pad_token_id": 0,
}
_ids = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def world():
    """A gloo world of one in this process, gone (with its environment) after the module."""
    with single_process_world():
        yield


@pytest.fixture
def engines(shm_dir):
    """``build(m, dense)``: a one-stage fp32 engine over M = ``m`` micro-batches of 1 × T tokens;
    ``dense`` makes the embedding resident (else it streams by rows). Closed afterwards."""
    built = []

    def build(m: int, dense: bool) -> Engine:
        cfg = base_config(
            model_config("llama_10m", V, **HF),
            train={"seq_len": T, "micro_batch_size": 1, "dtype": "float32", "steps": 4},
            pipeline={"stages": 1, "microbatches": m},
            stream={"device_budget": 1 << 30 if dense else 0},
        )
        cfg.data.vocab_size, cfg.store.dir = V, str(shm_dir)
        model = HFModel(build_hf_config(cfg.model))
        eng = build_engine(
            cfg,
            model,
            rank=0,
            world_size=1,
            local_rank=0,
            run_id=f"syncs{next(_ids)}",
            device=torch.device("cpu"),
        )
        assert (0 in eng.window.resident) == dense
        built.append(eng)
        return eng

    yield build
    for eng in built:
        eng.close()


def _batch(m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels [m, 1, T] int64; id 0 (the padding row) appears in every micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (m, 1, T + 1), generator=gen)
    ids[:, :, 0] = 0
    return ids[..., :-1].contiguous(), ids[..., 1:].contiguous()


def _mixed_positions(m: int) -> torch.Tensor:
    """[m, 1, T]: even micro-batches pack two documents (positions restart at 3), odd ones do not."""
    pos = torch.arange(T).repeat(m, 1, 1)
    pos[::2, :, 3:] = torch.arange(T - 3)
    return pos


def _counted_step(eng: Engine, m: int, positions=None) -> dict:
    x, y = _batch(m)
    eng.train_step(0, x, y, position_ids=positions)  # warm: first-step allocations are not the point
    with SyncCounter() as counter:
        eng.train_step(1, x, y, position_ids=positions)
    return counter.report()


@pytest.mark.parametrize("dense", [False, True], ids=["rows", "dense"])
@pytest.mark.parametrize("with_positions", [False, True], ids=["no-positions", "positions"])
def test_a_step_reads_and_moves_once_per_step_whatever_the_microbatches(engines, dense, with_positions):
    got = {}
    for m in (2, 8):
        positions = torch.arange(T).repeat(m, 1, 1) if with_positions else None  # given, not packed
        got[m] = _counted_step(engines(m, dense), m, positions)
    assert got[8]["scalar_reads"] == got[2]["scalar_reads"], got
    # one move per tensor the step needs on the device: labels; ids (dense) or the rows' indices
    # and padding flags (rows); the position ids when given
    want_moves = 1 + (1 if dense else 2) + with_positions
    assert got[2]["data_moves"] == got[8]["data_moves"] == want_moves, got


@pytest.mark.parametrize("dense", [False, True], ids=["rows", "dense"])
def test_an_evaluation_reads_and_moves_once(engines, dense):
    got = {}
    for m in (2, 8):
        eng = engines(m, dense)
        x, y = _batch(m)
        eng.eval_loss(x, y)
        with SyncCounter() as counter:
            eng.eval_loss(x, y)
        got[m] = counter.report()
    assert got[8]["scalar_reads"] == got[2]["scalar_reads"], got
    assert got[2]["data_moves"] == got[8]["data_moves"] == 1 + (1 if dense else 2), got


@pytest.fixture
def detections(monkeypatch):
    """The position ids transformers' packed-sequence detection was called with, in order."""
    calls = []
    real = masking_utils.find_packed_sequence_indices

    def record(position_ids):
        calls.append(position_ids.clone())
        return real(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", record)
    return calls


def test_unpacked_batches_skip_the_packing_detection(engines, detections):
    eng = engines(4, dense=False)
    x, y = _batch(4)
    eng.train_step(0, x, y)
    eng.eval_loss(x, y)
    assert detections == []


def test_only_packed_microbatches_run_the_packing_detection(engines, detections):
    m = 4
    eng = engines(m, dense=False)
    x, y = _batch(m)
    positions = _mixed_positions(m)
    eng.eval_loss(x, y, positions)
    packed = [positions[mb] for mb in range(0, m, 2)]  # one context per forward on one stage
    assert len(detections) == len(packed)
    for call, want in zip(detections, packed, strict=True):
        assert torch.equal(call, want)


def _reference(eng: Engine) -> transformers.LlamaForCausalLM:
    """Plain transformers with the engine's master weights (fp32)."""
    model = eng.model
    ref = transformers.LlamaForCausalLM(model.config).float()
    state = {}
    for u in model.units:
        master = eng.store.master(u.index)
        for p in u.params:
            state[p.hf_name] = master[p.offset : p.offset + p.numel].view(p.shape)
    ref.load_state_dict(state, strict=not model.tied)
    return ref


def test_a_mixed_packed_batch_gives_the_loss_of_transformers(engines):
    m = 4
    eng = engines(m, dense=False)
    x, y = _batch(m, seed=3)
    y[1, 0, :2] = IGNORE_INDEX
    positions = _mixed_positions(m)
    ref = _reference(eng)
    ref.config.use_cache = False  # transformers detects packing only without a KV cache
    with torch.no_grad():
        logits = torch.cat([ref(input_ids=x[mb], position_ids=positions[mb]).logits for mb in range(m)])
    tokens = int((y != IGNORE_INDEX).sum())
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    want = want.item() / tokens
    loss, n = eng.eval_loss(x, y, positions)
    assert n == tokens
    assert loss == pytest.approx(want, rel=1e-5, abs=0)
    crossed, _ = eng.eval_loss(x, y)  # without them, the packed micro-batches attend across documents
    assert abs(crossed - want) > 1e-4
    step = eng.train_step(0, x, y, position_ids=positions)  # the loss before this step's update
    assert step.loss == pytest.approx(want, rel=1e-5, abs=0)


def test_first_inputs_of_a_step_are_each_microbatch_alone() -> None:
    """The step's row indices and padding flags, made together, are those of each micro-batch alone."""
    config = build_hf_config(model_config("llama_10m", V, **HF))
    model = HFModel(config)
    window = SimpleNamespace(rows=[0], device=torch.device("cpu"))
    runner = StageRunner(model, range(len(model.units)), window, torch.float32)
    ids, _ = _batch(5, seed=4)
    ids[2, 0, 3:] = 7  # micro-batches with different numbers of distinct ids
    ids[3, 0, 0] = 9  # one without the padding id
    got = runner.first_inputs(ids)
    assert len(got) == 5
    for mb, rows in enumerate(got):
        index, inverse = torch.unique(ids[mb], return_inverse=True)
        assert torch.equal(rows.index, index) and torch.equal(rows.inverse, inverse)
        assert torch.equal(rows.padding, index == config.pad_token_id)
        assert torch.equal(rows.index[rows.inverse], ids[mb])
    assert not got[3].padding.any() and got[2].padding.sum() == 1
