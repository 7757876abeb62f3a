"""Import and export of the families beyond Llama's (issue 21, item 3), against transformers itself.

Import: each family's tiny model as transformers' ``save_pretrained`` writes it — sharded
safetensors, tied or untied, mixtures of experts one tensor per expert (``hf_layout.py``) —
and, for two families, the config dialect of the hub's files (top-level ``rope_theta``; Gemma 3's
``rope_local_base_freq``), read through ``model.init_from`` alone: every master weight equals the
parameter transformers loads from the same directory. Export: the unit buffers written in the
layout ``checkpoint_pieces`` gives (what the checkpoint writer writes) load back into
transformers with the original logits and ``generate``. One CLI run does the whole path —
import, train on two stages, export — and transformers loads and generates with the checkpoint.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY_RUN, job_env, torchrun_cmd
from family_configs import FIELDS, tiny_config
from safetensors.torch import save_file

from nodetrain.checkpoint.export import write_export_files
from nodetrain.checkpoint.hf_import import check_model_dir, load_units
from nodetrain.checkpoint.hf_layout import checkpoint_pieces
from nodetrain.checkpoint.resume import load_training_state
from nodetrain.checkpoint.tensors import read_index
from nodetrain.config.schema import ModelConfig
from nodetrain.model import HFModel, build_hf_config
from nodetrain.run.outputs import checkpoint_bytes
from nodetrain.store import HostStore, StoreLayout

ROOT = Path(__file__).resolve().parents[2]
NEW = [a for a in FIELDS if a not in ("MistralForCausalLM", "Qwen2ForCausalLM")]


def _saved(arch: str, directory: Path, **fields) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = getattr(transformers, arch)(tiny_config(arch, **fields)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: saved, so checked
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(directory, max_shard_size="40KB")
    return model


def _hub_dialect(directory: Path) -> None:
    """config.json as transformers 4 wrote it: a top-level rope_theta (Gemma 3: with its local layers'
    base as ``rope_local_base_freq``), no rope_parameters."""
    raw = json.loads((directory / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    if "sliding_attention" in rope:
        raw["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    raw["rope_theta"] = rope["rope_theta"]
    (directory / "config.json").write_text(json.dumps(raw))


def _imported(directory: Path, shm_dir: Path) -> tuple[HFModel, HostStore]:
    model = HFModel(build_hf_config(ModelConfig(name="x", init_from=str(directory))))
    index = check_model_dir(directory, model)
    store = HostStore.create(StoreLayout(tuple(u.numel for u in model.units), torch.float32), shm_dir, "io")
    store.unlink()
    load_units(index, store, model.units, model=model)
    return model, store


CASES = [(a, False) for a in NEW] + [("Gemma3ForCausalLM", True), ("MixtralForCausalLM", True)]


@pytest.mark.parametrize(("arch", "dialect"), CASES, ids=lambda v: {False: "v5", True: "hub"}.get(v, v))
def test_import_then_export_round_trips_through_transformers(
    arch: str, dialect: bool, tmp_path, shm_dir
) -> None:
    tied = not FIELDS[arch].get("tie_word_embeddings", False)  # the other way round from the default
    src = tmp_path / "src"
    ref = _saved(arch, src, tie_word_embeddings=tied)
    assert len(list(src.glob("*.safetensors"))) > 1, "sharded"
    if dialect:
        _hub_dialect(src)
    model, store = _imported(src, shm_dir)
    assert model.tied == tied
    state = ref.state_dict()
    for u in model.units:
        for p in u.params:
            got = store.master(u.index)[p.offset : p.offset + p.numel].view(p.shape)
            assert torch.equal(got, state[p.hf_name]), p.hf_name
        for hf_name, value in model.constants[u.index].values():  # DeepSeek-V3's router bias
            assert torch.equal(value, state[hf_name]), hf_name

    out = tmp_path / "export"
    out.mkdir()
    tensors = {}
    for u in model.units:
        for p in u.params:
            flat = store.master(u.index)[p.offset : p.offset + p.numel]
            for q in checkpoint_pieces(model, p):
                tensors[q.name] = flat[q.offset : q.offset + q.numel].view(q.shape)
        tensors.update(dict(model.constants[u.index].values()))  # as the writer does
    save_file(tensors, str(out / "model.safetensors"))
    write_export_files(out, model.config, None, torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back) is type(ref)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            back(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
        assert back.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape == (1, 13)


def test_expert_checkpoint_names_are_transformers_own(tmp_path) -> None:
    """The per-expert names export writes are exactly the tensors transformers' save_pretrained
    writes (both MoE layouts), so the hub's files import and ours load anywhere theirs do."""
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM"):
        _saved(arch, tmp_path / arch)
        index = json.loads((tmp_path / arch / "model.safetensors.index.json").read_text())["weight_map"]
        model = HFModel(tiny_config(arch))
        names = {q.name for u in model.units for p in u.params for q in checkpoint_pieces(model, p)}
        names |= {hf for c in model.constants for hf, _ in c.values()}  # DeepSeek-V3's router bias
        assert names == set(index), arch


