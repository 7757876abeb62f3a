"""Run nodetrain's Engine over a fixed batch file and export what it learned; started by torchrun.

Not a test itself: ``test_parity.py`` and ``test_store.py`` launch it and compare its output with
an independent reference. One spec (JSON) describes the run:

    {"arch": "LlamaForCausalLM", "hf": {...HF config fields...},
     "overrides": {"train.seq_len": 16, "pipeline.schedule": "1f1b", ...},
     "model_dir": "<save_pretrained dir>" | null (random init),
     "batch_file": "<safetensors with inputs, labels: int64 [steps, N, B, T]>",
     "out_dir": "<dir>", "run_id": "<names the store file>", "memory_report": false,
     "device": "cpu" | "cuda", "export_state": false, "export_grads": false, "export_fields": false,
     "variants": [{"out_dir": ..., "run_id": ..., "overrides": {...}}, ...] | absent}

``variants``: several runs one after another in one launch (each its spec with the variant's keys
and overrides on top). ``export_fields`` writes ``fields_rank<r>.safetensors``: every store field of
every owned unit, ``"<unit>.<field>"`` (the tier's read from its file, ``store.tier=nvme``).

Writes, under ``out_dir``:
    weights_rank<r>.safetensors  the fp32 master weights of the units rank r owns, by HF name
                                 (a tied head also writes ``lm_head.weight``, read through its
                                 binding to the embedding);
    rank<r>.json                 {"units": [...], "resident": [...], "on_device": [...], "store_nbytes": ...,
                                 "kept": [...], "grad_acc": [...], "speculative": bool,
                                 "update_choice": "<optim.speculative=auto's line>",
                                 "memory": {...} | null, "adamw_steps": {HF name: count} | null};
    state_rank<r>.safetensors    with ``export_state``: AdamW's ``<HF name>.exp_avg`` and
                                 ``<HF name>.exp_avg_sq`` of the units rank r owns;
    steps.json                   (rank 0) per step: loss, grad_norm, lr, tokens, skipped, and the
                                 step's breakdown of every stage (see nodetrain/run/breakdown.py);
    grads_rank<r>.safetensors    with ``export_grads``: ``<step>.<unit name>``, each unit's flat
                                 fp32 gradient in the host store after that step.

With ``variants`` each named variant trains a fresh engine in turn (the same process group, the
store's name suffixed) and writes those files under ``out_dir/<name>/``; the global RNG is seeded
before each run's first step, so runs with dropout draw the same numbers. Before each run (spec or
variant) rank 0 prints ``parity_worker: run <run_id>`` to stderr between two barriers: every line
of a run comes after its own and before the next run's (test_parity.run_output cuts a launch's
output there).

    python -m torch.distributed.run --nproc_per_node 2 --master_port 29511 tests/parity_worker.py spec.json

Several specs (``spec1.json spec2.json ...``, the same world size) run one after another in one
launch: one process group, one Engine at a time (test_family_parity.py runs its families so).

A spec ``{"replicas_check": "<out dir>"}`` (in a world of 2 nodes × 2 ranks) runs
``replicas_worker.py``'s checks of the groups and the gradient sum before the runs, the world then
created with that worker's timeout (test_replicas.py's two-node launch).

Under ``--nnodes K`` each node runs one replica of the pipeline (nodetrain/engine/comm/replicas.py): the batch
file then holds the global batch, and ``weights_rank<r>`` of every node are written (the same
``out_dir`` may be shared by nodes on one machine; give each its own ``store.dir``).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import psutil
import replicas_worker  # tests/replicas_worker.py (this script's directory): its checks, when asked
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from nodetrain.checkpoint import load_hf_weights
from nodetrain.config.batch import BatchShape
from nodetrain.config.schema import Config, ModelConfig, validate
from nodetrain.core.topology import Topology
from nodetrain.engine.engine import Engine
from nodetrain.engine.startup import build_engine
from nodetrain.model import HFModel, build_hf_config, router_aux_of
from nodetrain.run.inject import Faults
from nodetrain.run.jobs import exit_process

RUN_MARKER = "parity_worker: run "
"""Rank 0's line on stderr before each run of a launch, followed by the run's ``run_id``."""


def _config(spec: dict) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(name="parity", arch=spec["arch"], hf=dict(spec["hf"]))
    for key, value in spec["overrides"].items():
        *path, leaf = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        assert hasattr(obj, leaf), f"unknown config key {key}"
        setattr(obj, leaf, value)
    return cfg


_SMAPS_FIELDS = {
    "Rss:": "rss",
    "Private_Clean:": "private",
    "Private_Dirty:": "private",
    "Anonymous:": "anonymous",
}


def _store_mapping(store_dir: str) -> dict | None:
    """The host store's mapping in this process, from /proc/self/smaps (and its /proc/self/maps line).

    ``private``: bytes of its pages only this process maps (psutil counts them in USS);
    ``anonymous``: copy-on-write copies of its pages (a private copy of the store).
    """
    prefix = os.path.join(os.path.realpath(store_dir), "nodetrain-")
    found, in_store = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a mapping header
            path = head[5] if len(head) == 6 else ""
            in_store = path.startswith(prefix)
            if in_store and found is not None and found["path"] == path:  # split by the tier's slots
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found["size"] += hi - lo
            elif in_store:
                assert found is None, f"the store is mapped twice: {found['path']} and {path}"
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = {
                    "path": path,
                    "inode": int(head[4]),
                    "perms": head[1],
                    "size": hi - lo,
                    "rss": 0,
                    "private": 0,
                    "anonymous": 0,
                }
        elif in_store and head[0] in _SMAPS_FIELDS:
            found[_SMAPS_FIELDS[head[0]]] += int(head[1]) * 1024
    if found is not None:  # the brief's view of it: the same line in /proc/self/maps
        maps = [ln for ln in Path("/proc/self/maps").read_text().splitlines() if prefix in ln]
        found["maps_lines"] = maps
    return found


def _unit_state(engine: Engine, unit: int) -> dict[str, torch.Tensor]:
    """Every store field of an owned ``unit`` (private copies), the tier's read from its file."""
    tiered = hasattr(engine.optimizer, "read_fields")  # store.tier=nvme: its store ranges are unmapped
    tier = engine.optimizer.read_fields(unit) if tiered else {}
    fields = {
        f: engine.store.buffer(unit, f).clone() for f in engine.store.layout.fields_of(unit) if f not in tier
    }
    return {**fields, **tier}


