"""A checkpoint directory is usable on its own: ``AutoTokenizer`` + ``AutoModelForCausalLM`` +
``generate`` with nothing else, stopping on the run's end-of-text id (issue 10, item 4); and after
a crash and ``checkpoint.resume=auto``, metrics.jsonl holds one row per step (item 5).

The reference is ``transformers`` loading the directory; the eos check makes ``<|endoftext|>``
(id 0 in our BPE) the greedy choice, so generation must stop after one token — with Llama's
default eos id 2 (the byte token ``"``) it would run to ``max_new_tokens``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from chat_fixtures import bpe_tokenizer, family_tokenizer, qwen3_tokenizer
from conftest import SONNET, TINY_RUN, job_env, prepared_dir, torchrun_cmd

from nodetrain.checkpoint.export import run_tokenizer, write_export_files
from nodetrain.config.schema import DataConfig
from nodetrain.data import datasets as data

ROOT = Path(__file__).resolve().parents[2]

TINY = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64
)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("export")
    (d / "sonnet.txt").write_text(SONNET * 50)
    return data.prepare(DataConfig(source=str(d / "sonnet.txt"), dir=str(d / "prepared"), vocab_size=300))


def _emit(token_id: int):
    """A logits processor that makes ``token_id`` the only choice: [B, V] scores -> [B, V]."""

    def process(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, -float("inf"))
        forced[:, token_id] = 0.0
        return forced

    return transformers.LogitsProcessorList([process])


def assert_generates_until_eos(step_dir: Path, eot_id: int) -> None:
    """Load ``step_dir`` with transformers alone, check its special ids, and generate greedily while
    forcing the document separator: generation must stop after exactly that one token (with a
    wrong eos it would emit it until ``max_new_tokens``)."""
    tok = transformers.AutoTokenizer.from_pretrained(step_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(step_dir, dtype=torch.float32)
    assert tok.eos_token_id == eot_id == model.config.eos_token_id == model.generation_config.eos_token_id
    assert model.config.bos_token_id == tok.bos_token_id and model.config.pad_token_id == tok.pad_token_id
    prompt = tok("Shall I compare thee", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False, logits_processor=_emit(eot_id + 1))
        assert out.shape[1] == prompt.input_ids.shape[1] + 8, "no eos: runs to max_new_tokens"
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False, logits_processor=_emit(eot_id))
    assert out[0, prompt.input_ids.shape[1] :].tolist() == [eot_id], "generation stops on the run's eos"


def assert_stops_on(step_dir: Path, stop_ids: list[int]) -> None:
    """Load ``step_dir`` with transformers alone and generate greedily while forcing one token:
    a token of ``stop_ids`` ends generation after itself, any other runs to ``max_new_tokens``."""
    tok = transformers.AutoTokenizer.from_pretrained(step_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(step_dir, dtype=torch.float32)
    prompt = tok("Shall I compare thee", return_tensors="pt")
    n = prompt.input_ids.shape[1]
    other = next(i for i in range(len(tok)) if i not in stop_ids)
    with torch.no_grad():
        assert (
            model.generate(**prompt, max_new_tokens=6, do_sample=False, logits_processor=_emit(other)).shape[
                1
            ]
            == n + 6
        )
        for stop in stop_ids:
            out = model.generate(**prompt, max_new_tokens=6, do_sample=False, logits_processor=_emit(stop))
            assert out[0, n:].tolist() == [stop], f"generation stops on {tok.convert_ids_to_tokens(stop)}"


def _imported(tmp_path: Path, eos: int, bos: int | None = None) -> tuple[Path, transformers.PretrainedConfig]:
    """A tiny Qwen3 saved as ``model.init_from`` would find it: its generation_config.json holds its
    own tokenizer's ids (``eos``) and a sampling default; returns the dir and its loaded config."""
    src = tmp_path / "base"
    config = transformers.Qwen3Config(**TINY, vocab_size=300, head_dim=16, eos_token_id=eos, bos_token_id=bos)
    transformers.Qwen3ForCausalLM(config).save_pretrained(src)
    transformers.GenerationConfig(
        eos_token_id=eos, bos_token_id=bos, do_sample=True, temperature=0.6
    ).save_pretrained(src)
    return src, transformers.AutoConfig.from_pretrained(src)


