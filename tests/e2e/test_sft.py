"""Instruction data and packing (issue 10, "Instruction and real data").

* Packing: a packed batch through nodetrain's blocks (position ids restarting per document, the
  layer templates called with ``functional_call``) gives the summed loss and the gradients of the
  same documents run one by one through ``transformers`` (fp32, 1e-5).
* Loss masks: ``prompt``/``completion`` and chat ``messages`` (rendered with the tokenizer's own
  template) put labels only on completion / assistant tokens, checked against the text.
* A chat-SFT run (tiny Qwen3 with a chat template, 2 stages, ``data.format=records``, packed): the
  step-1 loss equals transformers' loss with the same labels on each document of the step's rows
  run alone (1e-5). (transformers 5.24's ``forward(position_ids=packed)`` detects packing only
  without a KV cache, i.e. with ``use_cache=False``; with the saved config's ``use_cache=True`` it
  attends across documents — 5.7393 here against 5.7469 for the documents alone.)
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from chat_fixtures import bpe_tokenizer
from conftest import SONNET, job_env, torchrun_cmd

from nodetrain.checkpoint.export import run_tokenizer
from nodetrain.config.schema import Config, DataConfig
from nodetrain.data import datasets as data
from nodetrain.data.checks import open_splits
from nodetrain.data.packing import IGNORE_INDEX, pack, pairs
from nodetrain.data.sft import RecordsDataset, load_records, prepare_records, tokenize_record
from nodetrain.model import HFModel

ROOT = Path(__file__).resolve().parents[2]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    tie_word_embeddings=True,
)
CHATS = [
    [
        {"role": "system", "content": "You answer in verse."},
        {"role": "user", "content": "Compare me to a day."},
        {"role": "assistant", "content": "Thou art more lovely and more temperate."},
        {"role": "user", "content": "And the wind?"},
        {"role": "assistant", "content": "Rough winds do shake the darling buds of May."},
    ],
    [
        {"role": "user", "content": "How long is summer?"},
        {"role": "assistant", "content": "Summer's lease hath all too short a date."},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 (320 rows) saved with its tokenizer: our BPE + ChatML tokens and template."""
    d = tmp_path_factory.mktemp("sft")
    (d / "sonnet.txt").write_text(SONNET * 50)
    prepared = data.prepare(DataConfig(source=str(d / "sonnet.txt"), dir=str(d / "prepared"), vocab_size=300))
    tok = run_tokenizer(prepared)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"}
    )
    tok.chat_template = CHATML
    torch.manual_seed(7)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN)).save_pretrained(d / "hf")
    tok.save_pretrained(d / "hf")
    return d / "hf"