def main(*spec_paths: str) -> None:
    """Run each spec in turn in one process group (their ``device`` is the first one's)."""
    specs = [json.loads(Path(path).read_text()) for path in spec_paths]
    device = torch.device("cpu")
    if specs[0].get("device") == "cuda":  # gpu-marked tests: NCCL, one GPU per rank
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    checks = [spec["replicas_check"] for spec in specs if "replicas_check" in spec]
    timeout = {"timeout": timedelta(seconds=replicas_worker.WORLD_TIMEOUT_S)} if checks else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **timeout)
    for out_dir in checks:  # replicas_worker.py's checks first, in this world of 4 ranks
        replicas_worker.check(out_dir)
    specs = [spec for spec in specs if "replicas_check" not in spec]
    for spec in specs:  # several runs in one launch, one after another
        for variant in spec.get("variants") or [{}]:
            overrides = {**spec["overrides"], **variant.get("overrides", {})}
            run = {**spec, **variant, "overrides": overrides}
            dist.barrier()  # every rank's lines of the previous run are out before this run's marker
            if dist.get_rank() == 0:
                print(f"{RUN_MARKER}{run['run_id']}", file=sys.stderr, flush=True)
            dist.barrier()  # ... and none of this run's before it
            run_spec(run, device)
    dist.destroy_process_group()