@pytest.mark.parametrize("eos", ["<|endoftext|>", "<|im_end|>"])
def test_export_after_init_from_stops_on_the_chat_tokenizer_s_terminator(tmp_path: Path, eos: str) -> None:
    """model.init_from a base model + data.tokenizer= a chat tokenizer (issue 24, part 3): both
    configs carry the tokenizer's ids, the turn terminator among the eos ids, and the base model's
    sampling defaults stay; generate stops on each stop id."""
    tok = qwen3_tokenizer(eos)
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    src, config = _imported(tmp_path, eos=150)  # the imported model's own id
    step = tmp_path / "step"
    transformers.Qwen3ForCausalLM(config).save_pretrained(step)
    write_export_files(step, config, tok, torch.float32, source_dir=src)
    want = [endoftext, im_end] if eos == "<|endoftext|>" else im_end
    generation = json.loads((step / "generation_config.json").read_text())
    assert (
        json.loads((step / "config.json").read_text())["eos_token_id"] == generation["eos_token_id"] == want
    )
    assert generation["pad_token_id"] == endoftext
    assert generation["temperature"] == 0.6
    assert_stops_on(step, want if isinstance(want, list) else [want])


def test_export_after_init_from_with_a_new_bpe_carries_the_bpe_s_eos(tmp_path: Path, prepared: Path) -> None:
    """model.init_from + data.tokenizer=bpe: the imported eos id 2 is a byte of the new BPE ('#'),
    the export's eos/bos/pad are the BPE's end-of-text (id 0) in both configs."""
    src, config = _imported(tmp_path, eos=2, bos=1)
    step = tmp_path / "step"
    transformers.Qwen3ForCausalLM(config).save_pretrained(step)
    write_export_files(step, config, run_tokenizer(prepared, "bpe"), torch.float32, source_dir=src)
    assert_generates_until_eos(step, 0)


def test_export_carries_trained_bpe_and_its_eos(tmp_path: Path, prepared: Path) -> None:
    eot_id = json.loads((prepared / "meta.json").read_text())["eot_id"]
    assert eot_id == 0
    config = transformers.LlamaConfig(**TINY, vocab_size=300)  # bos 1 / eos 2: bytes '"' and '!' here
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    written = write_export_files(tmp_path, config, run_tokenizer(prepared), torch.float32)
    names = {p.name for p in written}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert_generates_until_eos(tmp_path, eot_id)


def test_export_keeps_a_hf_tokenizer_s_chat_template(tmp_path: Path, prepared: Path) -> None:
    """A ``data.tokenizer`` that is a HF directory: its chat template and eos travel with the export."""
    hf_tok = run_tokenizer(prepared)
    hf_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    hf_tok.save_pretrained(tmp_path / "tok")
    config = transformers.Qwen3Config(**TINY, vocab_size=300, head_dim=16)
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path / "step")
    write_export_files(tmp_path / "step", config, run_tokenizer(prepared, tmp_path / "tok"), torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "step")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi<|endoftext|>"
    assert_generates_until_eos(tmp_path / "step", 0)


