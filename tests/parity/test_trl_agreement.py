"""nodetrain's labels agree with TRL's ``SFTTrainer`` (issue 24's acceptance), in process, no training.

TRL (a dev extra) prepares the same conversations as a user would run it: ``assistant_only_loss=True``
with a tokenizer carrying Qwen3's (or Llama-3's) own template, which TRL recognises and swaps for its
training template with ``{% generation %}`` markers (``trl/chat_templates/*_training.jinja``). Ours
tokenizes the same records with ``data.chat_template`` = that training template *with the markers
removed*, so our structural rule (chat.py), not transformers' marker mask, finds the assistant turns;
the ids and the labels must be equal token for token. Prompt/completion records (strings and TRL's
conversational form) are compared with TRL's completion mask.

Qwen2.5's training template opens its marker before the ``\\n`` that ends the generation prompt
('<|im_start|>assistant' + generation + '\\n...'), so TRL also trains that one header token per
turn; the test pins that difference down instead of hiding it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from chat_fixtures import MULTI_TURN, QWEN3, TOOL_CHAT, WEATHER_TOOL, bpe_tokenizer, qwen3_tokenizer

from nodetrain.data.sft import tokenize_record

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
_MARKER = re.compile(r"{%-?\s*(?:end)?generation\s*-?%}")
LINES = [
    "Shall I compare thee to a summer's day?",
    "Thou art more lovely and more temperate.",
    "Rough winds do shake the darling buds of May,",
    "And summer's lease hath all too short a date.",
]


def _conversations(num: int, tools: bool) -> list[dict]:
    """``num`` varied records: single and multi-turn, with a system prompt or not, (with ``tools``)
    a tool call and its response, several calls in a row, a turn with reasoning."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Verona"}}}
    out = []
    for k in range(num):
        line = LINES[k % 4] + " " * (k % 2) + LINES[(k + 1) % 4][: 5 + k % 17]
        messages = [{"role": "system", "content": "You answer in verse."}] if k % 3 == 0 else []
        for turn in range(1 + k % 3):
            messages += [{"role": "user", "content": f"{turn}: {line}"}]
            if tools and (k + turn) % 2:
                for _ in range(1 + k % 2):
                    messages += [{"role": "assistant", "content": line[: k % 3], "tool_calls": [call]}]
                    messages += [{"role": "tool", "content": LINES[turn % 4]}]
            answer = LINES[(k + turn) % 4]
            if k % 5 == 4:
                answer = f"<think>\nweighing {turn}\n</think>\n\n{answer}"
            messages += [{"role": "assistant", "content": answer}]
        out.append({"messages": messages, **({"tools": [WEATHER_TOOL]} if tools else {})})
    return out


def _trl_rows(out: Path, tok, records: list[dict], **config) -> list[dict]:
    """TRL's prepared training rows (input_ids, labels) for ``records``, as SFTTrainer makes them."""
    model = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=len(tok),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=32,
        )
    )
    args = trl.SFTConfig(output_dir=str(out), report_to="none", max_length=None, use_cpu=True, **config)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=tok
    )
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in trainer.train_dataset]


def _ours(tok, record: dict) -> dict:
    ids, mask = tokenize_record(record, tok)
    return {"input_ids": ids, "labels": [i if m else -100 for i, m in zip(ids, mask, strict=True)]}


def _unmarked(tok, name: str):
    """``tok`` with TRL's training template ``name`` stripped of its generation markers: it renders
    the same text (checked), and only chat.py's rule can find the turns."""
    marked = (TRL_TEMPLATES / name).read_text(encoding="utf-8")
    probe = _conversations(6, tools="qwen" in name)
    ours = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, **tok.special_tokens_map
    )
    ours.chat_template = _MARKER.sub("", marked)
    for r in probe:
        kw = {"conversation": r["messages"], "tools": r.get("tools"), "tokenize": False}
        assert ours.apply_chat_template(**kw) == tok.apply_chat_template(**kw, chat_template=marked)
    return ours


