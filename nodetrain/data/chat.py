"""Chat records: a conversation's tokens and which of them are the assistant's, from the template's structure.

Owns: rendering a conversation (``messages`` and its ``tools``) with the tokenizer's chat template,
the tokens of the rendering (what ``apply_chat_template(tokenize=True)`` gives), the loss mask of its
assistant turns, refusing what cannot be segmented exactly, and the template's turn terminator (the
token generation must stop on; export.py adds it to the stop ids). Does not own: reading records,
the other record kinds or BOS/EOS of plain text (sft.py).

The rule, one for every template and every assistant turn (single- or multi-turn alike): the turn's
targets are what generation would have to produce after the generation prompt, through the turn's
terminator and what the template writes after it before the next message (ChatML's ``\\n``):

    F   = render(messages)                                   the whole conversation
    s_i = len(render(messages[:i], add_generation_prompt))   must be a prefix of F
    e_i = len(render(messages[:i+1]))                        when that is a prefix of F, else:
          the text after the turn's content does not depend on what follows it; it is located by a
          structural diff (the same conversation with a sentinel appended to turn i's content) in F
          and in render(messages[:i+1]) (Qwen3 renders an empty think block in the last turn only)

A template with ``{% generation %}`` markers marks its turns itself (transformers'
``return_assistant_tokens_mask``); nothing here searches for a message's text.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

__all__ = ["GENERATION_TAG", "chat_tokens", "turn_terminator"]

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
"""A ``{% generation %}`` marker (also with ``-`` whitespace control) in a chat template."""

_SENTINEL = "\ue000"
"""Appended to one turn's content for the structural diff: a private-use character, so it never
equals the template text next to it and the diff stops exactly at the content's end."""

MARKERS_FIX = (
    "fix: a chat template with {% generation %} ... {% endgeneration %} around each assistant turn's "
    "output (TRL ships them for Qwen2.5, Qwen3 and Llama-3 as trl/chat_templates/*_training.jinja), "
    "given as data.chat_template=<that .jinja file>"
)


def _render(tok: PreTrainedTokenizerBase, messages: list[dict], tools, gen: bool = False) -> str:
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    except Exception as exc:  # jinja2 errors, the template's raise_exception, odd field types
        raise ValueError(f"the chat template cannot render it ({type(exc).__name__}: {exc})") from exc
    return text


def _diff_end(a: str, b: str) -> int:
    """Where in ``a`` the text after an insertion made in ``b`` begins (``b`` = ``a`` with text
    inserted): the longest common prefix, then the longest common suffix not overlapping it."""
    n = min(len(a), len(b))
    p = 0
    while p < n and a[p] == b[p]:
        p += 1
    s = 0
    while s < n - p and a[-1 - s] == b[-1 - s]:
        s += 1
    return len(a) - s


def _with_sentinel(message: dict, where: str) -> dict:
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(
            f"{where}: the chat template renders this assistant turn differently when later messages follow, "
            f"and its content is not a string, so the turn cannot be segmented exactly; {MARKERS_FIX}"
        )
    return {**message, "content": (content or "") + _SENTINEL}


def _turn_end(tok, messages: list[dict], tools, i: int, full: str, last: str, start: int) -> int:
    """End of assistant turn ``i`` in ``full`` when ``last`` (the conversation up to it) is not a prefix:
    the text after its content in ``last`` must follow its content in ``full`` too."""
    where = f"assistant turn {i}"
    alt = [*messages[:i], _with_sentinel(messages[i], where)]
    full_alt, last_alt = _render(tok, alt + messages[i + 1 :], tools), _render(tok, alt, tools)
    if _SENTINEL not in full_alt or _SENTINEL not in last_alt:
        raise ValueError(f"{where}: the chat template does not render its content; {MARKERS_FIX}")
    content_end, content_end_last = _diff_end(full, full_alt), _diff_end(last, last_alt)
    tail = last[content_end_last:]  # terminator (and tool calls) as the last turn renders them
    end = content_end + len(tail)
    if not full.startswith(tail, content_end) or end <= start:
        raise ValueError(
            f"{where}: the chat template renders its end differently when later messages follow "
            f"({tail[:40]!r} after the content as the last turn, {full[content_end : content_end + 40]!r} "
            f"in the whole conversation), so the turn cannot be segmented exactly; {MARKERS_FIX}"
        )
    return end