def test_crash_resume_keeps_one_row_per_step_and_exports_usable_checkpoints(tmp_path: Path, corpus) -> None:
    """2 ranks: checkpoint at step 2, rank 0 fails at the start of step 4 (rows 1-3 written);
    ``checkpoint.resume=auto`` into the same directory runs 3-5. metrics.jsonl then holds steps
    1..5 once each, and step-5 loads and generates with transformers alone."""
    run = tmp_path / "run"
    base = [*TINY_RUN, *corpus, "logging.wandb=false", f"store.dir={tmp_path}", "train.eval_every=0"]
    base += ["train.steps=5", "checkpoint.every=2", "train.dtype=float32", f"hydra.run.dir={run}"]
    base += ["checkpoint.async_write=false"]  # step-2 is committed at step 3, before the failure
    crash = subprocess.run(
        torchrun_cmd(2, "-m", "nodetrain.train", *base),
        cwd=ROOT,
        env=job_env(NODETRAIN_FAULTS="fail_rank=0,fail_step=4"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert crash.returncode != 0
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], "the crashed launch logged step 3 after the step-2 checkpoint"
    resume = subprocess.run(
        torchrun_cmd(2, "-m", "nodetrain.train", *base, "checkpoint.resume=auto"),
        cwd=ROOT,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resume.returncode == 0, (resume.stdout + resume.stderr)[-6000:]
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert "starts from the checkpoint of step 2; dropping 1 row(s)" in (run / "rank0.log").read_text()
    eot_id = json.loads((prepared_dir(corpus[1].split("=", 1)[1]) / "meta.json").read_text())["eot_id"]
    assert_generates_until_eos(run / "checkpoints" / "step-5", eot_id)


# --- the stop list (issue 32, item 5) -------------------------------------------------------------------

FAMILY_STOPS = {  # family: (the hub's generation_config eos tokens, what its template alone gives)
    "gptoss": (["<|return|>", "<|endoftext|>", "<|call|>"], ["<|return|>", "<|call|>"]),
    "phi3": (["<|endoftext|>", "<|assistant|>", "<|end|>"], ["<|endoftext|>", "<|end|>"]),
    "glm4moe": (
        ["<|endoftext|>", "<|user|>", "<|observation|>"],
        ["<|endoftext|>", "<|user|>", "<|observation|>"],
    ),
}


def _export_eos(tmp_path: Path, tok, imported: list[int] | None) -> tuple[list[int], list[int]]:
    """(config.json's, generation_config.json's) eos ids of an export with ``tok``: of a model
    imported with eos ``imported`` (config and generation config alike), or (None) built from scratch."""
    config = transformers.Qwen3Config(**TINY, vocab_size=len(tok), head_dim=16)
    src = None
    if imported is not None:
        src = tmp_path / "base"
        transformers.Qwen3ForCausalLM(config).save_pretrained(src)
        raw = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**raw, "eos_token_id": imported}))
        transformers.GenerationConfig(eos_token_id=imported, temperature=0.6, do_sample=True).save_pretrained(
            src
        )
        config = transformers.AutoConfig.from_pretrained(src)
    step = tmp_path / "step"
    transformers.Qwen3ForCausalLM(config).save_pretrained(step)
    write_export_files(step, config, tok, torch.float32, source_dir=src or "")
    read = [
        json.loads((step / f).read_text())["eos_token_id"] for f in ("config.json", "generation_config.json")
    ]
    return tuple(r if isinstance(r, list) else [r] for r in read)


def test_export_keeps_an_instruct_model_s_stop_list_with_a_base_tokenizer(tmp_path: Path) -> None:
    """A Llama-3.1-Instruct-shaped import (eos ``[<|end_of_text|>, <|eom_id|>, <|eot_id|>]``) exported
    with a base tokenizer (eos ``<|end_of_text|>``, no chat template) keeps all three, in the model's
    order, and ``generate`` stops on each; an id of another vocabulary (a byte of the run's BPE) is
    not carried over."""
    tok = bpe_tokenizer(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|endoftext|>")
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eom_id|>",
                "<|eot_id|>",
            ]
        }
    )
    want = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])
    assert _export_eos(tmp_path, tok, want) == (want, want)
    assert_stops_on(tmp_path / "step", want)
    byte = tok.convert_tokens_to_ids("a")
    assert _export_eos(tmp_path / "bpe", tok, [byte, want[2]]) == ([want[2], want[0]], [want[2], want[0]])


@pytest.mark.parametrize("family", list(FAMILY_STOPS))
def test_export_stops_on_the_union_of_the_imported_eos_the_tokenizer_s_and_the_template_s(
    tmp_path: Path, family: str
) -> None:
    """GPT-OSS keeps ``<|call|>`` (tool-call turns stop), Phi-3 ``<|end|>``, GLM-4.5 its next-role
    markers: imported, and from the template alone for a model built from scratch."""
    tok = family_tokenizer(family)
    hub, template = (tok.convert_tokens_to_ids(t) for t in FAMILY_STOPS[family])
    assert _export_eos(tmp_path / "imported", tok, hub) == (hub, hub)
    assert _export_eos(tmp_path / "scratch", tok, None) == (template, template)
