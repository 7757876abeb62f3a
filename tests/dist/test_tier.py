"""The NVMe tier (``store.tier=nvme``, issue 23): bit for bit the run with ``store.tier=ram``.

Each case runs parity_worker.py's engine twice on the same seeded model and batches, once with the
optimizer state in RAM and once in a tier file on the real disk (pytest's tmp_path, not /dev/shm),
and compares every step's loss and gradient norm and every store field of every unit (the tier's
read back from its file) with ``torch.equal``. The RAM run is itself held to transformers + AdamW by
test_parity.py. One stage runs in this process (a gloo world of one), two stages in one torchrun
launch holding all of its variants.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
from pathlib import Path

import parity_worker
import pytest
import torch
from conftest import TINY_RUN, job_env, start_job, torchrun_cmd
from safetensors.torch import load_file
from test_parity import HF_BASE, Case, make_batches, parity_spec, save_seeded_model

from nodetrain.config.schema import Config, ConfigError, ModelConfig, StoreConfig, validate
from nodetrain.core.topology import Topology
from nodetrain.cost.memory import store_layout
from nodetrain.cost.shape import shape_of
from nodetrain.engine.host.tier_setup import open_tier, tier_skip
from nodetrain.engine.startup import open_store
from nodetrain.model import HFModel, build_hf_config
from nodetrain.optim.adamw import StoreAdamW
from nodetrain.optim.tier_files import TIER_FIELDS, TierLayout
from nodetrain.plan.host import preflight
from nodetrain.run.inject import NO_FAULTS, Faults

# fmt: off
ONE = Case("llama-1stage-gpipe-slots1-accum2x2", "LlamaForCausalLM", 1, "gpipe", 1, 2, 2)
TWO = Case("llama-2stage-1f1b-slots1-accum2x2",  "LlamaForCausalLM", 2, "1f1b",  1, 2, 2)
# fmt: on
LEAN = {"optim.state": "lean", "train.dtype": "bfloat16"}
TINY = [*TINY_RUN, "train.eval_every=0", "logging.plots=false", "logging.wandb=false"]


def _variants(tmp: Path, shm: Path, modes: dict[str, dict]) -> list[dict]:
    """Per mode, a RAM run and a tier run (2 buffers: fewer than the units, the pool must cycle)."""
    out = []
    for name, overrides in modes.items():
        for tier in ("ram", "nvme"):
            (shm / f"{name}-{tier}").mkdir()
            extra = {"store.tier_dir": str(tmp / "tier"), "store.tier_buffers": 2} if tier == "nvme" else {}
            out.append(
                {
                    "out_dir": str(tmp / f"{name}-{tier}"),
                    "run_id": f"tier-{name}-{tier}",
                    "overrides": {
                        **overrides,
                        **extra,
                        "store.tier": tier,
                        "store.dir": str(shm / f"{name}-{tier}"),
                    },
                }
            )
    return out


def _spec(case: Case, tmp: Path, shm: Path, modes: dict[str, dict]) -> dict:
    model_dir = tmp / "hf"
    save_seeded_model(case, model_dir)
    inputs, labels, _ = make_batches(case)
    (tmp / "tier").mkdir()
    spec = parity_spec(case, tmp, shm, model_dir, inputs, labels)
    spec.update(export_fields=True, variants=_variants(tmp, shm, modes))
    return spec


def _aligned(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // 4096) * 4096


def _tier_unit_bytes(fields: dict[str, torch.Tensor], state: str) -> list[int]:
    """Per unit of ``fields`` (``"<unit>.<field>"``), the page-aligned bytes of its tier fields."""
    units: dict[str, int] = {}
    for key, t in fields.items():
        unit, name = key.split(".", 1)
        units[unit] = units.get(unit, 0) + (_aligned(t) if name in TIER_FIELDS[state] else 0)
    return list(units.values())


def _check_same(tmp: Path, stages: int, modes) -> None:
    for name in modes:
        ram, nvme = tmp / f"{name}-ram", tmp / f"{name}-nvme"
        got, want = (json.loads((d / "steps.json").read_text()) for d in (nvme, ram))
        assert [(s["loss"], s["grad_norm"]) for s in got] == [(s["loss"], s["grad_norm"]) for s in want], name
        assert not any(s["skipped"] for s in want)
        for rank in range(stages):
            a = load_file(str(nvme / f"fields_rank{rank}.safetensors"))
            b = load_file(str(ram / f"fields_rank{rank}.safetensors"))
            assert sorted(a) == sorted(b) and a
            for key in b:
                assert torch.equal(a[key], b[key]), f"{name} rank {rank} {key}"
            report, ram_report = (json.loads((d / f"rank{rank}.json").read_text()) for d in (nvme, ram))
            read, written = report["tier_bytes"]
            assert read > 0 and written > 0, f"{name}: the tier was not used"
            if report["memory"]:  # the tier ranges of the store hold no pages (the pool is a memfd)
                sizes = _tier_unit_bytes(a, "lean" if "lean" in name else "full")
                saved = ram_report["memory"]["store"]["rss"] - report["memory"]["store"]["rss"]
                assert saved >= sum(sizes), (name, rank, saved, sizes)
    assert not list((tmp / "tier").iterdir()), "tier files left behind"


ONE_MODES = {
    "full-clip": {"optim.max_grad_norm": 0.3, "optim.speculative": False},  # deferred, overlapped
    "full-serial": {"optim.overlap": False},  # on the training thread
    "lean-inbackward": {**LEAN, "optim.max_grad_norm": 0.0},  # each unit as soon as it is final
}


def test_one_stage_tier_equals_ram(tmp_path: Path, shm_dir: Path, one_rank_world) -> None:
    spec = _spec(ONE, tmp_path, shm_dir, ONE_MODES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's ranks (conftest.job_env): no OpenMP team on a shared machine
    try:
        for variant in spec["variants"]:
            overrides = {**spec["overrides"], **variant["overrides"]}
            parity_worker.run_spec({**spec, **variant, "overrides": overrides}, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    _check_same(tmp_path, 1, ONE_MODES)


TWO_MODES = {
    "full-clip": {"optim.max_grad_norm": 0.3, "optim.speculative": False},
    "lean-clip": {**LEAN, "optim.max_grad_norm": 0.3},
}


def test_two_stage_tier_equals_ram(tmp_path: Path, shm_dir: Path, torchrun) -> None:
    spec = {**_spec(TWO, tmp_path, shm_dir, TWO_MODES), "memory_report": True}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    torchrun(2, parity_worker.__file__, str(tmp_path / "spec.json"), timeout_s=240)
    _check_same(tmp_path, 2, TWO_MODES)


@pytest.fixture(autouse=True)
def _clean_stores(shm_dir: Path):
    yield
    for d in shm_dir.iterdir():  # each variant's store directory (their stores are gone already)
        assert not list(d.iterdir()), f"stores left in {d}"
        d.rmdir()


# ----------------------------------------------------------------------------- refusals and failures


def _tiny_cfg(tmp: Path, **store) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(name="tiny", hf={**HF_BASE, "vocab_size": 512})
    cfg.train.dtype, cfg.plan.rank_overhead_gb = "float32", 0.0
    cfg.train.seq_len, cfg.data.vocab_size = 16, 512
    cfg.store = StoreConfig(dir=str(tmp), **store)
    return cfg


def test_bad_tier_keys_are_refused_naming_field_value_and_fix(tmp_path: Path) -> None:
    cfg = _tiny_cfg(tmp_path, tier="disk")
    with pytest.raises(ConfigError, match=r"store\.tier=disk: must be one of ram, nvme; use ram"):
        validate(cfg, 1)
    cfg = _tiny_cfg(tmp_path, tier="nvme", tier_dir=str(tmp_path / "missing"), tier_buffers=1)
    cfg.optim.speculative, cfg.optim.max_grad_norm = True, 1.0
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    msg = str(e.value)
    assert "store.tier_dir" not in msg  # a plan for another machine may name a directory this one lacks
    assert "store.tier_buffers=1: must be an integer >= 2" in msg
    assert "optim.speculative=true: backs up fp32 master weights and moments in host RAM" in msg
    cfg = _tiny_cfg(tmp_path, tier="nvme")
    with pytest.raises(ConfigError, match=r"store\.tier_dir='': required with store\.tier=nvme"):
        validate(cfg, 1)
    validate(_tiny_cfg(tmp_path, tier="nvme", tier_dir=str(tmp_path)), 1)  # a good one passes


def test_a_full_tier_dir_is_refused_up_front_and_ram_fits_less(tmp_path: Path) -> None:
    """The start-up fit check: the tier file against the free space of ``store.tier_dir``
    (os.statvfs, faked by the fault injector), and RAM holding the store without the tier's fields."""
    cfg = _tiny_cfg(tmp_path, tier="nvme", tier_dir=str(tmp_path), tier_buffers=2)
    model = HFModel(build_hf_config(cfg.model))
    store = store_layout(shape_of(model), torch.float32)
    tier = TierLayout(store).nbytes
    assert tier == sum(-(-4 * n // 4096) * 4096 * 3 for n in store.unit_numels)  # master + 2 moments
    with pytest.raises(
        ConfigError, match=rf"store\.tier_dir={tmp_path}: the tier needs 0\.00 GB .* use store\.tier=ram"
    ):
        preflight(cfg, model, 1, Faults(tier_free_bytes=tier - 1))
    preflight(cfg, model, 1, Faults(tier_free_bytes=tier))
    cfg.store.tier_dir = str(tmp_path / "missing")  # the training start-up, not validate, refuses it
    with pytest.raises(ConfigError, match=f"store.tier_dir={tmp_path / 'missing'}: not a directory"):
        preflight(cfg, model, 1, Faults(tier_free_bytes=tier))
    cfg.store.tier_dir = str(tmp_path)
    # RAM allowed: more than the store without its tier fields (+ the pool), less than the whole store
    faults = Faults(tier_free_bytes=tier, host_available_bytes=store.nbytes - 1)
    preflight(cfg, model, 1, faults)
    cfg.store.tier = "ram"
    with pytest.raises(ConfigError, match="host memory: the host store needs"):
        preflight(cfg, model, 1, faults)


def test_a_failing_tier_write_ends_every_rank_naming_the_file_and_errno(
    tmp_path: Path, corpus, shm_dir: Path
) -> None:
    """Rank 1's tier writes fail with EIO from its 6th on (after its start-up fills: during step 1's
    or 2's write-backs); the job ends, the error names the tier file, the offset and the errno."""
    (tmp_path / "tier").mkdir()
    tier = [f"store.tier_dir={tmp_path / 'tier'}", "store.tier=nvme"]
    overrides = [*TINY, *corpus, "train.steps=20", f"store.dir={shm_dir}", *tier]
    cmd = torchrun_cmd(2, "-m", "nodetrain.train", *overrides)
    faults = "tier_fail_rank=1,tier_fail_write=6"
    proc = start_job(cmd, job_env(NODETRAIN_RUNS=str(tmp_path / "runs"), NODETRAIN_FAULTS=faults))
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job hung: {proc.communicate()[0][-6000:]}")
    assert proc.returncode != 0
    got = re.search(r"tier write of unit \d+ failed: file (\S+), offset \d+, errno 5 \(EIO", out)
    assert got, out[-6000:]
    assert re.fullmatch(rf"{tmp_path / 'tier'}/nodetrain-.+-\d+\.tier", got[1]), got[1]
    (run,) = (tmp_path / "runs").iterdir()
    assert "job failed" in (run / "rank1.log").read_text()
    assert not list((tmp_path / "tier").iterdir()), "the tier file outlived the run"


def test_the_tier_says_what_lives_where(tmp_path: Path, shm_dir: Path, one_rank_world, caplog) -> None:
    """Issue 32, item 6: the start-up log says how many GB stay in RAM, how many go to NVMe, and the
    tier file's path; the figures are the files' own sizes (the store's mapping, the tier file, the pool)."""
    cfg = _tiny_cfg(shm_dir, tier="nvme", tier_dir=str(tmp_path), tier_buffers=2)
    model = HFModel(build_hf_config(cfg.model))
    topo = Topology.single(0, 1, 0)
    store = open_store(
        model, torch.float32, "full", cfg.store, topo, 60.0, "tier-log", model.units, tier_skip(cfg)
    )
    try:
        with caplog.at_level(logging.INFO, logger="nodetrain"):
            tier = open_tier(
                cfg, store, StoreAdamW(store, model.units, cfg.optim), topo, "tier-log", NO_FAULTS
            )
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("store.tier=nvme:"))
        file_bytes, pool_bytes = os.fstat(tier.tier.fd).st_size, os.fstat(tier.tier._pool_fd).st_size
        ram_bytes = store.layout.nbytes - file_bytes + pool_bytes
        found = re.fullmatch(
            r"store\.tier=nvme: ([\d.]+) GB in RAM \(.*\), ([\d.]+) GB on NVMe \(.*\) in (.+)", line
        )
        assert found, line
        assert float(found[1]) == pytest.approx(ram_bytes / 1e9, rel=1e-3)
        assert float(found[2]) == pytest.approx(file_bytes / 1e9, rel=1e-3) and file_bytes > 0
        assert Path(found[3]).parent == tmp_path and "master, exp_avg, exp_avg_sq" in line
        tier.close()
    finally:
        store.close()
