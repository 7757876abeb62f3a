"""Every supported family's stock chat template trains its stop (issue 32, items 2 and 3), in process.

The stock templates are TRL's copies (tests/templates/, checked equal to trl/chat_templates/ when
TRL is installed), each with a tokenizer of its family's special tokens (chat_fixtures.FAMILIES).
Each family's targets are written out from the rule (nodetrain/data/chat.py's docstring) and then
compared with the mask transformers gives for TRL's own training template of that family
(``trl/chat_templates/<family>_training.jinja``, ``return_assistant_tokens_mask``):

- GLM-4.5 (``glm4moe_training.jinja``): a turn ends with the next role's marker (``<|user|>``,
  ``<|observation|>``), and the last turn with the ``<|user|>`` (after a tool call
  ``<|observation|>``) the training template appends: equal ids and masks.
- Phi-3 (``phi3_training.jinja``): ``<|end|>\\n`` after each turn, ``<|endoftext|>`` after the last:
  equal.
- GPT-OSS (``gptoss_training.jinja``): ``<|end|>`` after earlier turns, ``<|return|>`` after the
  last, ``<|call|>`` after a tool call; TRL's marker also covers the generation prompt
  ``<|start|>assistant`` of each turn, which nodetrain leaves as context: that is the only difference.
- DeepSeek-V3 (``deepseekv3_training.jinja``): the generation prompt adds ``<think>\\n`` that a
  conversation never renders; the turn starts after ``<｜Assistant｜>``, which TRL's marker also
  covers: that is the only difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_fixtures import MULTI_TURN, TOOL_CHAT, WEATHER_TOOL, family_tokenizer, save, target_runs

from nodetrain.config.schema import DataConfig
from nodetrain.data.chat import turn_terminators
from nodetrain.data.sft import RecordsDataset, prepare_records, tokenize_record

FAMILY_NAMES = ["glm4moe", "gptoss", "deepseekv3", "phi3"]
_DS_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'}}
DS_TOOL_CHAT = [*TOOL_CHAT[:2], {**TOOL_CHAT[2], "tool_calls": [_DS_CALL]}, *TOOL_CHAT[3:]]
"""TOOL_CHAT with the arguments as JSON text: DeepSeek-V3's stock template concatenates them."""
FIRST, SECOND = (m["content"] for m in MULTI_TURN if m["role"] == "assistant")
ANSWER = TOOL_CHAT[-1]["content"]
GLM_CALL = "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Verona</arg_value>\n</tool_call>"
EXPECTED = {  # family -> conversation -> the decoded runs of targets, from the rule
    "glm4moe": {
        "multi_turn": [f"\n<think></think>\n{FIRST}<|user|>", f"\n<think></think>\n{SECOND}<|user|>"],
        "tool_call": [
            f"\n<think></think>{GLM_CALL}<|observation|>",
            f"\n<think></think>\n{ANSWER}<|user|>",
        ],
    },
    "gptoss": {
        "multi_turn": [
            f"<|channel|>final<|message|>{FIRST}<|end|>",
            f"<|channel|>final<|message|>{SECOND}<|return|>",
        ],
        "tool_call": [
            ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Verona"}<|call|>',
            f"<|channel|>final<|message|>{ANSWER}<|return|>",
        ],
    },
    "deepseekv3": {
        "multi_turn": [f"{FIRST}<｜end▁of▁sentence｜>", f"{SECOND}<｜end▁of▁sentence｜>"],
        "tool_call": [
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": '
            '"Verona"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
            f"{ANSWER}<｜end▁of▁sentence｜>",
        ],
    },
    "phi3": {"multi_turn": [f"{FIRST}<|end|>\n", f"{SECOND}<|end|>\n<|endoftext|>"]},
}
TERMINATORS = {
    "glm4moe": ["<|user|>", "<|observation|>"],
    "gptoss": ["<|return|>", "<|call|>"],
    "deepseekv3": ["<｜end▁of▁sentence｜>"],
    "phi3": ["<|end|>"],
}


def _conversations(family: str) -> dict[str, tuple[list[dict], list[dict] | None]]:
    out = {"multi_turn": (MULTI_TURN, None), "single_turn": (MULTI_TURN[:3], None)}
    out["no_system"] = (MULTI_TURN[1:], None)
    if family in ("glm4moe", "gptoss"):
        out["tool_call"] = (TOOL_CHAT, [WEATHER_TOOL])
    elif family == "deepseekv3":
        out["tool_call"] = (DS_TOOL_CHAT, None)
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_stock_templates_train_the_terminator_each_turn_ends_with(family: str) -> None:
    """The targets of each family's stock template, multi-turn and with tool calls, as the rule says."""
    tok = family_tokenizer(family)
    for name, want in EXPECTED[family].items():
        messages, tools = _conversations(family)[name]
        ids, mask = tokenize_record({"messages": messages, "tools": tools}, tok)
        assert target_runs(tok, ids, mask) == want, (family, name)
        plain = list(tok.apply_chat_template(messages, tools=tools, return_dict=True)["input_ids"])
        if family == "glm4moe":  # the marker a next message would open with, appended (as TRL's renders)
            assert ids == [*plain, tok.convert_tokens_to_ids("<|user|>")] and mask[-1]
        else:
            assert ids == plain, "the tokens apply_chat_template gives"


