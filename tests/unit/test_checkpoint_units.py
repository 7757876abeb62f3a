"""Checkpoint building blocks in this process: safetensors reading, HF import checks, RNG, manifests.

References are independent: files are written by ``safetensors.torch.save_file`` and
``transformers``' ``save_pretrained`` and read back by ``safetensors.torch.load_file``; RNG
streams are compared by drawing from them. The multi-process runs (resume, crash, export) are in
test_checkpoint_runs.py.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import TINY_HF
from safetensors.torch import load_file, save_file

from nodetrain import train
from nodetrain.checkpoint import state as st
from nodetrain.checkpoint import tensors
from nodetrain.checkpoint.hf_import import check_model_dir, load_hf_weights
from nodetrain.checkpoint.resume import choose_checkpoint
from nodetrain.config.schema import ModelConfig
from nodetrain.model import HFModel, build_hf_config
from nodetrain.run.jobs import REFUSALS
from nodetrain.store import HostStore, StoreLayout

# ----------------------------------------------------------------------------- tensors.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_read_into_converts_like_torch(tmp_path: Path, dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(tensors, "CHUNK_BYTES", 1000)  # many chunks, one ragged: the boundaries are tested
    gen = torch.Generator().manual_seed(0)
    want = {"a": torch.randn(37, 29, generator=gen).to(dtype), "b.c": torch.randn(3, generator=gen).to(dtype)}
    save_file(want, str(tmp_path / "x.safetensors"))
    header = tensors.read_header(tmp_path / "x.safetensors")
    assert sorted(header) == ["a", "b.c"] and header["a"].shape == (37, 29) and header["a"].dtype == dtype
    for name, t in load_file(str(tmp_path / "x.safetensors")).items():  # the library's own reading
        out = torch.full((t.numel(),), float("nan"))
        tensors.read_into(header[name], out)
        assert torch.equal(out, t.reshape(-1).to(torch.float32)), name


def test_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "model-00002-of-00003.safetensors"
    save_file({"w": torch.ones(100, 10)}, str(path))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 8)
    with pytest.raises(ValueError, match=r"model-00002-of-00003\.safetensors.*truncated"):
        tensors.read_header(path)


def test_index_naming_a_missing_shard_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        tensors.read_index(tmp_path)


# ----------------------------------------------------------------------------- hf_import.py


def _model(arch: str = "LlamaForCausalLM", **hf) -> HFModel:
    return HFModel(build_hf_config(ModelConfig(name="t", arch=arch, hf={**TINY_HF, **hf})))


def _save_hf(
    path: Path, arch: str = "LlamaForCausalLM", dtype=torch.float32, **hf
) -> dict[str, torch.Tensor]:
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**{**TINY_HF, **hf})
    torch.manual_seed(1)
    model = getattr(transformers, arch)(config).to(dtype)
    model.save_pretrained(path, max_shard_size="20KB")  # several shards and an index
    assert (path / "model.safetensors.index.json").is_file()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_fills_master_weights_exactly(tmp_path: Path, shm_dir: Path, dtype) -> None:
    want = _save_hf(tmp_path / "hf", dtype=dtype)
    model = _model()
    layout = StoreLayout(tuple(u.numel for u in model.units), torch.bfloat16)
    store = HostStore.create(layout, shm_dir, "import-test")
    try:
        load_hf_weights(tmp_path / "hf", store, model.units, model)
        for u in model.units:
            for p in u.params:
                got = store.master(u.index)[p.offset : p.offset + p.numel].view(p.shape)
                assert got.dtype == torch.float32
                assert torch.equal(got, want[p.hf_name].float()), p.hf_name
    finally:
        store.unlink()


def _problems(tmp_path: Path, model: HFModel) -> str:
    with pytest.raises(ValueError) as info:
        check_model_dir(tmp_path / "hf", model)
    return str(info.value)


def test_init_from_without_weights_is_a_refusal(tmp_path: Path, monkeypatch) -> None:
    """A ``model.init_from`` dir with config.json (and a tokenizer) but no weights: a CheckpointError
    refusal from train's Checkpointing construction, not a FileNotFoundError traceback on every rank."""
    hf_dir = tmp_path / "hf"
    transformers.LlamaConfig(**TINY_HF, architectures=["LlamaForCausalLM"]).save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_text("{}")
    model = _model()
    # the construction's import check, without the process group Checkpointing itself needs
    monkeypatch.setattr(train, "Checkpointing", lambda *a, **k: check_model_dir(hf_dir, model))
    with pytest.raises(st.CheckpointError, match="safetensors") as info:
        train._checkpointing(None, None, tmp_path, {}, model, None, "", None)
    assert isinstance(info.value, REFUSALS) and isinstance(info.value.__cause__, FileNotFoundError)


