"""Saved block inputs offloaded to host RAM (issue 23, part 2: ``stream.offload_activations``).

On real one-stage engines in this process (a gloo world of one, fp32, attention dropout 0.1, so
every recompute replays the forward's random numbers), with the H2D worker slowed (2 ms before
each job: a backward that did not wait for its inputs' prefetch would read unfilled memory):

* a run with the offload equals the run without it bit for bit: every step's loss and gradient
  norm, every unit's gradient in the host store after every step and the master weights after the
  last, for GPipe (two rounds of micro-batches: the backward order spans rounds) and 1F1B (where
  each prefetch is queued behind the weight loads of its backward's first blocks, so only its own
  wait orders it: without it the recompute reads a tensor the copy is still writing);
* the bytes it moves each way per step are every saved input of every micro-batch once (closed
  form: micro-batches × (2 layer inputs + the head's input gradient) × B·T·D·4);
* the saved inputs alive on the device at once (``saved_peak_bytes``: weak references to each saved
  tensor, from the forward that makes it, or the prefetch that brings it back, until it is freed)
  are M micro-batches' worth without the offload (GPipe: M in flight) and at most two with it,
  at M = 2 and M = 6.

The two-stage case (P2P inputs, the last stage's head gradient) runs under torchrun in
tests/parity/test_parity.py (``test_activation_offload_is_bit_exact_on_two_stages``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import single_process_world

from bench._engine import base_config, model_config
from nodetrain.engine.engine import Engine
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config
from nodetrain.run.inject import Faults

V, T, B, D = 256, 8, 2, 32
SAVED = 3
"""Tensors a forward saves per micro-batch: the 2 layers' inputs and the head's input gradient."""
HF = {
    "hidden_size": D,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "attention_dropout": 0.1,
}
STEPS = 3
DELAY = 0.002
_ids = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def world():
    """A gloo world of one in this process, gone (with its environment) after the module."""
    with single_process_world():
        yield


def _engine(shm_dir, schedule: str, accum: int, m: int, offload: bool) -> Engine:
    cfg = base_config(
        model_config("llama_10m", V, **HF),
        train={"seq_len": T, "micro_batch_size": B, "dtype": "float32", "steps": STEPS, "grad_accum": accum},
        pipeline={"stages": 1, "microbatches": m, "schedule": schedule},
        stream={"device_budget": 0, "offload_activations": offload},
    )
    cfg.data.vocab_size, cfg.store.dir = V, str(shm_dir)
    model = HFModel(build_hf_config(cfg.model))
    assert model.has_dropout
    return build_engine(
        cfg,
        model,
        rank=0,
        world_size=1,
        local_rank=0,
        run_id=f"offload{next(_ids)}",
        device=torch.device("cpu"),
        faults=Faults(copy_delay_s=DELAY),
    )


def _train(eng: Engine, n: int, steps: int = STEPS) -> dict:
    """``steps`` steps of ``n`` micro-batches; per step the result and every unit's gradient, then
    the master weights. The RNG is seeded after the engine's start-up (which may draw from it)."""
    torch.manual_seed(0)
    ids = torch.randint(0, V, (steps, n, B, T + 1), generator=torch.Generator().manual_seed(1))
    out = {"steps": [], "grads": []}
    for step in range(steps):
        r = eng.train_step(step, ids[step, ..., :-1].contiguous(), ids[step, ..., 1:].contiguous())
        eng.wait_optimizer()
        out["steps"].append(r)
        out["grads"].append({u.name: eng.store.grad(u.index).clone() for u in eng.units})
    out["master"] = {u.name: eng.store.master(u.index).clone() for u in eng.units}
    eng.close()
    return out


@pytest.mark.parametrize(("schedule", "accum", "m"), [("gpipe", 2, 2), ("1f1b", 1, 4)])
def test_offload_is_bit_exact(shm_dir, schedule: str, accum: int, m: int) -> None:
    n = accum * m
    off = _train(_engine(shm_dir, schedule, accum, m, offload=False), n)
    on = _train(_engine(shm_dir, schedule, accum, m, offload=True), n)
    for a, b in zip(off["steps"], on["steps"], strict=True):
        assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
        assert not a.skipped and a.breakdown["stage0/act_d2h_bytes"] == 0
    for ga, gb in zip(off["grads"], on["grads"], strict=True):
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name
    for name in off["master"]:
        assert torch.equal(off["master"][name], on["master"][name]), name
    # every saved input left and came back once
    per_step = n * SAVED * B * T * D * 4
    for r in on["steps"]:
        assert r.breakdown["stage0/act_d2h_bytes"] == r.breakdown["stage0/act_h2d_bytes"] == per_step


def _saved_peak(shm_dir, m: int, offload: bool) -> int:
    eng = _engine(shm_dir, "gpipe", 1, m, offload)
    (step,) = _train(eng, m, steps=1)["steps"]
    return step.breakdown["stage0/saved_peak_bytes"]


def test_saved_inputs_on_the_device_stay_within_two_microbatches(shm_dir) -> None:
    per_mb = SAVED * B * T * D * 4  # [B, T, D] fp32 each
    for m in (2, 6):
        assert _saved_peak(shm_dir, m, offload=False) == m * per_mb  # GPipe: all M in flight
        assert per_mb <= _saved_peak(shm_dir, m, offload=True) <= 2 * per_mb
