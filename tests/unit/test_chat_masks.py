"""Chat labels from the template's structure (issue 24, part 1), in process, no launch.

The reference is transformers itself: Qwen3's own template with ``{% generation %}`` markers added
around each assistant turn's output (tests/chat_fixtures.py ``QWEN3_MARKED``, rendering unchanged)
gives ``return_assistant_tokens_mask``; the unmarked template through nodetrain must give the same
ids (``apply_chat_template(tokenize=True)``) and the same mask — for tool calls (with ``tools`` in
the system prompt), multi-turn records, a reasoning turn, and with the base models' eos
``<|endoftext|>`` as with the instruct models' ``<|im_end|>``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_fixtures import (
    CHATML,
    MULTI_TURN,
    QWEN3,
    QWEN3_MARKED,
    TOOL_CHAT,
    WEATHER_TOOL,
    qwen3_tokenizer,
    save,
    target_runs,
)

from nodetrain.config.schema import DataConfig
from nodetrain.data.chat import turn_terminator
from nodetrain.data.sft import RecordsDataset, prepare_records, tokenize_record


def _call(city) -> list[dict]:
    return [{"function": {"name": "get_weather", "arguments": city}}]


MULTI_STEP_TOOLS = [
    {"role": "user", "content": "Weather in Verona, then in Padua?"},
    {"role": "assistant", "content": "", "tool_calls": _call({"city": "Verona"})},
    {"role": "tool", "content": "clear"},
    {"role": "assistant", "content": "Now Padua.", "tool_calls": _call('{"city": "Padua"}')},  # JSON text
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "Clear in Verona, rain in Padua."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "<think>\nshort\n</think>\n\nYou are welcome."},
]
CONVERSATIONS = {
    "single_turn": (MULTI_TURN[:3], None),
    "multi_turn": (MULTI_TURN, None),
    "tool_call": (TOOL_CHAT, [WEATHER_TOOL]),
    "multi_step_tools_and_reasoning": (MULTI_STEP_TOOLS, [WEATHER_TOOL]),
}


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_qwen3_masks_equal_the_template_s_own_generation_markers(name: str, eos: str) -> None:
    messages, tools = CONVERSATIONS[name]
    tok, marked = qwen3_tokenizer(eos), qwen3_tokenizer(eos, QWEN3_MARKED)
    ref = marked.apply_chat_template(
        messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True
    )
    assert list(ref["input_ids"]) == list(
        tok.apply_chat_template(messages, tools=tools, return_dict=True)["input_ids"]
    )
    ids, mask = tokenize_record({"messages": messages, "tools": tools}, tok)
    assert ids == list(ref["input_ids"])
    assert mask == [bool(m) for m in ref["assistant_masks"]]
    turns = sum(m["role"] == "assistant" for m in messages)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    labelled = sum(m and i == im_end for i, m in zip(ids, mask, strict=True))
    assert labelled == turns, "every assistant turn trains its terminator, whatever the eos"


def test_a_tool_call_turn_trains_the_call_and_the_tools_reach_the_system_prompt() -> None:
    tok = qwen3_tokenizer()
    ids, mask = tokenize_record({"messages": TOOL_CHAT, "tools": json.dumps([WEATHER_TOOL])}, tok)
    text = tok.decode(ids)
    assert text == tok.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL], tokenize=False)
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0], "the schema is in the system prompt"
    call, answer = target_runs(tok, ids, mask)
    assert (
        call
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Verona"}}\n</tool_call><|im_end|>\n'
    )
    assert answer == "<think>\n\n</think>\n\nRough winds do shake the darling buds of May.<|im_end|>\n"


def test_single_and_multi_turn_records_get_the_same_rule() -> None:
    """A turn's targets are what generation produces after the generation prompt, through the
    terminator: the last turn of a multi-turn record is trained exactly as the same turn alone (with
    Qwen3's think block), and an earlier turn ends on the same terminator."""
    tok = qwen3_tokenizer("<|endoftext|>")
    single = [MULTI_TURN[0], *MULTI_TURN[3:]]  # system, the last question, the last answer
    (alone,) = target_runs(tok, *tokenize_record({"messages": single}, tok))
    first, last = target_runs(tok, *tokenize_record({"messages": MULTI_TURN}, tok))
    assert last == alone == "<think>\n\n</think>\n\n" + MULTI_TURN[4]["content"] + "<|im_end|>\n"
    assert first == MULTI_TURN[2]["content"] + "<|im_end|>\n"


def test_conversational_prompt_completion_trains_the_completion_only() -> None:
    """TRL's conversational prompt/completion format: the prompt's own assistant turns are context."""
    tok = qwen3_tokenizer()
    prompt, completion = MULTI_TURN[:4], MULTI_TURN[4:]
    ids, mask = tokenize_record({"prompt": prompt, "completion": completion}, tok)
    full_ids, full_mask = tokenize_record({"messages": MULTI_TURN}, tok)
    assert ids == full_ids == list(tok.apply_chat_template(MULTI_TURN, return_dict=True)["input_ids"])
    context = len(tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert mask == [m and k >= context for k, m in enumerate(full_mask)]
    assert target_runs(tok, ids, mask) == target_runs(tok, full_ids, full_mask)[1:]


def test_the_turn_terminator_is_the_template_s_not_the_eos() -> None:
    for eos in ("<|im_end|>", "<|endoftext|>"):
        tok = qwen3_tokenizer(eos)
        assert turn_terminator(tok) == tok.convert_tokens_to_ids("<|im_end|>")
    tok.chat_template = None
    assert turn_terminator(tok) is None


def test_a_template_that_cannot_be_segmented_is_refused_and_data_chat_template_replaces_it(
    tmp_path: Path,
) -> None:
    """A template whose system line counts the messages renders the conversation before a turn
    differently from its generation prompt: refused by name, with the fix; ``data.chat_template``
    pointing at a marked template then trains exactly its marked tokens."""
    counting = "{{ messages | length }} messages\n" + CHATML
    tok_dir = save(qwen3_tokenizer(template=counting), tmp_path / "tok")
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"messages": MULTI_TURN}) + "\n" for _ in range(4)))
    cfg = DataConfig(source=str(tmp_path / "r.jsonl"), dir=str(tmp_path / "rows"), tokenizer=str(tok_dir))
    cfg.format, cfg.val_fraction = "records", 0.25
    with pytest.raises(
        ValueError,
        match=r"r\.jsonl:1 \(record 0\): assistant turn 2: .*generation prompt.*data\.chat_template=",
    ):
        prepare_records(cfg, seq_len=256)
    (tmp_path / "marked.jinja").write_text(QWEN3_MARKED)
    cfg.chat_template = str(tmp_path / "marked.jinja")
    rows = RecordsDataset.open(prepare_records(cfg, seq_len=256), "train")
    marked = qwen3_tokenizer(template=QWEN3_MARKED)
    ref = marked.apply_chat_template(MULTI_TURN, return_dict=True, return_assistant_tokens_mask=True)
    n = len(ref["input_ids"])
    assert rows.input_ids[0, : n - 1].tolist() == ref["input_ids"][:-1]
    want = [t if m else -100 for t, m in zip(ref["input_ids"][1:], ref["assistant_masks"][1:], strict=True)]
    assert rows.labels[0, : n - 1].tolist() == want
    assert QWEN3 != QWEN3_MARKED