def test_import_lists_missing_unexpected_and_shape_problems(tmp_path: Path) -> None:
    _save_hf(tmp_path / "hf", intermediate_size=48)
    extra = tmp_path / "hf" / "extra.safetensors"
    save_file({"model.layers.0.mlp.extra.weight": torch.ones(2)}, str(extra))
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "extra.safetensors"
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    message = _problems(tmp_path, _model())  # the model wants intermediate_size 64
    assert "missing tensor model.norm.weight" in message
    assert "unexpected tensor model.layers.0.mlp.extra.weight" in message
    for i in range(2):
        assert f"model.layers.{i}.mlp.gate_proj.weight: shape (48, 32)" in message
        assert f"model.layers.{i}.mlp.down_proj.weight: shape (32, 48)" in message
    assert message.count("\n  ") >= 1 + 1 + 6, "every problem is listed, not only the first"


def test_import_refuses_another_or_unsupported_architecture(tmp_path: Path) -> None:
    _save_hf(tmp_path / "hf", arch="Qwen3ForCausalLM", head_dim=8)
    message = _problems(tmp_path, _model())
    assert "Qwen3ForCausalLM" in message and "model.arch=LlamaForCausalLM" in message
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert "architecture GPT2LMHeadModel is not supported" in _problems(tmp_path, _model())


def test_import_of_tied_into_untied_names_the_fix(tmp_path: Path) -> None:
    _save_hf(tmp_path / "hf", tie_word_embeddings=True)
    message = _problems(tmp_path, _model(tie_word_embeddings=False))
    assert "missing tensor lm_head.weight" in message and "tie_word_embeddings=true" in message
    check_model_dir(tmp_path / "hf", _model(tie_word_embeddings=True))  # the matching model loads


def test_import_refuses_integer_tensors(tmp_path: Path) -> None:
    want = _save_hf(tmp_path / "hf")
    for f in (tmp_path / "hf").glob("*.safetensors"):
        part = load_file(str(f))
        if "model.norm.weight" in part:
            part["model.norm.weight"] = torch.ones_like(want["model.norm.weight"], dtype=torch.int32)
            save_file(part, str(f), metadata={"format": "pt"})
    assert "model.norm.weight: dtype torch.int32" in _problems(tmp_path, _model())


# ----------------------------------------------------------------------------- state.py


def test_rng_states_survive_json_exactly() -> None:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    torch.rand(3), random.random(), np.random.rand()
    saved = json.loads(json.dumps(st.rng_state()))
    want = (torch.rand(5), [random.random() for _ in range(5)], np.random.rand(5))
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    st.set_rng_state(saved)
    got = (torch.rand(5), [random.random() for _ in range(5)], np.random.rand(5))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and np.array_equal(got[2], want[2])


def test_config_hash_ignores_only_what_leaves_the_math_alone() -> None:
    base = {"optim": {"lr": 1e-3}, "pipeline": {"stages": 2, "schedule": "1f1b"}, "checkpoint": {"every": 5}}
    same = {**base, "pipeline": {"stages": 4, "schedule": "1f1b"}, "checkpoint": {"every": 7}}
    other = {**base, "optim": {"lr": 2e-3}}
    assert st.config_hash(base) == st.config_hash(same)
    assert st.config_hash(base) != st.config_hash(other)
    assert st.config_differences(base, other) == ["optim.lr: 0.001 -> 0.002"]


def _fake_checkpoint(directory: Path, step: int, parent: Path | None = None, sequence: int = 0) -> Path:
    """A ``step-N`` directory with model, master and config files and a manifest, as the writer
    commits it; ``parent``/``sequence``: its place in a chain (state.py)."""
    ckpt = directory / st.step_dir_name(step)
    ckpt.mkdir(parents=True)
    names = ("model-00001-of-00001.safetensors", "master-00001-of-00001.safetensors", "config.json")
    save_file({"w": torch.full((64,), float(step))}, str(ckpt / names[0]))
    save_file({"w": torch.full((64,), float(step))}, str(ckpt / names[1]))
    (ckpt / "config.json").write_text("{}")
    files = {name: st.file_record(ckpt / name) for name in names}
    state = {"step": step, "files": files, "sequence": sequence}
    state["parent"] = None if parent is None else st.identity(parent, st.read_state(parent))
    st.write_state(ckpt / st.TRAINER_STATE, state)
    return ckpt


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)