def test_our_template_copy_is_qwen3_s_as_trl_recognises_it() -> None:
    assert (TRL_TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8") == QWEN3


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"])
def test_qwen3_conversations_get_trl_s_labels(tmp_path: Path, eos: str) -> None:
    tok = qwen3_tokenizer(eos)
    records = _conversations(40, tools=True)
    want = _trl_rows(tmp_path, tok, records, assistant_only_loss=True)
    ours = _unmarked(tok, "qwen3_training.jinja")
    assert [_ours(ours, r) for r in records] == want


def _llama3_tokenizer():
    tok = bpe_tokenizer(bos_token="<s>", eos_token="<|eot_id|>", pad_token="<|endoftext|>")
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.chat_template = (TRL_TEMPLATES / "llama3.jinja").read_text(encoding="utf-8")
    return tok


def test_llama3_conversations_get_trl_s_labels(tmp_path: Path) -> None:
    tok = _llama3_tokenizer()
    records = _conversations(30, tools=False)
    want = _trl_rows(tmp_path, tok, records, assistant_only_loss=True)
    assert [_ours(_unmarked(tok, "llama3_training.jinja"), r) for r in records] == want


def test_qwen2_5_differs_from_trl_only_by_the_header_newline_trl_marks(tmp_path: Path) -> None:
    tok = qwen3_tokenizer()
    tok.chat_template = (TRL_TEMPLATES / "qwen2_5.jinja").read_text(encoding="utf-8")
    records = _conversations(20, tools=True)
    want = _trl_rows(tmp_path, tok, records, assistant_only_loss=True)
    ours = _unmarked(tok, "qwen2_5_training.jinja")
    newline = tok.convert_tokens_to_ids(tok.tokenize("\n"))[0]
    header = tok.convert_tokens_to_ids(tok.tokenize("assistant"))[-1]
    for record, trl_row in zip(records, want, strict=True):
        row = _ours(ours, record)
        assert row["input_ids"] == trl_row["input_ids"]
        differ = [k for k, (a, b) in enumerate(zip(row["labels"], trl_row["labels"], strict=True)) if a != b]
        turns = sum(m["role"] == "assistant" for m in record["messages"])
        assert len(differ) == turns
        assert all(row["labels"][k] == -100 and trl_row["input_ids"][k] == newline for k in differ)
        assert all(trl_row["input_ids"][k - 1] == header for k in differ)


def test_prompt_completion_records_get_trl_s_completion_labels(tmp_path: Path) -> None:
    tok = qwen3_tokenizer("<|endoftext|>")
    text = [{"prompt": LINES[k % 4], "completion": " " + LINES[(k + 1) % 4]} for k in range(8)]
    chats = [
        {"prompt": r["messages"][:-1], "completion": r["messages"][-1:]}
        for r in _conversations(12, tools=False)
    ]
    for records in (text, chats):
        want = _trl_rows(tmp_path, tok, records)  # completion_only_loss: TRL's default for prompt/completion
        assert [_ours(tok, r) for r in records] == want


def test_trl_sees_the_tool_records_as_we_do(tmp_path: Path) -> None:
    """The TRL side gets TOOL_CHAT and MULTI_TURN with Qwen3's own template: same ids as ours."""
    tok = qwen3_tokenizer()
    records = [{"messages": TOOL_CHAT, "tools": [WEATHER_TOOL]}, {"messages": MULTI_TURN}]
    rows = _trl_rows(tmp_path, tok, records, assistant_only_loss=True)
    training = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, **tok.special_tokens_map
    )
    training.chat_template = (TRL_TEMPLATES / "qwen3_training.jinja").read_text(encoding="utf-8")
    for record, row in zip(records, rows, strict=True):
        assert _ours(training, record) == row  # the marked template through transformers' mask
    assert torch.tensor(rows[0]["labels"]).ne(-100).any()
