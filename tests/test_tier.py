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
from pathlib import Path

import parity_worker
import pytest
import torch
from safetensors.torch import load_file
from test_parity import Case, make_batches, parity_spec, save_seeded_model

# fmt: off
ONE = Case("llama-1stage-gpipe-slots1-accum2x2", "LlamaForCausalLM", 1, "gpipe", 1, 2, 2)
TWO = Case("llama-2stage-1f1b-slots1-accum2x2",  "LlamaForCausalLM", 2, "1f1b",  1, 2, 2)
# fmt: on
LEAN = {"optim.state": "lean", "train.dtype": "bfloat16"}


def _variants(tmp: Path, shm: Path, modes: dict[str, dict]) -> list[dict]:
    """Per mode, a RAM run and a tier run (2 buffers: fewer than the units, the pool must cycle)."""
    out = []
    for name, overrides in modes.items():
        for tier in ("ram", "nvme"):
            (shm / f"{name}-{tier}").mkdir()
            extra = {"store.tier_dir": str(tmp / "tier"), "store.tier_buffers": 2} if tier == "nvme" else {}
            out.append({"out_dir": str(tmp / f"{name}-{tier}"), "run_id": f"tier-{name}-{tier}",
                        "overrides": {**overrides, **extra, "store.tier": tier,
                                      "store.dir": str(shm / f"{name}-{tier}")}})  # fmt: skip
    return out


def _spec(case: Case, tmp: Path, shm: Path, modes: dict[str, dict]) -> dict:
    model_dir = tmp / "hf"
    save_seeded_model(case, model_dir)
    inputs, labels, _ = make_batches(case)
    (tmp / "tier").mkdir()
    spec = parity_spec(case, tmp, shm, model_dir, inputs, labels)
    spec.update(export_fields=True, variants=_variants(tmp, shm, modes))
    return spec


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
            read, written = json.loads((nvme / f"rank{rank}.json").read_text())["tier_bytes"]
            assert read > 0 and written > 0, f"{name}: the tier was not used"
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


TWO_MODES = {"full-clip": {"optim.max_grad_norm": 0.3, "optim.speculative": False},
             "lean-clip": {**LEAN, "optim.max_grad_norm": 0.3}}  # fmt: skip


def test_two_stage_tier_equals_ram(tmp_path: Path, shm_dir: Path, torchrun) -> None:
    spec = _spec(TWO, tmp_path, shm_dir, TWO_MODES)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    torchrun(2, parity_worker.__file__, str(tmp_path / "spec.json"), timeout_s=240)
    _check_same(tmp_path, 2, TWO_MODES)


@pytest.fixture(autouse=True)
def _clean_stores(shm_dir: Path):
    yield
    for d in shm_dir.iterdir():  # each variant's store directory (their stores are gone already)
        assert not list(d.iterdir()), f"stores left in {d}"
        d.rmdir()