def _docs(lengths: list[int], vocab: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        mask = rng.random(n) < 0.7
        out.append(pairs(rng.integers(0, vocab, n), mask))
    return out


def _blocks_loss(model: HFModel, params: dict[str, torch.Tensor], x, y, pos) -> torch.Tensor:
    """Summed token loss of [B, T] rows through every block with HF-named ``params`` bound."""
    h = x
    for i in range(len(model.units)):
        bound = {}
        for b in model.bindings[i]:
            unit = model.units[b.unit]
            name = next(p.hf_name for p in unit.params if p.offset == b.offset)
            bound[b.local_name] = params[name]
        ctx = model.context(h, pos) if 0 < i < len(model.units) - 1 else None
        h = model.forward_block(i, bound, h, ctx)
    return F.cross_entropy(h.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def test_packed_rows_equal_the_documents_one_by_one() -> None:
    config = transformers.Qwen3Config(**QWEN, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(config).float()
    docs = _docs([9, 5, 14, 3, 12, 7], 320, seed=1)
    rows = pack(docs, 24, pad_id=0)
    assert rows.num_rows == 3 and (rows.position_ids[:, 0] == 0).all()
    model = HFModel(config)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in ref.state_dict().items()}
    x, y, pos = (torch.from_numpy(a) for a in (rows.input_ids, rows.labels, rows.position_ids))
    got = _blocks_loss(model, params, x, y, pos)
    got.backward()

    want = 0
    for inputs, labels in docs:  # each document alone, positions 0..n-1, no packing
        logits = ref(input_ids=torch.from_numpy(inputs)[None]).logits[0]  # [n, V]
        want = want + F.cross_entropy(
            logits, torch.from_numpy(labels), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    named = dict(ref.named_parameters())
    for name, p in params.items():
        if name in named:
            torch.testing.assert_close(p.grad, named[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():  # the same rows without the restarting positions attend across documents
        crossed = _blocks_loss(model, params, x, y, None)
    assert abs(float(crossed) - want.item()) > 1e-3


def test_unpacked_rows_hold_one_document_each() -> None:
    docs = _docs([9, 5, 30], 50, seed=2)
    rows = pack(docs, 16, pad_id=3, packing=False)
    assert rows.num_rows == 3 and rows.num_truncated == 1
    assert rows.input_ids[1, 4:].tolist() == [3] * 12 and (rows.labels[1, 4:] == IGNORE_INDEX).all()
    assert rows.position_ids[0].tolist() == [*range(8), *range(8)]


def test_records_read_from_jsonl_parquet_and_a_datasets_directory(tmp_path: Path) -> None:
    import datasets

    records = [{"prompt": "Shall I", "completion": f" compare {i}"} for i in range(3)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(str(tmp_path / "r.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for source in ("r.jsonl", "r.parquet", "saved"):
        assert load_records(tmp_path / source).to_list() == records, source
    with pytest.raises(ValueError, match=r"data\.source=.*r\.csv.*not a records file"):
        load_records(tmp_path / "r.csv")


def test_loss_masks_cover_completions_and_assistant_turns(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids, mask = tokenize_record({"prompt": "Shall I compare", "completion": " thee"}, tok)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == " thee<|im_end|>"
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if not m]) == "Shall I compare"
    ids, mask = tokenize_record({"messages": CHATS[0]}, tok)
    assert tok.decode(ids) == tok.apply_chat_template(CHATS[0], tokenize=False)
    targets = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    want = "".join(m["content"] + "<|im_end|>\n" for m in CHATS[0] if m["role"] == "assistant")
    assert targets == want
    ids, mask = tokenize_record({"text": "Shall I"}, tok, add_bos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and all(mask)


def test_generation_markers_give_the_same_mask(model_dir: Path) -> None:
    """A template with {% generation %} markers: transformers' assistant mask, equal to the spans
    the prefix rule finds for ChatML (marked: assistant content and its end-of-turn)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    want = tokenize_record({"messages": CHATS[0]}, tok)
    tok.chat_template = CHATML.replace(
        "{{ m['content'] }}<|im_end|>\n",
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
        "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}",
    )
    assert "generation" in tok.chat_template
    assert tokenize_record({"messages": CHATS[0]}, tok) == want


def test_a_template_that_re_renders_the_last_turn_masks_what_generation_produces(model_dir: Path) -> None:
    """Qwen3-style: the last assistant turn gets an empty think block, so a conversation is not
    the prefix of its continuation; each turn's targets are what follows its generation prompt,
    through the terminator and the newline the template writes after it (the think block of the
    last turn included: generation produces it)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = CHATML.replace(
        "{{ m['content'] }}",
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}",
    )
    ids, mask = tokenize_record({"messages": CHATS[0]}, tok)
    assert "<think>" in tok.decode(ids)
    targets = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    first, last = (m["content"] for m in CHATS[0] if m["role"] == "assistant")
    assert targets == f"{first}<|im_end|>\n<think>\n\n</think>\n\n{last}<|im_end|>\n"


def test_chat_sft_step1_loss_equals_transformers(tmp_path: Path, model_dir: Path) -> None:
    records = [{"messages": c} for c in CHATS] * 6 + [
        {"prompt": "Shall I", "completion": " compare thee"}
    ] * 4
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run, prepared = tmp_path / "run", tmp_path / "rows"
    overrides = ["model=qwen3_tiny", f"model.init_from={model_dir}", f"data.tokenizer={model_dir}"]
    overrides += ["data.format=records", f"data.source={tmp_path / 'chat.jsonl'}", f"data.dir={prepared}"]
    overrides += [
        "data.val_fraction=0.2",
        "train.seq_len=256",
        "train.micro_batch_size=1",
        "pipeline.microbatches=2",
    ]
    overrides += [
        "train.steps=1",
        "train.eval_every=0",
        "train.dtype=float32",
        "logging.wandb=false",
        "seed=0",
    ]
    overrides += [f"store.dir={tmp_path}", f"hydra.run.dir={run}"]
    cmd = torchrun_cmd(2, "-m", "nodetrain.train", *overrides)
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    got = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]

    (rows_dir,) = prepared.glob("chat-records-*")  # its own directory under data.dir
    rows = RecordsDataset.open(rows_dir, "train")
    x, y, pos = (torch.from_numpy(a) for a in rows.batch(0, 0, 2))  # step 0: 2 rows of 256
    assert (y == IGNORE_INDEX).float().mean() > 0.3, "prompts and padding take no loss"
    assert ((pos[:, 1:] == 0).sum(1) >= 2).all(), "each row packs several documents"
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = 0.0
    with torch.no_grad():  # every document of the packed rows alone, as transformers runs it
        for r in range(2):
            starts = [*(pos[r] == 0).nonzero().flatten().tolist(), pos.shape[1]]
            for a, b in itertools.pairwise(starts):
                logits = ref(input_ids=x[r : r + 1, a:b]).logits[0]  # [n, 320]
                total += F.cross_entropy(logits, y[r, a:b], ignore_index=IGNORE_INDEX, reduction="sum").item()
    want = total / int((y != IGNORE_INDEX).sum())
    assert got == pytest.approx(want, rel=1e-5, abs=0)
    step = run / "checkpoints" / "step-1"
    tok = transformers.AutoTokenizer.from_pretrained(step)
    assert tok.chat_template == CHATML and tok.eos_token == "<|im_end|>"
    assert json.loads((step / "config.json").read_text())["eos_token_id"] == tok.eos_token_id


def _records_cfg(tmp_path: Path, model_dir: Path, records: list[dict], **kw) -> DataConfig:
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return DataConfig(
        source=str(tmp_path / "r.jsonl"),
        dir=str(tmp_path / "rows"),
        tokenizer=str(model_dir),
        format="records",
        **kw,
    )


def test_rows_without_a_target_are_dropped_and_a_split_without_one_refused(
    tmp_path: Path, model_dir: Path, caplog
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    short, long = "Shall I", "Shall I compare thee to a summer's day? Thou art more lovely"
    assert len(tok(short)["input_ids"]) <= 4 and len(tok(long)["input_ids"]) > 12
    # With train.seq_len=8 and one record per row, a row holds a target iff its prompt has <= 8
    # tokens: the short prompts' rows stay, the long ones' hold only -100 labels.
    prompts = [long, short, long, short, short, long, short, short, long, short]  # train 8, val 2
    records = [{"prompt": p, "completion": " thee"} for p in prompts]
    cfg = _records_cfg(tmp_path, model_dir, records, packing=False, val_fraction=0.2)
    out = prepare_records(cfg, seq_len=8)
    train, val = RecordsDataset.open(out, "train"), RecordsDataset.open(out, "val")
    assert (train.num_rows, val.num_rows) == (5, 1)
    assert ((train.labels != IGNORE_INDEX).any(1)).all() and ((val.labels != IGNORE_INDEX).any(1)).all()
    assert "train: dropped 3 of 8 row(s) without a target token" in caplog.text
    assert "val: dropped 1 of 2 row(s)" in caplog.text

    cfg = _records_cfg(tmp_path, model_dir, [{"prompt": long, "completion": " thee"}] * 10, packing=False)
    with pytest.raises(
        ValueError, match=r"train\.seq_len=8: no train row holds a target.*fix: a larger train\.seq_len"
    ):
        prepare_records(cfg, seq_len=8)


def test_a_malformed_records_file_is_refused_naming_the_line_or_the_source(tmp_path: Path) -> None:
    lines = ['{"text": "fine"}', '{"text": "unterminated}', "{not json}"]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not valid JSON .*; fix: "):
        load_records(tmp_path / "bad.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(ValueError, match=r"data\.source=.*bad\.parquet.* \(read as parquet records\).*fix: "):
        load_records(tmp_path / "bad.parquet")


def test_a_record_of_unknown_keys_and_messages_without_a_chat_template_are_refused(
    tmp_path: Path, model_dir: Path
) -> None:
    records = [{"text": "Shall I compare thee"}] * 3 + [{"foo": "bar"}]
    cfg = _records_cfg(tmp_path, model_dir, records)
    with pytest.raises(
        ValueError, match=r"data\.source: .*r\.jsonl:4 \(record 3\): record with keys \['foo'\]"
    ):
        prepare_records(cfg, seq_len=16)
    plain = tmp_path / "plain"
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = None
    tok.save_pretrained(plain)
    cfg = _records_cfg(tmp_path, plain, [{"messages": c} for c in CHATS] * 2)
    with pytest.raises(
        ValueError,
        match=r"need a tokenizer with a chat template .*chat_template\.jinja or tokenizer_config\.json",
    ):
        prepare_records(cfg, seq_len=64)


@pytest.mark.parametrize("packing", [True, False])
def test_too_few_rows_say_what_a_step_needs_and_suggest_unpacking_only_when_packed(
    tmp_path: Path, packing: bool
) -> None:
    rows = np.zeros((2, 8), np.int64)  # 2 rows of each split; one step below needs 4
    for split in ("train", "val"):
        for name in ("input_ids", "labels", "position_ids"):
            np.save(tmp_path / f"{split}.{name}.npy", rows)
    meta = {"format": "records", "vocab_size": 10, "num_train_records": 5, "num_val_records": 2}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    cfg = Config(data=DataConfig(format="records", packing=packing))
    cfg.train.seq_len, cfg.train.micro_batch_size, cfg.pipeline.microbatches = 8, 2, 2
    with pytest.raises(
        ValueError, match=r"holds 2 row\(s\) of train\.seq_len=8 tokens \(5 record\(s\), "
    ) as info:
        open_splits(tmp_path, cfg)
    assert (
        "fewer than the 4 sequences of one optimizer step (train.grad_accum=1 × pipeline.microbatches=2 × "
        in str(info.value)
    )
    assert "at least 4 rows of records" in str(info.value)
    assert ("data.packing=false" in str(info.value)) is packing  # packing makes fewer rows, not more


LLAMA2_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
"""Llama-2's chat layout: the template writes the BOS and each answer's EOS itself."""


@pytest.mark.parametrize("post", ["none", "bos", "bos_eos"])
def test_each_document_gets_one_bos_and_one_eos_whatever_the_post_processor(post: str) -> None:
    """Issue 24, part 2: a text and a prompt/completion are the tokenizer's own single-sequence
    encoding of the document, closed by one EOS (the post-processor's, else added); messages are
    ``apply_chat_template(tokenize=True)``. A Llama-2-style post-processor (``<s> $A </s>``) used to
    give ``</s></s>`` at a text's end and a ``</s>`` between prompt and completion."""
    tok = bpe_tokenizer(post, bos_token="<s>", eos_token="</s>")
    tok.chat_template = LLAMA2_CHAT
    bos, eos = tok.bos_token_id, tok.eos_token_id
    prompt, completion = "Shall I compare thee", " to a summer's day?"
    own = tok(prompt + completion)["input_ids"]  # the tokenizer's own encoding of the document
    want = own if own[-1] == eos else [*own, eos]
    assert want.count(bos) == (post != "none") and want.count(eos) == 1

    ids, mask = tokenize_record({"text": prompt + completion}, tok)
    assert ids == want and all(mask)
    ids, mask = tokenize_record({"prompt": prompt, "completion": completion}, tok)
    assert ids == want
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == completion + "</s>"
    assert (
        tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
        == ("<s>" if post != "none" else "") + prompt
    )

    chat = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": "Thou art more lovely."},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": completion},
    ]
    ids, mask = tokenize_record({"messages": chat}, tok)
    assert ids == list(tok.apply_chat_template(chat, return_dict=True)["input_ids"])
    assert ids.count(bos) == 1 and ids.count(eos) == 2
    targets = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert targets == f" Thou art more lovely.</s> {completion}</s>"


@pytest.mark.parametrize(("post", "add_bos"), [("none", True), ("bos", False), ("bos_eos", False)])
def test_data_add_bos_forces_the_bos_and_keeps_one_eos(post: str, add_bos: bool) -> None:
    tok = bpe_tokenizer(post, bos_token="<s>", eos_token="</s>")
    text = "Shall I compare thee"
    plain = tok(text, add_special_tokens=False)["input_ids"]
    ids, _ = tokenize_record({"text": text}, tok, add_bos=add_bos)
    assert ids == [tok.bos_token_id] * add_bos + plain + [tok.eos_token_id]
    with pytest.raises(ValueError, match=r"data\.add_bos=true: the tokenizer has no BOS"):
        tokenize_record({"text": text}, bpe_tokenizer(eos_token="</s>"), add_bos=True)


@pytest.mark.parametrize(
    ("record", "error"),
    [
        (
            {"messages": [{"content": "Shall I"}]},
            r"messages\[0\] has no string 'role' \(it is \['content'\]\)",
        ),
        ({"messages": "user: Shall I"}, r"'messages' must be a non-empty list of messages .*got str"),
        (
            {"messages": [{"role": "user", "content": "Shall I"}]},
            r"'messages' hold no assistant turn to train on \(roles: user\)",
        ),
        (
            {"prompt": [{"role": "user", "content": "Shall I"}], "completion": " thee"},
            r"'prompt' \(list\) and 'completion' \(str\) must both be strings or",
        ),
        ({"text": "Shall I", "tools": "{not json"}, r"'tools' is a string but not JSON"),
    ],
    ids=["no_role", "messages_string", "no_assistant_turn", "mixed_prompt_completion", "bad_tools"],
)
def test_a_bad_record_is_refused_naming_it(tmp_path: Path, model_dir: Path, record: dict, error: str) -> None:
    cfg = _records_cfg(tmp_path, model_dir, [{"text": "Shall I compare thee"}] * 3 + [record])
    with pytest.raises(ValueError, match=r"data\.source: .*r\.jsonl:4 \(record 3\): " + error):
        prepare_records(cfg, seq_len=64)


def test_an_empty_records_file_is_refused(tmp_path: Path, model_dir: Path) -> None:
    cfg = _records_cfg(tmp_path, model_dir, [])
    with pytest.raises(ValueError, match=r"data\.source=.*r\.jsonl' holds no records"):
        prepare_records(cfg, seq_len=64)


def test_a_tokenizer_without_offsets_splits_prompt_and_completion_by_the_common_prefix() -> None:
    """A Python (slow) tokenizer has no offsets: the completion starts where the ids of the prompt
    alone and of the whole text part (TRL's rule), the same split as by offsets here."""
    tok = bpe_tokenizer(eos_token="</s>")

    class NoOffsets(type(tok)):
        def __call__(self, *args, return_offsets_mapping: bool = False, **kwargs):
            if return_offsets_mapping:
                raise NotImplementedError(
                    "return_offset_mapping is not available when using Python tokenizers"
                )
            return super().__call__(*args, **kwargs)

    slow = NoOffsets(tokenizer_object=tok.backend_tokenizer, eos_token="</s>")
    record = {"prompt": "Shall I compare thee", "completion": " to a summer's day?"}
    assert tokenize_record(record, slow) == tokenize_record(record, tok)
    with pytest.raises(NotImplementedError):
        slow("a", return_offsets_mapping=True)


def test_tool_records_are_read_as_written_not_as_a_table_fills_them(tmp_path: Path) -> None:
    """An Arrow table (parquet here; JSON under datasets < 5) gives every tool call's ``arguments``
    every key any record's has (null filled), and the template renders those nulls: ``.jsonl`` and
    ``.json`` are read with ``json``, a parquet file's nulls dropped; each way the rows hold the
    records' own tokens."""
    import datasets
    from chat_fixtures import qwen3_tokenizer, save

    def chat(name: str, arguments: dict) -> dict:
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        return {
            "messages": [
                {"role": "user", "content": "Shall I compare thee"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "fair"},
                {"role": "assistant", "content": "Thou art more lovely."},
            ]
        }

    records = [chat("weather", {"city": "Verona"}), chat("add", {"a": 2, "b": 3})] * 2
    tok = qwen3_tokenizer()
    want = [tokenize_record(r, tok) for r in records]
    assert '"arguments": {"city": "Verona"}' in tok.decode(want[0][0])
    tok_dir = save(tok, tmp_path / "tok")
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "r.json").write_text(json.dumps(records))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "r.parquet"))
    assert datasets.Dataset.from_parquet(str(tmp_path / "r.parquet"))[0]["messages"][1]["tool_calls"][0][
        "function"
    ]["arguments"] == {"city": "Verona", "a": None, "b": None}, "the table fills the other record's keys"
    for name in ("r.jsonl", "r.json", "r.parquet"):
        cfg = DataConfig(source=str(tmp_path / name), dir=str(tmp_path / "rows"), tokenizer=str(tok_dir))
        cfg.format, cfg.packing, cfg.val_fraction = "records", False, 0.25
        rows = RecordsDataset.open(prepare_records(cfg, seq_len=256), "train")
        for r, (ids, mask) in enumerate(want[:3]):
            inputs, labels = pairs(np.asarray(ids), np.asarray(mask))
            assert rows.input_ids[r, : len(inputs)].tolist() == inputs.tolist(), name
            assert rows.labels[r, : len(labels)].tolist() == labels.tolist(), name
