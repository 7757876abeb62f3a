"""Device memory as the engine holds it (issue 19, part 4): the planner's stage model against the
engine's own high-water marks.

Pure first: the P2P buffers alive at once and the micro-batches in flight, counted on the schedule
(``pipeline.p2p_live_peak``, ``pipeline.in_flight_peak``), against hand walks of small schedules,
and the rule that lets P2P release a held send (a receive from the same peer completed) checked
against every schedule's P2P order. Then three gloo ranks run the real engine (``memory_worker.py``)
for a 1F1B step of one round and a GPipe step of two rounds: each stage's peak of live P2P buffers
(``P2P.peak_buffers``: sends still held by P2P or the round loop, received gradients), its window
slots and the micro-batches whose inputs its runner kept must be what ``costs.stage_memory``
reserves for that config. The model before issue 19 reserved every send of the step until its
end (``sends × G·M`` buffers), ``min(S − s, M)`` micro-batches in flight for a 1F1B round of G·M,
and slots sized by the embedding, which the engine gathers by rows: each fails here. So does the
engine before it (gloo sends reported complete only once waited, so P2P held them to the step's end).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import run_torchrun
from cost_cases import memory as stage_memory

from nodetrain.config.schema import ModelConfig
from nodetrain.core.schedule import (
    Action,
    build_schedule,
    in_flight_peak,
    p2p_groups,
    p2p_live_peak,
    step_rounds,
)
from nodetrain.cost.shape import shape_of
from nodetrain.model import HFModel, build_hf_config

WORKER = Path(__file__).resolve().parents[1] / "memory_worker.py"
HF = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 512,  # the embedding (V·D) outgrows a layer: it must not size the slots
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
B, T = 2, 8

# ----------------------------------------------------------------------------- pure


def test_p2p_live_peak_by_hand() -> None:
    f, b = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    # stage 0 of 3, 1F1B, 4 micro-batches: F0 F1 F2 B0 F3 B1 B2 B3. act 0 and act 1 go alone and are
    # held; the group before B0 posts act 2 and receives grad 0 while both are held: 4 at once
    actions = build_schedule("1f1b", 3, 0, 4)
    assert actions == [f(0), f(1), f(2), b(0), f(3), b(1), b(2), b(3)]
    assert p2p_live_peak(actions, 1, 0, 3) == 4
    # stage 1 of 3: F0 F1 B0 F2 B1 F3 B2 F4 ... every group pairs its send with a receive (waited at
    # once); before B1 the loop still holds grad 0 (received for B0) when act 2 goes and grad 1 comes
    assert p2p_live_peak(build_schedule("1f1b", 3, 1, 4), 1, 1, 3) == 3
    # the last stage only ever has its one input gradient out
    assert p2p_live_peak(build_schedule("1f1b", 3, 2, 4), 1, 2, 3) == 1
    # one stage: no P2P
    assert p2p_live_peak(build_schedule("gpipe", 1, 0, 4), 2, 0, 1) == 0
    # GPipe, middle of 3, 2 rounds of 2: grad 0 still held by the loop when grad 1 arrives with the
    # send of grad 0: 3; the round's last send (grad 1) is held into the next round: still 3
    assert p2p_live_peak(build_schedule("gpipe", 3, 1, 2), 2, 1, 3) == 3


def test_p2p_live_peak_does_not_grow_with_the_micro_batches() -> None:
    """What made the old model wrong: live P2P is bounded by the depth, not by G·M."""
    for kind in ("1f1b", "gpipe"):
        for num_stages in range(2, 9):
            for stage in range(num_stages):
                peaks = {
                    p2p_live_peak(build_schedule(kind, num_stages, stage, m), 1, stage, num_stages)
                    for m in range(num_stages + 1, 3 * num_stages)
                }
                if kind == "1f1b" or 0 < stage < num_stages - 1:  # GPipe's ends hold M sends
                    assert len(peaks) == 1, (kind, num_stages, stage, peaks)
                    assert max(peaks) <= (num_stages + 1 if stage == 0 else 3)


def test_in_flight_peak_is_the_schedule_bound() -> None:
    for num_stages in range(1, 9):
        for stage in range(num_stages):
            for m in range(1, 13):
                assert in_flight_peak(build_schedule("1f1b", num_stages, stage, m)) == min(
                    num_stages - stage, m
                )
                assert in_flight_peak(build_schedule("gpipe", num_stages, stage, m)) == m


def _unsafe_releases(programs: list[list[tuple]]) -> list[tuple[int, int]]:
    """(stage, group) pairs where a group receiving from peer p completes while an earlier send of
    that stage to p may still wait for p's receive: p posted that receive after the group in which
    it sent what arrived. ``programs``: per stage, its groups of (Transfer, micro-batch of the step)."""
    posted = {}  # (stage, op, what, mb) -> index of the group posting it
    for s, prog in enumerate(programs):
        for k, group in enumerate(prog):
            for t, mb in group:
                posted[(s, t.op, t.what, mb)] = k
    bad = []
    for s, prog in enumerate(programs):
        for k, group in enumerate(prog):
            for t, mb in (x for x in group if x[0].op == "recv"):
                sent_at = posted[(t.peer, "send", t.what, mb)]
                earlier = [
                    (u, mb2) for j in range(k) for u, mb2 in prog[j] if u.op == "send" and u.peer == t.peer
                ]
                if any(posted[(t.peer, "recv", u.what, mb2)] > sent_at for u, mb2 in earlier):
                    bad.append((s, k))
    return bad


def _step(kind: str, num_stages: int, grad_accum: int, m: int, groups_of=p2p_groups) -> list[list[tuple]]:
    rounds, per_round = step_rounds(kind, grad_accum, m)
    programs = []
    for s in range(num_stages):
        groups = groups_of(build_schedule(kind, num_stages, s, per_round), s, num_stages)
        programs.append([[(t, r * per_round + t.mb) for t in g] for r in range(rounds) for g in groups])
    return programs


def test_a_receive_from_a_peer_follows_its_receive_of_every_earlier_send() -> None:
    """P2P waits for a held send to peer p once a group receiving from p completed. That is safe (the
    wait returns once the data is through, it never waits on p's progress) when p posted the receive
    of that send no later than the group in which it sent what arrived; checked for every schedule,
    depth, micro-batch count and accumulation (the rounds one after the other, as the engine posts),
    and shown to fail on the order before issue 13 (each send on its own, then the receive)."""
    from test_pipeline import _unpaired_groups

    for kind in ("1f1b", "gpipe"):
        for num_stages in range(2, 9):
            for grad_accum in (1, 2):
                for m in range(1, 9):
                    assert not _unsafe_releases(_step(kind, num_stages, grad_accum, m)), (kind, num_stages, m)
    assert _unsafe_releases(_step("1f1b", 2, 1, 2, _unpaired_groups))


def test_a_streamed_embedding_is_gathered_by_rows_not_slotted() -> None:
    """The engine streams stage 0's embedding as the rows a micro-batch uses (``Window.rows``): it
    sizes no slot and its backward holds U ≤ min(n, V) rows, not V × D; kept resident, it is a dense
    block again (its V × D gradient)."""
    hf = {**HF, "vocab_size": 4096}  # V·D = 131,072 elements against a layer's 9,280
    shape = shape_of(HFModel(build_hf_config(ModelConfig(name="rows", arch="LlamaForCausalLM", hf=hf))))
    kw = dict(b=B, t=T, m=2, g=1, schedule="1f1b", slots=2, itemsize=4, on_cpu=True)
    with_embed, layer_only = (
        stage_memory(shape, range(0, 2), 0, 2, **kw),
        stage_memory(shape, range(1, 2), 0, 2, **kw),
    )
    assert with_embed.window_bytes == layer_only.window_bytes == 2 * 9_280 * 4
    # the rows' fp32 sums (4·U·D = 4·16·32, fp32: no upcast, no copy) stay below the layer's peak
    assert with_embed.transient_bytes == layer_only.transient_bytes < 4096 * 32 * 4
    dense = stage_memory(shape, range(0, 2), 0, 2, resident=(0,), **kw)
    assert dense.window_bytes == 2 * 9_280 * 4 and dense.transient_bytes == 4096 * 32 * 4


# ----------------------------------------------------------------------------- the real engine


CASES = [("1f1b", 2, 2), ("gpipe", 2, 2)]
"""(schedule, micro-batches M, accumulation rounds G) of the one launch below."""


def _spec(out: Path, store_dir: Path, schedule: str, m: int, g: int, extra=None, run_id="memory") -> Path:
    """memory_worker.py's spec of one case (``extra``: config keys over these)."""
    out.mkdir()
    overrides = {
        "train.dtype": "float32",
        "train.seq_len": T,
        "train.micro_batch_size": B,
        "train.grad_accum": g,
        "train.steps": 2,
        "data.vocab_size": HF["vocab_size"],
        "pipeline.microbatches": m,
        "pipeline.schedule": schedule,
        "stream.slots": 2,
        "stream.device_budget": 0,
        "optim.threads": 1,
        "store.dir": str(store_dir),
        **(extra or {}),
    }
    spec = {
        "arch": "LlamaForCausalLM",
        "hf": HF,
        "overrides": overrides,
        "out_dir": str(out),
        "run_id": f"{run_id}-{schedule}",
    }
    (out / "spec.json").write_text(json.dumps(spec))
    return out / "spec.json"


@pytest.fixture(scope="module")
def engine_reports(tmp_path_factory) -> dict[str, list[dict]]:
    """One 3-rank launch of memory_worker.py running every case of CASES in turn: per schedule, the
    ranks' reports; the store directory (in /dev/shm) must be empty afterwards."""
    tmp = tmp_path_factory.mktemp("memory")
    store_dir = Path(tempfile.mkdtemp(prefix="nt-test-", dir="/dev/shm"))
    try:
        specs = [_spec(tmp / schedule, store_dir, schedule, m, g) for schedule, m, g in CASES]
        run_torchrun(3, WORKER, *map(str, specs), timeout_s=240)
        left = sorted(p.name for p in store_dir.iterdir())
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    assert not left, f"files left in the store directory: {left}"
    return {c[0]: [json.loads((tmp / c[0] / f"rank{r}.json").read_text()) for r in range(3)] for c in CASES}


@pytest.mark.parametrize(("schedule", "m", "g"), CASES)
def test_planner_reserves_what_the_engine_holds(engine_reports, schedule, m, g) -> None:
    ranks = engine_reports[schedule]
    shape = shape_of(HFModel(build_hf_config(ModelConfig(name="memory", arch="LlamaForCausalLM", hf=HF))))
    buffer_bytes = B * T * HF["hidden_size"] * 4  # one [B, T, D] fp32 activation or its gradient
    for r in ranks:
        blocks = range(r["blocks"][0], r["blocks"][-1] + 1)
        mem = stage_memory(
            shape,
            blocks,
            r["stage"],
            3,
            b=B,
            t=T,
            m=m,
            g=g,
            schedule=schedule,
            slots=2,
            itemsize=4,
            on_cpu=True,
        )
        assert r["p2p_peak_bytes"] == r["p2p_peak_buffers"] * buffer_bytes, r
        assert mem.p2p_bytes == r["p2p_peak_bytes"], (r, mem)  # the engine's high-water mark
        assert mem.in_flight == r["in_flight_peak"], (r, mem)
        assert mem.window_bytes == r["window_bytes"], (r, mem)
    # the figures themselves (hand walks above): 1F1B one round of 4 on stages 0, 1, 2; GPipe 2 of 2,
    # where the last stage's two input gradients go alone and are held until the next round receives
    want = {"1f1b": ([4, 3, 1], [3, 2, 1]), "gpipe": ([3, 3, 2], [2, 2, 2])}[schedule]
    assert [r["p2p_peak_buffers"] for r in ranks] == want[0]
    assert [r["in_flight_peak"] for r in ranks] == want[1]