def test_an_edited_trainer_state_is_refused_on_every_read(tmp_path: Path, caplog) -> None:
    """trainer_state.json is covered by its own digest: editing its step (4 -> 1, every other file
    intact) is refused by read_state and verify, so neither resume path nor auto trusts it."""
    _fake_checkpoint(tmp_path, 2)
    ckpt = _fake_checkpoint(tmp_path, 4)
    path = ckpt / st.TRAINER_STATE
    state = json.loads(path.read_text())
    state["step"] = 1
    path.write_text(json.dumps(state, indent=1))  # a hand edit: the manifest's files still match
    for read in (st.read_state, st.verify):
        with pytest.raises(st.CheckpointError, match=r"trainer_state\.json: its contents do not match"):
            read(ckpt)
    with pytest.raises(st.CheckpointError, match=r"checkpoint\.resume=.*edited or corrupted"):
        choose_checkpoint(str(ckpt), tmp_path)
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint("auto", tmp_path) == tmp_path / "step-2"
    assert "step-4/trainer_state.json" in caplog.text and "falling back" in caplog.text


def test_an_imported_checkpoint_is_verified_for_the_files_an_import_reads(tmp_path: Path) -> None:
    """model.init_from of a nodetrain checkpoint: its state digest and the sha256 of every file an
    import reads are checked; master/optimizer files are not read, so not hashed. A plain HF
    directory has no manifest: nothing to verify."""
    ckpt = _fake_checkpoint(tmp_path, 3)
    assert st.verify_import(ckpt) is True
    _flip_last_byte(ckpt / "master-00001-of-00001.safetensors")
    assert st.verify_import(ckpt) is True  # an import never reads it
    _flip_last_byte(ckpt / "model-00001-of-00001.safetensors")
    with pytest.raises(
        st.CheckpointError, match=r"model\.init_from=.*model-00001-of-00001\.safetensors: sha256"
    ):
        st.verify_import(ckpt)
    (tmp_path / "hf").mkdir()
    assert st.verify_import(tmp_path / "hf") is False


def _branched(tmp_path: Path) -> dict[int, Path]:
    """Chain 2 -> 4 -> 6, then a run resumed step-2 and saved step-3: the newest branch."""
    c = {2: _fake_checkpoint(tmp_path, 2, sequence=1)}
    c[4] = _fake_checkpoint(tmp_path, 4, c[2], sequence=2)
    c[6] = _fake_checkpoint(tmp_path, 6, c[4], sequence=3)
    c[3] = _fake_checkpoint(tmp_path, 3, c[2], sequence=4)
    return c


def test_auto_continues_the_branch_the_last_run_was_on(tmp_path: Path) -> None:
    c = _branched(tmp_path)
    assert st.chain({p: st.read_state(p) for p in c.values()}, c[3]) == [c[3], c[2]]
    assert choose_checkpoint("auto", tmp_path) == c[3], "not the abandoned branch's newer step-6"
    _flip_last_byte(c[3] / "config.json")
    assert choose_checkpoint("auto", tmp_path) == c[2], "a corrupt head falls back along its own chain"


@pytest.mark.parametrize(("keep_last", "left"), [(2, [2, 3, 4, 6]), (1, [3, 4, 6])])
def test_keep_last_prunes_only_the_chain_of_the_new_checkpoint(tmp_path: Path, keep_last, left) -> None:
    """After resuming step-2 and saving step-3, keep_last counts step-3 and its ancestors; the
    abandoned branch (step-4, step-6) is neither counted nor removed, and the branch point stays
    while keep_last allows."""
    from types import SimpleNamespace

    from nodetrain.checkpoint.writer import CheckpointWriter

    c = _branched(tmp_path)
    writer = CheckpointWriter.__new__(CheckpointWriter)  # only its directory and keep_last matter here
    writer.dir, writer.cfg = tmp_path, SimpleNamespace(keep_last=keep_last)
    writer._prune(c[3])
    assert [s for s, _ in st.complete_checkpoints(tmp_path)] == left


