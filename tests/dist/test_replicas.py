"""Data parallelism across nodes (nodetrain/engine/comm/replicas.py): rank layout, groups, gradient sum,
and the acceptance run — two torchrun "nodes" on this machine train exactly like one node on the whole batch.

Cheapest first: the pure topology and config rules; then two ``torchrun --nnodes 2 --nproc_per_node
2`` launches (``--node_rank`` 0 and 1, rendezvous on 127.0.0.1, one store directory per node), whose
4-rank gloo world first checks the groups and both gradient-sum paths against closed forms
(replicas_worker.py), then trains: compared with a single-node 2-stage run of the same global batch
and with plain ``transformers`` + ``torch.optim.AdamW`` (the reference of test_parity.py). Both
launches are one module fixture's, read by the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import free_port, job_env, run_torchrun, shm_store_dir, start_job, torchrun_cmd
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_parity import (
    ATOL_WEIGHT,
    RTOL,
    SEQ_LEN,
    WORKER,
    Case,
    hf_fields,
    make_batches,
    read_run,
    run_nodetrain,
    run_reference,
    save_seeded_model,
)

from nodetrain.config.batch import BatchShape
from nodetrain.config.schema import Config, ConfigError, validate
from nodetrain.core.topology import Topology, replica_slice

# ----------------------------------------------------------------------------- pure rules


def _env(rank: int, per_node: int, nodes: int, **extra: int) -> dict[str, str]:
    env = {
        "RANK": rank,
        "WORLD_SIZE": per_node * nodes,
        "LOCAL_RANK": rank % per_node,
        "LOCAL_WORLD_SIZE": per_node,
        "GROUP_RANK": rank // per_node,
    }
    return {k: str(v) for k, v in {**env, **extra}.items()}


def test_topology_of_two_nodes_of_four_ranks() -> None:
    topos = [Topology.from_env(0, _env(r, per_node=4, nodes=2)) for r in range(8)]
    assert [(t.replica, t.stage) for t in topos] == [(r // 4, r % 4) for r in range(8)]
    t = topos[6]  # node 1, local rank 2
    assert (t.num_stages, t.num_replicas, t.world_size, t.local_rank) == (4, 2, 8, 2)
    assert t.pipeline_ranks == [4, 5, 6, 7] and t.stage_ranks == [2, 6] and t.node_root == 4
    assert Topology.from_env(4, _env(6, 4, 2)) == t
    one = Topology.from_env(0, {})  # plain python: one stage, one replica
    assert (one.rank, one.num_stages, one.num_replicas) == (0, 1, 1)
    assert Topology.single(1, 2) == Topology(1, 2, 1, 1)


def test_topology_refuses_stages_not_per_node_and_uneven_nodes() -> None:
    with pytest.raises(ValueError, match=r"pipeline.stages=4.*--nproc_per_node 4"):
        Topology.from_env(4, _env(0, per_node=2, nodes=2))
    # node 0 started 4 ranks, node 1 started 2 (world 6): node 1's local rank 0 is global rank 4
    with pytest.raises(ValueError, match="RANK=4 is not GROUP_RANK"):
        Topology.from_env(0, _env(4, per_node=2, nodes=3, LOCAL_RANK=0, GROUP_RANK=1))


def test_replica_slices_partition_the_batch() -> None:
    for n, k in [(8, 2), (6, 3), (5, 2), (1, 2), (4, 1)]:
        covered = [i for r in range(k) for i in range(n)[replica_slice(n, r, k)]]
        assert covered == list(range(n)), (n, k)
    assert [range(8)[replica_slice(8, r, 2)] for r in range(2)] == [range(0, 4), range(4, 8)]


def _config(**overrides) -> Config:
    hf = {**hf_fields(Case("x", "LlamaForCausalLM", 2, "1f1b", 1, 1, 4)), "vocab_size": 320}  # a BPE's >= 257
    model = {"name": "tiny", "hf": hf}
    base = {"model": model, "train": {"seq_len": SEQ_LEN}, "data": {"vocab_size": 320}}
    hardware = {"hardware": OmegaConf.load(Path(__file__).parents[2] / "conf" / "hardware" / "cpu.yaml")}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), base, hardware, overrides))


def test_config_accepts_world_of_stages_times_nodes() -> None:
    cfg = _config(train={"batch_size": 32, "micro_batch_size": 2}, pipeline={"microbatches": 4})
    validate(cfg, world_size=4, local_world_size=2)  # stages = 0 → 2 per node, 2 nodes
    assert BatchShape.of(cfg, num_replicas=2).grad_accum == 2 and BatchShape.of(cfg).grad_accum == 4
    cfg.pipeline.stages = 2
    validate(cfg, world_size=4, local_world_size=2)
    cfg.pipeline.stages = 4
    with pytest.raises(ConfigError, match=r"pipeline.stages=4: must equal the ranks per node, 2 on each"):
        validate(cfg, world_size=4, local_world_size=2)
    cfg = _config(train={"batch_size": 24, "micro_batch_size": 2}, pipeline={"microbatches": 4})
    validate(cfg, world_size=2, local_world_size=2)  # 24 = 3 rounds of 8 on one node
    with pytest.raises(ConfigError, match=r"train.batch_size=24: .*× 2 nodes = 16"):
        validate(cfg, world_size=4, local_world_size=2)


# ----------------------------------------------------------------------------- groups and the sum


def test_groups_timeouts_and_gradient_sum_on_four_ranks(two_nodes: Path) -> None:
    """replicas_worker.py's checks, run by the two-node launch's 4 ranks (2 nodes × 2 stages) before
    its training run (``two_nodes``)."""
    results = [json.loads((two_nodes / "groups" / f"rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(results):
        assert (res["replica"], res["stage"]) == (r // 2, r % 2)
        assert res["broadcast"] == f"store of node {r // 2}"  # each node got its own root's value
        stage = r % 2  # summed over the ranks of the same stage: r' = stage and stage + 2
        for n, got in zip((11, 5), res["in_place"], strict=True):
            want = [sum(i * (q + 1) + 0.25 * q for q in (stage, stage + 2)) for i in range(n)]
            assert got == want
        assert res["staged"] == res["in_place"]
        # the subgroups get the configured timeout, not torch's default (30 min on gloo) or the world's
        assert res["timeouts_s"] == {"world": 120.0, "node": 77.0, "stage": 77.0}
    # a collective whose peer never joins fails after the group's 2 s, not the world's 120 s
    assert 1.9 <= results[0]["hang_wait_s"] < 60.0, results[0]["hang_wait_s"]


# ----------------------------------------------------------------------------- acceptance

CASE = Case("llama-2stage-tied-1f1b-2nodes", "LlamaForCausalLM", 2, "1f1b", 2, 2, 4, tied=True)
"""The single-node run: 2 stages, 2 rounds × 4 micro-batches = 8 per step; the two-node run has
the same global batch as 2 replicas × 1 round × 4 micro-batches (``train.batch_size`` = 16)."""


def _launch_two_nodes(specs: list[Path | list[Path]], timeout_s: float = 240) -> None:
    """Start ``torchrun --nnodes 2 --nproc_per_node 2 --node_rank i`` for i = 0, 1 and wait for both;
    node i runs the spec file ``specs[i]`` (or the spec files ``specs[i]``, one after another)."""
    port, env = free_port(), job_env()
    procs = []
    for node, spec in enumerate(specs):
        files = [spec] if isinstance(spec, (str, Path)) else spec
        cmd = torchrun_cmd(2, str(WORKER), *map(str, files), nnodes=2, node_rank=node, port=port)
        procs.append(start_job(cmd, env))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"two-node run timed out after {timeout_s}s")
    for node, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{out[-6000:]}"


def _assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, w in want.items():
        msg = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(got[name], w, rtol=RTOL, atol=ATOL_WEIGHT, msg=msg)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    """The single-node run of CASE (2 ranks) under ``single/``, then the same run as two nodes, out
    in ``two_nodes/``: ``torchrun --nnodes 2 --nproc_per_node 2`` twice, each node running
    replicas_worker.py's checks of the groups and the gradient sum first (out in ``groups/``)."""
    tmp_path, shm_dir = tmp_path_factory.mktemp("replicas"), shm_store_dir()
    model_dir = tmp_path / "hf"
    save_seeded_model(CASE, model_dir)
    inputs, labels, _ = make_batches(CASE)  # [steps, 8, B, T]
    (tmp_path / "single").mkdir()
    try:
        run_nodetrain(CASE, tmp_path / "single", shm_dir, model_dir, inputs, labels, run_torchrun)
        assert not list(shm_dir.iterdir()), "the single-node run left its host store"

        # the same spec as the single-node run, but the global batch given in sequences, no accumulation
        base = json.loads((tmp_path / "single" / "spec.json").read_text())
        out_dir, specs = tmp_path / "two_nodes", []
        out_dir.mkdir()
        (tmp_path / "groups").mkdir()
        (tmp_path / "groups.json").write_text(json.dumps({"replicas_check": str(tmp_path / "groups")}))
        for node in range(2):
            store_dir = shm_dir / f"node{node}"
            store_dir.mkdir()
            overrides = {**base["overrides"], "train.grad_accum": 1, "store.dir": str(store_dir)}
            overrides["train.batch_size"] = inputs.shape[1] * inputs.shape[2]  # 8 micro-batches × 2
            spec = {**base, "overrides": overrides, "out_dir": str(out_dir), "run_id": "two-nodes"}
            specs.append([tmp_path / "groups.json", tmp_path / f"spec_node{node}.json"])
            specs[-1][-1].write_text(json.dumps(spec))
        _launch_two_nodes(specs)
        for node in range(2):
            assert not list((shm_dir / f"node{node}").iterdir()), "a host store was left behind"
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    return tmp_path