def test_glm_turns_end_with_the_next_role_s_marker_whatever_comes_next() -> None:
    """A tool call's turn trains ``<|observation|>`` (the tool's response follows), an answer
    ``<|user|>``; two tool responses in a row open with one ``<|observation|>``; a turn followed by a
    system message trains ``<|system|>``; a conversational prompt's own turns are not trained."""
    tok = family_tokenizer("glm4moe")
    call = TOOL_CHAT[2]
    messages = [TOOL_CHAT[1], call, TOOL_CHAT[3], TOOL_CHAT[3], {"role": "assistant", "content": "Clear."}]
    messages += [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "More?"}]
    messages += [{"role": "assistant", "content": "No."}]
    ids, mask = tokenize_record({"messages": messages, "tools": [WEATHER_TOOL]}, tok)
    runs = target_runs(tok, ids, mask)
    ends = ("</tool_call><|observation|>", "Clear.<|system|>", "No.<|user|>")
    assert len(runs) == 3 and all(r.endswith(e) for r, e in zip(runs, ends, strict=True)), runs
    ids, mask = tokenize_record({"prompt": messages[:5], "completion": messages[5:]}, tok)
    assert target_runs(tok, ids, mask) == ["\n<think></think>\nNo.<|user|>"]


def test_glm_records_are_packed_with_the_appended_marker_as_the_last_label(tmp_path: Path) -> None:
    tok_dir = save(family_tokenizer("glm4moe"), tmp_path / "tok")
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"messages": MULTI_TURN}) + "\n" for _ in range(4)))
    cfg = DataConfig(source=str(tmp_path / "r.jsonl"), dir=str(tmp_path / "rows"), tokenizer=str(tok_dir))
    cfg.format, cfg.val_fraction, cfg.packing = "records", 0.25, False
    rows = RecordsDataset.open(prepare_records(cfg, seq_len=256), "train")
    tok = family_tokenizer("glm4moe")
    ids, _ = tokenize_record({"messages": MULTI_TURN}, tok)
    assert rows.labels[0, len(ids) - 2] == tok.convert_tokens_to_ids("<|user|>") == ids[-1]
    assert (rows.labels[0, len(ids) - 1 :] == -100).all()


NO_STOP = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_a_template_whose_turns_train_no_stop_token_is_refused_naming_it(tmp_path: Path) -> None:
    """No special token ends a turn and none opens the next message: refused with the record, the
    turn and the template (data.chat_template's file); the GLM rule does not invent a stop."""
    tok_dir = save(family_tokenizer("phi3"), tmp_path / "tok")
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"messages": MULTI_TURN}) + "\n" for _ in range(4)))
    (tmp_path / "plain.jinja").write_text(NO_STOP)
    cfg = DataConfig(source=str(tmp_path / "r.jsonl"), dir=str(tmp_path / "rows"), tokenizer=str(tok_dir))
    cfg.format, cfg.val_fraction, cfg.chat_template = "records", 0.25, str(tmp_path / "plain.jinja")
    with pytest.raises(
        ValueError, match=r"r\.jsonl:1 \(record 0\): assistant turn 2 would train no stop"
    ) as e:
        prepare_records(cfg, seq_len=256)
    assert f"data.chat_template={tmp_path / 'plain.jinja'}" in str(e.value)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_turn_terminators_are_what_a_reply_and_a_tool_call_end_with(family: str) -> None:
    tok = family_tokenizer(family)
    assert tok.convert_ids_to_tokens(turn_terminators(tok)) == TERMINATORS[family]


# --- TRL's training templates ---------------------------------------------------------------------


def _trl_templates() -> Path:
    trl = pytest.importorskip("trl")
    return Path(trl.__file__).parent / "chat_templates"


def test_the_stock_templates_are_trl_s_copies() -> None:
    templates = _trl_templates()
    for family in FAMILY_NAMES:
        assert family_tokenizer(family).chat_template == (templates / f"{family}.jinja").read_text(), family


def _generation_prompt_tokens(tok, messages: list[dict], tools, offsets) -> set[int]:
    """Indices of the tokens of each assistant turn's generation prompt, as far as the conversation
    renders it (GPT-OSS ``<|start|>assistant``, DeepSeek-V3 ``<｜Assistant｜>``)."""
    full = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    out = set()
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        base = tok.apply_chat_template(messages[:i], tools=tools, tokenize=False) if i else ""
        prompt = tok.apply_chat_template(
            messages[:i], tools=tools, tokenize=False, add_generation_prompt=True
        )
        n = len(base)
        while n < len(prompt) and n < len(full) and prompt[n] == full[n]:
            n += 1
        out |= {k for k, (s, e) in enumerate(offsets) if s >= len(base) and e <= n}
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_masks_are_those_of_trl_s_training_template(family: str) -> None:
    """ids equal; masks equal for GLM-4.5 and Phi-3; for GPT-OSS and DeepSeek-V3 they differ exactly
    on the generation prompt's tokens, which TRL's markers cover and nodetrain leaves as context."""
    templates = _trl_templates()
    tok, ref = family_tokenizer(family), family_tokenizer(family)
    ref.chat_template = (templates / f"{family}_training.jinja").read_text(encoding="utf-8")
    for name, (messages, tools) in _conversations(family).items():
        if family == "deepseekv3" and name == "tool_call":
            continue  # TRL's DeepSeek-V3 training template renders the arguments with tojson: other text
        want = ref.apply_chat_template(
            messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = tokenize_record({"messages": messages, "tools": tools}, tok)
        assert ids == list(want["input_ids"]), (family, name)
        differ = {
            k for k, (a, b) in enumerate(zip(mask, want["assistant_masks"], strict=True)) if a != bool(b)
        }
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        prompts = _generation_prompt_tokens(tok, messages, tools, offsets)
        if family in ("glm4moe", "phi3"):
            assert differ == set(), (family, name)
        else:
            assert differ == prompts and prompts and not any(mask[k] for k in differ), (family, name)