def run_spec(spec: dict, device: torch.device) -> None:
    """One run of ``spec`` in the process group that is up (its files under ``spec["out_dir"]``)."""
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # nothing here should depend on it; fixed anyway
    cfg = _config(spec)
    validate(cfg, world, int(os.environ["LOCAL_WORLD_SIZE"]))
    batch = load_file(spec["batch_file"])
    inputs, labels = batch["inputs"], batch["labels"]  # [steps, N, B, T] int64
    assert inputs.shape[0] == cfg.train.steps, "batch file and train.steps disagree"

    hf_config = build_hf_config(cfg.model)
    model = HFModel(
        hf_config,
        router_aux_of(
            cfg,
            hf_config,
            BatchShape.of(cfg, Topology.from_env(cfg.pipeline.stages).num_replicas).global_microbatches,
        ),
    )
    init_from = None
    if spec.get("model_dir"):
        model_dir = spec["model_dir"]

        def init_from(store, units):
            load_hf_weights(model_dir, store, units, model)  # the whole directory is checked first

    proc = psutil.Process()
    uss_before = proc.memory_full_info().uss
    engine = build_engine(
        cfg,
        model,
        rank=rank,
        world_size=world,
        local_rank=int(os.environ["LOCAL_RANK"]),
        run_id=spec["run_id"],
        device=device,
        init_from=init_from,
        topology=Topology.from_env(cfg.pipeline.stages),
        faults=Faults(**spec.get("faults", {})),  # test-only: slowed copies and updates
    )
    steps, grads = [], {}
    torch.manual_seed(0)  # dropout's random numbers: the same for every variant (start-up may draw)
    for step in range(cfg.train.steps):
        r = engine.train_step(step, inputs[step], labels[step])
        if spec.get("export_grads"):
            engine.wait_optimizer()
            grads.update({f"{step}.{u.name}": engine.store.grad(u.index).clone() for u in engine.units})
        steps.append(
            {
                "loss": r.loss,
                "aux_loss": r.aux_loss,
                "grad_norm": r.grad_norm,
                "lr": r.lr,
                "tokens": r.tokens,
                "skipped": r.skipped,
                "breakdown": r.breakdown,
            }
        )

    memory = None
    if spec.get("memory_report"):
        memory = {
            "uss_before": uss_before,
            "uss_after": proc.memory_full_info().uss,
            "store": _store_mapping(cfg.store.dir),
        }
    weights, states = {}, {u.index: _unit_state(engine, u.index) for u in engine.units}
    if spec.get("export_fields"):  # every store field's bytes, by unit and field
        fields = {f"{u}.{f}": t for u, state in states.items() for f, t in state.items() if f != "grad_tied"}
        save_file(fields, str(out / f"fields_rank{rank}.safetensors"))
    master_field = "compute" if cfg.optim.state == "lean" else "master"
    for unit in engine.units:
        master = states[unit.index][master_field]
        for p in unit.params:
            weights[p.hf_name] = master[p.offset : p.offset + p.numel].view(p.shape).clone()
    for block in engine.blocks:  # buffers transformers saves and never trains (DeepSeek-V3's router bias)
        weights.update({hf_name: t.clone() for hf_name, t in model.constants[block].values()})
    for block in engine.blocks:  # a tied head binds the embedding's weight: export it as the head sees it
        for b in model.bindings[block]:
            if b.unit != block:
                assert b.local_name == "lm_head.weight", b
                state = states[b.unit] if b.unit in states else _unit_state(engine, b.unit)  # another stage's
                bound = state[master_field][b.offset : b.offset + b.numel]
                weights["lm_head.weight"] = bound.view(b.shape).clone()
    save_file(weights, str(out / f"weights_rank{rank}.safetensors"))
    if spec.get("export_grads"):
        save_file(grads, str(out / f"grads_rank{rank}.safetensors"))
    report = {
        "units": [u.name for u in engine.units],
        "resident": [model.units[i].name for i in engine.window.resident],
        "on_device": [model.units[i].name for i in engine.device_opt.blocks],
        "kept": [model.units[i].name for i in sorted(engine.runner.kept)],
        "grad_acc": [model.units[i].name for i in engine.window.grad_acc],
        "store_nbytes": engine.store.nbytes,
        "memory": memory,
        "adamw_steps": None,
        "speculative": engine.updates.speculative,
        "update_choice": engine.run.update.line,
        "tier_bytes": [getattr(engine.optimizer, k, 0) for k in ("read_bytes", "write_bytes")],
    }
    if spec.get("export_state"):
        engine.wait_optimizer()
        state = {}
        for unit in engine.units:
            for name in ("exp_avg", "exp_avg_sq"):
                buf = states[unit.index][name]
                for p in unit.params:
                    state[f"{p.hf_name}.{name}"] = buf[p.offset : p.offset + p.numel].view(p.shape).clone()
        save_file(state, str(out / f"state_rank{rank}.safetensors"))
        report["adamw_steps"] = engine.optimizer.steps_by_name()
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        (out / "steps.json").write_text(json.dumps(steps))
    dist.barrier()  # keep every rank's mapping alive until all have measured
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_process(0)  # skip the interpreter's teardown: ~0.8 s of CPU per rank (run/jobs.py)
