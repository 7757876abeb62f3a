"""Collectives and P2P on the device their process group serves (nodetrain/engine/comm/comm.py), on CPU.

NCCL has no CPU backend: a CPU tensor in an NCCL all-reduce fails on a GPU node only. Here a
recorded fake ``dist`` answers "nccl" and the rank's device is ``cuda:0``; CUDA tensors are
``FakeTensorMode`` tensors (a device and a shape, no memory), so the check runs on a CPU machine:
- ``Comm`` refuses a tensor on the wrong device for NCCL and for gloo, and lets the right one through;
- the engine's pieces (the step's totals, a P2P group, the staged replica sum) put their tensors
  on the group's device;
- no module of nodetrain/ calls a tensor collective or P2P of ``torch.distributed`` except comm.py
  (checkpointing's JSON exchange runs on its own gloo group of CPU tensors);
- in a real Engine (one gloo process, the replica groups stubbed), the optimizer thread's
  replica sums go to a group of their own and the training thread's to another (issue 13, item 7).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nodetrain.engine.comm.replicas as replicas
from nodetrain.core.schedule import Transfer
from nodetrain.core.topology import Topology
from nodetrain.engine.comm.comm import Comm, P2POp, WrongDevice
from nodetrain.engine.comm.p2p import P2P
from nodetrain.engine.comm.replicas import ReplicaGradSum

ROOT = Path(__file__).resolve().parents[2]
CUDA0 = torch.device("cuda", 0)


class RecordedDist:
    """The parts of ``torch.distributed`` Comm uses; records calls, moves no data."""

    def __init__(self, backend: str = "nccl"):
        self.backend, self.calls = backend, []

    def get_backend(self, group=None) -> str:
        return self.backend

    def all_reduce(self, t, group=None):
        self.calls.append(("all_reduce", t.device, group))

    def isend(self, *a, **k):
        raise AssertionError("P2P must go through batch_isend_irecv")

    def irecv(self, *a, **k):
        raise AssertionError("P2P must go through batch_isend_irecv")

    class P2POp:
        def __init__(self, fn, tensor, peer, tag=0):
            self.fn, self.tensor, self.peer, self.tag = fn, tensor, peer, tag

    def batch_isend_irecv(self, ops):
        self.calls.append(("batch", [(o.fn.__name__, o.tensor.device, o.peer, o.tag) for o in ops]))
        return [_Done() for _ in ops]


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


def test_nccl_refuses_cpu_tensors_and_passes_cuda_ones() -> None:
    fake = RecordedDist("nccl")
    comm = Comm(CUDA0, dist=fake)
    assert comm.device_of() == CUDA0
    with pytest.raises(WrongDevice, match=r"all_reduce: tensor on cpu.*nccl.*serves cuda:0"):
        comm.all_reduce(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(WrongDevice, match="batch_p2p"):
        comm.batch_p2p([P2POp("recv", torch.empty(2), 1)])
    assert fake.calls == []  # nothing reached dist
    with FakeTensorMode():
        totals = comm.tensor([1.0, 2.0, 0.0])
        assert totals.device == CUDA0 and totals.dtype == torch.float64
        comm.all_reduce(totals)
    assert fake.calls == [("all_reduce", CUDA0, None)]


def test_gloo_refuses_cuda_tensors_and_nccl_needs_a_cuda_rank() -> None:
    comm = Comm(CUDA0, dist=RecordedDist("gloo"))
    assert comm.device_of() == torch.device("cpu")
    comm.all_reduce(torch.zeros(1))
    with FakeTensorMode(), pytest.raises(WrongDevice, match="serves cpu"):
        comm.all_reduce(torch.zeros(1, device="cuda"))
    with pytest.raises(WrongDevice, match="NCCL process group serves CUDA"):
        Comm(torch.device("cpu"), dist=RecordedDist("nccl")).device_of()


def test_p2p_group_is_one_batch_on_the_cuda_device() -> None:
    """A 1F1B steady-state group (send act 1, receive grad 0) of stage 0: one batch_isend_irecv,
    both tensors on cuda:0 even when the activation arrives from the CPU, tags 2·mb (+1 for grads)."""
    fake = RecordedDist("nccl")
    p2p = P2P(0, 2, (2, 4, 8), torch.float32, Comm(CUDA0, dist=fake), ranks=[5, 7])
    with FakeTensorMode():
        group = (Transfer("send", "act", 1, 1), Transfer("recv", "grad", 0, 1))
        got = p2p.exchange(group, torch.ones(2, 4, 8), mb_base=4)
        assert got.device == CUDA0 and tuple(got.shape) == (2, 4, 8)
    assert fake.calls == [("batch", [("isend", CUDA0, 7, 10), ("irecv", CUDA0, 7, 9)])]


def test_replica_sum_stages_through_the_nccl_device(monkeypatch) -> None:
    """NCCL reduces device memory only: the host gradients go through a cuda:0 staging buffer; on
    gloo they are reduced in place (FakeTensorMode cannot slice a fake CUDA tensor on a CPU-only
    build, so the choice is checked, not the chunked copy; tests/dist/test_replicas.py runs that path)."""
    monkeypatch.setattr(replicas, "stage_group", lambda topo, timeout_s, kind="stage": f"group:{kind}")
    nccl = ReplicaGradSum(Topology(0, 1, 2), 60.0, Comm(CUDA0, dist=RecordedDist("nccl")), kind="stage_optim")
    assert nccl.group == "group:stage_optim" and nccl._staging == CUDA0
    gloo = ReplicaGradSum(Topology(0, 1, 2), 60.0, Comm(torch.device("cpu"), dist=RecordedDist("gloo")))
    assert gloo.group == "group:stage" and gloo._staging is None


TENSOR_COLLECTIVES = re.compile(
    r"\bdist\.(all_reduce|broadcast|reduce|all_gather|all_gather_into_tensor|reduce_scatter|"
    r"reduce_scatter_tensor|gather|scatter|all_to_all|send|recv|isend|irecv|batch_isend_irecv)\("
)


def test_only_comm_calls_tensor_collectives() -> None:
    """Every tensor collective and P2P of nodetrain/ goes through comm.py's device check.
    checkpoint/ exchanges JSON bytes on its own gloo group (CPU tensors by construction)."""
    offenders = []
    for path in (ROOT / "nodetrain").rglob("*.py"):
        rel = path.relative_to(ROOT / "nodetrain").as_posix()
        if rel == "engine/comm/comm.py" or rel.startswith("checkpoint/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if TENSOR_COLLECTIVES.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, offenders


# ----------------------------------------------------------------------------- threads and groups


@pytest.fixture
def replica_engine(monkeypatch, tmp_path, one_rank_world):
    """``build(**optim)``: a one-stage Engine in this process (gloo, world 1) that believes it is one
    of 2 replicas: the replica groups are stubs (``group:<kind>``) whose all-reduce is recorded
    (with the calling thread) and does nothing."""
    import torch.distributed as dist

    import nodetrain.engine.engine as engine_mod
    import nodetrain.engine.startup as startup
    from bench._engine import base_config, model_config
    from nodetrain.model import HFModel, build_hf_config

    # the world of one (one_rank_world) must not outlive this test: later tests launch torchrun
    record: list[tuple[str, object, str]] = []

    class StubbedDist:
        def __getattr__(self, name):
            return getattr(dist, name)

        def get_backend(self, group=None):
            return "gloo" if isinstance(group, str) else dist.get_backend(group)

        def all_reduce(self, t, group=None):
            record.append(("all_reduce", group, threading.current_thread().name))
            if not isinstance(group, str):
                dist.all_reduce(t, group=group)

    monkeypatch.setattr(replicas, "stage_group", lambda topo, timeout_s, kind="stage": f"group:{kind}")
    monkeypatch.setattr(startup, "node_group", lambda topo, timeout_s: None)
    monkeypatch.setattr(engine_mod, "Comm", lambda device: Comm(device, dist=StubbedDist()))
    engines = []

    def build(**optim):
        hf = {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
        }
        cfg = base_config(
            model_config("llama_10m", 64, **hf),
            train={"seq_len": 8, "micro_batch_size": 1, "dtype": "float32", "steps": 2},
            pipeline={"stages": 1, "microbatches": 2},
            optim=optim,
        )
        cfg.data.vocab_size, cfg.store.dir = 64, str(tmp_path)
        model = HFModel(build_hf_config(cfg.model))
        eng = startup.build_engine(
            cfg,
            model,
            rank=0,
            world_size=1,
            local_rank=0,
            run_id=f"thr{len(engines)}",
            device=torch.device("cpu"),
            topology=Topology(0, 1, 2),
        )
        engines.append(eng)
        n = eng.run.batch.global_microbatches  # accumulation rounds × micro-batches × replicas
        x = torch.randint(0, 64, (n, 1, 8), generator=torch.Generator().manual_seed(0))
        for step in range(2):
            eng.train_step(step, x, x)
        eng.wait_optimizer()
        return record

    yield build
    for eng in engines:
        eng.close()


def test_optimizer_thread_sums_on_its_own_group(replica_engine) -> None:
    calls = replica_engine(overlap=True, max_grad_norm=0.0, update_in_backward=True)
    on_optim = {(g, th.split("_")[0]) for _, g, th in calls if g == "group:stage_optim"}
    assert on_optim == {("group:stage_optim", "optim")}, calls  # only the optimizer thread uses it
    main = threading.main_thread().name
    assert all(th == main for _, g, th in calls if g != "group:stage_optim"), calls
    assert sum(g == "group:stage_optim" for _, g, _ in calls) == 2 * 4  # 4 units, 2 steps


def test_training_thread_sums_on_the_stage_group(replica_engine) -> None:
    calls = replica_engine(overlap=True, max_grad_norm=1.0)  # clipping: deferred, summed before the norm
    main = threading.main_thread().name
    assert {(g, th) for _, g, th in calls} == {("group:stage", main), (None, main)}, calls