def test_cli_imports_trains_and_exports_a_mixture_of_experts(tmp_path: Path, corpus, shm_dir) -> None:
    """``model.init_from`` of a sharded Qwen3-MoE (router auxiliary loss on), 2 stages, 2 steps, an
    fp32 checkpoint at the end: its tensors are those transformers' save_pretrained writes (one per
    expert), transformers loads it with exactly the checkpoint's master weights, and generates. The
    fp32 export is the master weights: no ``master-*`` shards (issue 32, item 6), and resume reads
    them from the per-expert tensors bit for bit."""
    src = tmp_path / "hf"
    _saved("Qwen3MoeForCausalLM", src, vocab_size=320, hidden_size=64)
    run = tmp_path / "run"
    overrides = [*TINY_RUN, *corpus, "train.dtype=float32", "train.steps=2", "train.eval_every=0"]
    overrides += [
        "logging.wandb=false",
        f"store.dir={tmp_path}",
        f"model.init_from={src}",
        "data.tokenizer=bpe",
    ]
    overrides += ["model.router_aux_loss=per_layer", "checkpoint.every=2", "checkpoint.export_dtype=float32"]
    cmd = torchrun_cmd(2, "-m", "nodetrain.train", f"hydra.run.dir={run}", *overrides)
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    step = run / "checkpoints" / "step-2"
    model = transformers.AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32)
    assert isinstance(model, transformers.Qwen3MoeForCausalLM)
    trainer_state = json.loads((step / "trainer_state.json").read_text())
    assert trainer_state["weights"]["master"] == "model" and not list(step.glob("master-*"))
    saved = read_index(step, "model")  # the tensors transformers' save_pretrained writes (src is its)
    assert (
        set(saved) == set(read_index(src, "model")) and "model.layers.1.mlp.experts.3.up_proj.weight" in saved
    )
    size = sum(f.stat().st_size for f in step.glob("*.safetensors"))
    want_bytes = checkpoint_bytes(
        HFModel(build_hf_config(ModelConfig(name="x", init_from=str(src)))), "float32"
    )
    assert want_bytes <= size < want_bytes + 64 * 1024, "the checkpoint's size estimate is its size"
    ours = HFModel(model.config)
    store = HostStore.create(
        StoreLayout(tuple(u.numel for u in ours.units), torch.float32), shm_dir, "moe-resume"
    )
    try:
        load_training_state(step, trainer_state, store, ours.units, ours)  # what a resume reads
        state = model.state_dict()
        for u in ours.units:
            for p in u.params:
                got = store.master(u.index)[p.offset : p.offset + p.numel].view(p.shape)
                assert torch.equal(state[p.hf_name], got), p.hf_name
    finally:
        store.unlink()
    before = transformers.Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32)
    moved = state["model.layers.1.mlp.experts.gate_up_proj"] - before.model.layers[1].mlp.experts.gate_up_proj
    assert moved.abs().max() > 0, "the experts trained"
    tok = transformers.AutoTokenizer.from_pretrained(step)
    prompt = tok("Shall I compare thee", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt.input_ids.shape[1] + 4 or out[0, -1] == model.generation_config.eos_token_id


def test_cli_deepseek_router_bias_survives_import_resume_and_export(tmp_path: Path, corpus) -> None:
    """DeepSeek-V3 through the CLI: import (router bias non-zero), one step and a checkpoint, then
    ``checkpoint.resume=auto`` to step 2: the step-2 export holds the imported bias bit for bit (a
    resume that lost it would train and export zeros) and transformers loads and generates with it."""
    src = tmp_path / "hf"
    ref = _saved("DeepseekV3ForCausalLM", src, vocab_size=320, hidden_size=64)
    run = tmp_path / "run"
    base = [*TINY_RUN, *corpus, "train.dtype=float32", "train.eval_every=0", "logging.wandb=false"]
    base += [f"store.dir={tmp_path}", f"model.init_from={src}", "data.tokenizer=bpe", f"hydra.run.dir={run}"]
    base += ["checkpoint.every=1", "checkpoint.async_write=false"]
    for extra in (["train.steps=1"], ["train.steps=2", "checkpoint.resume=auto"]):
        cmd = torchrun_cmd(2, "-m", "nodetrain.train", *base, *extra)
        proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "init_from=" in (log := (run / "rank0.log").read_text()) and "is not read" in log  # resumed
    step = run / "checkpoints" / "step-2"
    model = transformers.AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32)
    for i in (1, 2):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        assert torch.equal(model.state_dict()[name], ref.state_dict()[name]), name
    moved = (
        model.state_dict()["model.layers.1.mlp.gate.weight"]
        - ref.state_dict()["model.layers.1.mlp.gate.weight"]
    )
    assert moved.abs().max() > 0, "the router trained"
    tok = transformers.AutoTokenizer.from_pretrained(step)
    with torch.no_grad():
        model.generate(**tok("Shall I compare thee", return_tensors="pt"), max_new_tokens=3, do_sample=False)