def test_non_finite_imported_weights_are_named(tmp_path: Path, shm_dir: Path) -> None:
    want = _save_hf(tmp_path / "hf")
    for f in (tmp_path / "hf").glob("*.safetensors"):
        part = load_file(str(f))
        if "model.layers.1.mlp.up_proj.weight" in part:
            part["model.layers.1.mlp.up_proj.weight"][3, :5] = float("nan")
            part["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
            save_file(part, str(f), metadata={"format": "pt"})
    assert torch.isfinite(want["model.layers.1.mlp.up_proj.weight"]).all()
    model = _model()
    layout = StoreLayout(tuple(u.numel for u in model.units), torch.bfloat16)
    store = HostStore.create(layout, shm_dir, "nan-import-test")
    try:
        with pytest.raises(ValueError) as info:
            load_hf_weights(tmp_path / "hf", store, model.units, model)
    finally:
        store.unlink()
    message = str(info.value)
    assert "1 tensor(s) hold NaN or inf" in message
    assert "model.layers.1.mlp.up_proj.weight: 6 of 2048 values are NaN/inf" in message


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    ckpt = _fake_checkpoint(tmp_path, 3)
    st.verify(ckpt)
    target = ckpt / "model-00001-of-00001.safetensors"
    if damage == "truncate":
        os.truncate(target, target.stat().st_size - 1)
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 1
        target.write_bytes(data)
    else:
        target.unlink()
    want = {"truncate": "truncated", "flip": "sha256", "delete": "missing"}[damage]
    with pytest.raises(st.CheckpointError, match=rf"model-00001-of-00001\.safetensors.*{want}"):
        st.verify(ckpt)
    with pytest.raises(st.CheckpointError, match=r"checkpoint\.resume="):
        choose_checkpoint(str(ckpt), tmp_path)


def test_auto_takes_the_newest_complete_and_falls_back_with_a_warning(tmp_path: Path, caplog) -> None:
    assert choose_checkpoint("auto", tmp_path) is None  # nothing yet: a fresh start
    assert choose_checkpoint("", tmp_path) is None
    for step in (2, 4, 10):
        _fake_checkpoint(tmp_path, step)
    shutil.copytree(tmp_path / "step-10", tmp_path / "step-12.tmp")  # an interrupted save: never chosen
    (tmp_path / "step-14").mkdir()  # no trainer_state.json: incomplete
    assert choose_checkpoint("auto", tmp_path) == tmp_path / "step-10"  # numeric order, not text
    os.truncate(tmp_path / "step-10" / "config.json", 0)
    with caplog.at_level(logging.WARNING):
        assert choose_checkpoint("auto", tmp_path) == tmp_path / "step-4"
    assert "step-10/config.json" in caplog.text and "falling back" in caplog.text
    for step in (2, 4):
        os.truncate(tmp_path / f"step-{step}" / "config.json", 0)
    with pytest.raises(st.CheckpointError, match="every checkpoint"):
        choose_checkpoint("auto", tmp_path)


@pytest.mark.parametrize("enable", [True, False])
def test_after_step_saves_only_when_checkpoints_are_enabled(enable: bool) -> None:
    """``checkpoint.enable=false`` saves nothing: not at ``every``, before ``stop_after_steps`` ends
    the launch, at the last step or on a signal; the stop still ends the launch."""
    from types import SimpleNamespace

    from nodetrain.checkpoint import Checkpointing
    from nodetrain.config.schema import Config

    cfg = Config()
    cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.enable = 6, 2, enable
    cfg.checkpoint.stop_after_steps = 5
    saved = []
    writer = SimpleNamespace(save=lambda step, state: saved.append(step) or 0.0, poll=lambda: None)
    ckpt = SimpleNamespace(
        cfg=cfg, start_step=0, writer=writer, _wait_optimizer=lambda: None, _run_state=lambda step: {}
    )
    stops = [Checkpointing.after_step(ckpt, step)[0] for step in range(1, 6)]
    stops.append(Checkpointing.after_step(ckpt, 6, save=True)[0])  # the last step, and a signal
    assert stops == [False, False, False, False, True, False]
    assert saved == ([2, 4, 5, 6] if enable else [])