def test_two_nodes_equal_one_node_on_the_global_batch(two_nodes: Path) -> None:
    """The single-node and the two-node runs of the ``two_nodes`` fixture, against each other and
    against the reference."""
    tmp_path, out_dir, model_dir = two_nodes, two_nodes / "two_nodes", two_nodes / "hf"
    inputs, labels, lengths = make_batches(CASE)  # [steps, 8, B, T]
    single = read_run(CASE, tmp_path / "single" / "out")
    steps = json.loads((out_dir / "steps.json").read_text())
    ranks = [load_file(str(out_dir / f"weights_rank{r}.safetensors")) for r in range(4)]
    units = [json.loads((out_dir / f"rank{r}.json").read_text())["units"] for r in range(4)]
    node0, node1 = {**ranks[0], **ranks[1]}, {**ranks[2], **ranks[3]}

    # every node holds the whole pipeline, split the same way, and ends with the same bits
    assert units[:2] == units[2:] == single.units
    assert sorted(node0) == sorted(node1) == sorted(single.weights)
    for name in node0:
        assert torch.equal(node0[name], node1[name]), f"{name} differs between the nodes"

    # the breakdown names stages by stage index (replica 0's), and its step time is the slowest node's
    bd = steps[-1]["breakdown"]
    assert {k.split("/")[0] for k in bd if k.startswith("stage")} == {"stage0", "stage1"}
    assert bd["step_s"] == max(bd["replica0/step_s"], bd["replica1/step_s"]) >= bd["stage1/step_s"]

    # equal to one node running the whole global batch (1e-5, fp32) ...
    assert [s["tokens"] for s in steps] == [s["tokens"] for s in single.steps]
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close([s[key] for s in steps], [s[key] for s in single.steps], rtol=RTOL, atol=0)
    _assert_weights_close(node0, single.weights)

    # ... and to plain transformers + torch.optim.AdamW on the same tokens
    ref = run_reference(CASE, model_dir, inputs, labels, lengths)
    assert min(ref.norms) > CASE.max_grad_norm, "clipping does not bite"
    torch.testing.assert_close([s["loss"] for s in steps], ref.losses, rtol=RTOL, atol=0)
    torch.testing.assert_close([s["grad_norm"] for s in steps], ref.norms, rtol=RTOL, atol=0)
    _assert_weights_close(node0, ref.weights)

    # without the gradient sum node 0 would have trained on its half only: far from the result
    half = run_reference(CASE, model_dir, inputs[:, :4], labels[:, :4], lengths[:, :4])
    gap = max(float((node0[n] - half.weights[n]).abs().max()) for n in half.weights)
    assert gap > 100 * ATOL_WEIGHT, f"the two-node run is within {gap:.2e} of node 0's half alone"