def _structural_spans(tok, messages: list[dict], tools, full: str, first: int) -> list[tuple[int, int]]:
    """Character spans of the assistant turns ``>= first`` in ``full`` (see the module docstring)."""
    spans = []
    for i, message in enumerate(messages):
        if i < first or message.get("role") != "assistant":
            continue
        context = _render(tok, messages[:i], tools, gen=True)
        last = _render(tok, messages[: i + 1], tools)
        if not (full.startswith(context) and last.startswith(context)):
            raise ValueError(
                f"assistant turn {i}: the chat template renders the conversation before it differently from "
                "its generation prompt (add_generation_prompt), so the turn's tokens cannot be segmented "
                f"exactly; {MARKERS_FIX}"
            )
        start = len(context)
        end = len(last) if full.startswith(last) else _turn_end(tok, messages, tools, i, full, last, start)
        if spans and start < spans[-1][1]:
            raise ValueError(f"assistant turn {i} overlaps the turn before it; {MARKERS_FIX}")
        spans.append((start, end))
    return spans


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: whether it overlaps a span (transformers' rule for ``assistant_masks``)."""
    return [any(s < b and e > a for a, b in spans) for s, e in offsets]


def chat_tokens(
    tok: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None, first: int = 0
) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation as its chat template renders it, and its loss mask.

    Args:
        tok: a tokenizer with a chat template.
        messages: ``[{role, content, ...}]`` (assistant ``tool_calls``, ``tool`` turns as the
            template defines them).
        tools: JSON schemas of the tools the system prompt offers (``apply_chat_template``'s).
        first: messages before this index are context only (a conversational prompt): their
            assistant turns take no loss.

    Returns:
        (ids, mask): ids equal ``apply_chat_template(messages, tools=tools, tokenize=True)``; mask is
        True on the tokens of the trained assistant turns (see the module docstring).

    Raises:
        ValueError: the template cannot render the conversation, or cannot be segmented exactly
            (naming the turn and how to add generation markers).
    """
    full = _render(tok, messages, tools)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    if GENERATION_TAG.search(tok.get_chat_template(None, tools)):  # the template tools select, if named
        marked = tok.apply_chat_template(
            messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True
        )
        assert list(marked["input_ids"]) == ids, "apply_chat_template tokenizes the rendering it returns"
        context = _render(tok, messages[:first], tools, gen=True) if first else ""
        if not full.startswith(context):
            raise ValueError(
                "the chat template renders the prompt differently from its generation prompt "
                "(add_generation_prompt), so the completion cannot be told apart"
            )
        masks = zip(marked["assistant_masks"], offsets, strict=True)
        return ids, [bool(m) and s >= len(context) for m, (s, _) in masks]
    return ids, _overlapping(offsets, _structural_spans(tok, messages, tools, full, first))


_PROBE = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
]


def turn_terminator(tok: PreTrainedTokenizerBase) -> int | None:
    """The special token that ends an assistant turn in ``tok``'s chat template (ChatML's
    ``<|im_end|>``, Llama-3's ``<|eot_id|>``), found as the last special token of the assistant
    turn of a probe conversation (whitespace after it skipped); None without a template, without
    such a token, or when the template cannot render the probe."""
    if not tok.chat_template:
        return None
    try:
        ids, mask = chat_tokens(tok, _PROBE)
    except ValueError:
        return None
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
    turn = [i for i, m in zip(ids, mask, strict=True) if m]
    while turn and tok.decode([turn[-1]]).strip() == "" and turn[-1] not in special:
        turn.pop()
    return turn[-1] if turn and turn[-1] in special else None
