"""Chat records: a conversation's tokens and which of them are the assistant's, from the template's structure.

Owns: rendering a conversation (``messages`` and its ``tools``) with the tokenizer's chat template,
the tokens of the rendering (what ``apply_chat_template(tokenize=True)`` gives), the loss mask of its
assistant turns, refusing what cannot be segmented exactly or would train no stop token, and the
template's turn terminators (the tokens generation must stop on; export.py adds them to the stop
ids). Does not own: reading records, the other record kinds or BOS/EOS of plain text (sft.py).

The rule, one for every template and every assistant turn (single- or multi-turn alike): the turn's
targets are what generation would have to produce after the generation prompt, through the turn's
terminator and what the template writes after it before the next message (ChatML's ``\\n``):

    F   = render(messages)                                   the whole conversation
    s_i = len(render(messages[:i], add_generation_prompt))   when that is a prefix of F; else the
          generation prompt counts as far as F renders it (DeepSeek-V3's adds '<think>\\n', which a
          conversation never renders): what it adds beyond is not a target
    e_i = len(render(messages[:i+1]))                        when that is a prefix of F, else:
          the text after the turn's content, located by a structural diff (the same conversation with
          a sentinel appended to turn i's content) in F and in render(messages[:i+1]) (Qwen3 renders an
          empty think block in the last turn only): what both renderings write there, through the
          first special token F writes (GPT-OSS ends the last turn '<|return|>', earlier ones
          '<|end|>'; Phi-3 adds '<|endoftext|>' after the last turn only)

A template that closes no turn itself (GLM-4.5: ``<|assistant|>`` ... content, then the next
message's ``<|user|>`` or ``<|observation|>``) ends each turn with the next role's marker: the turn
trains that marker, and the last turn trains the one a following message would open with (``tool``
after a tool call, else ``user``), appended to the conversation's tokens — what TRL's
``glm4moe_training.jinja`` renders. A record whose assistant turn would still train no special token
at its end (a template without terminators) is refused, naming the template.

A template with ``{% generation %}`` markers marks its turns itself (transformers'
``return_assistant_tokens_mask``); nothing here searches for a message's text.
"""

from __future__ import annotations

import bisect
import re

from transformers import PreTrainedTokenizerBase

__all__ = ["GENERATION_TAG", "chat_tokens", "turn_terminator", "turn_terminators"]

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


def _special_ids(tok: PreTrainedTokenizerBase) -> set[int]:
    return {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)


def _common(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    p = 0
    while p < n and a[p] == b[p]:
        p += 1
    return p


def _diff_end(a: str, b: str) -> int:
    """Where in ``a`` the text after an insertion made in ``b`` begins (``b`` = ``a`` with text
    inserted): the longest common prefix, then the longest common suffix not overlapping it."""
    n, p = min(len(a), len(b)), _common(a, b)
    s = 0
    while s < n - p and a[-1 - s] == b[-1 - s]:
        s += 1
    return len(a) - s


class _Tokens:
    """The tokens of the rendering ``text``: ids and character offsets ``[(start, end)]``."""

    def __init__(self, tok: PreTrainedTokenizerBase, text: str):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        self.text, self.ids = text, list(enc["input_ids"])
        self.offsets = [tuple(o) for o in enc["offset_mapping"]]
        self.special = _special_ids(tok)
        self._starts = [s for s, _ in self.offsets]

    def boundary_at_or_before(self, pos: int) -> int:
        """The last token boundary at or before character ``pos`` (a token's start, or the text's end)."""
        if pos >= len(self.text):
            return len(self.text)
        return self._starts[max(bisect.bisect_right(self._starts, pos) - 1, 0)]

    def token_start(self, pos: int) -> int:
        """The start of the token holding character ``pos`` (``pos`` itself at a boundary)."""
        k = bisect.bisect_right(self._starts, pos) - 1
        return self._starts[k] if k >= 0 and self.offsets[k][1] > pos else pos

    def first_special(self, lo: int, hi: int) -> tuple[int, int] | None:
        """(start, end) of the first special token starting in ``[lo, hi]``, or None."""
        for k in range(bisect.bisect_left(self._starts, lo), len(self.ids)):
            s, e = self.offsets[k]
            if s > hi:
                return None
            if self.ids[k] in self.special:
                return s, e
        return None

    def after(self, pos: int) -> tuple[int, int] | None:
        """(end, id) of the special token right after character ``pos`` (whitespace between allowed),
        or None when another token comes first or nothing does."""
        for k in range(bisect.bisect_left(self._starts, pos), len(self.ids)):
            s, e = self.offsets[k]
            if self.ids[k] in self.special:
                return e, self.ids[k]
            if self.text[s:e].strip():
                return None
        return None


def _with_sentinel(message: dict, where: str) -> dict:
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(
            f"{where}: the chat template renders this assistant turn differently when later messages follow, "
            f"and its content is not a string, so the turn cannot be segmented exactly; {MARKERS_FIX}"
        )
    return {**message, "content": (content or "") + _SENTINEL}


def _turn_start(tok, messages: list[dict], tools, i: int, full: _Tokens, last: str) -> int:
    """Start of assistant turn ``i`` in the conversation: where its generation prompt ends, as far as
    the conversation renders that prompt (see the module docstring)."""
    context = _render(tok, messages[:i], tools, gen=True)
    if full.text.startswith(context) and last.startswith(context):
        return len(context)
    base = _render(tok, messages[:i], tools) if i else ""
    agreed = len(base) + _common(context[len(base) :], full.text[len(base) :])
    start = full.token_start(agreed)
    rendered = full.text.startswith(base) and context.startswith(base) and start > len(base)
    if not (rendered and last.startswith(full.text[:start])):
        raise ValueError(
            f"assistant turn {i}: the chat template renders the conversation before it differently from "
            "its generation prompt (add_generation_prompt), so the turn's tokens cannot be segmented "
            f"exactly; {MARKERS_FIX}"
        )
    return start


def _turn_end(tok, messages: list[dict], tools, i: int, full: _Tokens, last: str, start: int) -> int:
    """End of assistant turn ``i`` in the conversation when ``last`` (the conversation up to it) is not
    a prefix of it: what both write after its content, through the first special token the
    conversation writes there (see the module docstring)."""
    where = f"assistant turn {i}"
    alt = [*messages[:i], _with_sentinel(messages[i], where)]
    full_alt, last_alt = _render(tok, alt + messages[i + 1 :], tools), _render(tok, alt, tools)
    if _SENTINEL not in full_alt or _SENTINEL not in last_alt:
        raise ValueError(f"{where}: the chat template does not render its content; {MARKERS_FIX}")
    content_end, content_end_last = _diff_end(full.text, full_alt), _diff_end(last, last_alt)
    tail = last[content_end_last:]  # terminator (and tool calls) as the last turn renders them
    if full.text.startswith(tail, content_end):
        end = content_end + len(tail)
    else:
        agreed = full.boundary_at_or_before(content_end + _common(tail, full.text[content_end:]))
        stop = full.first_special(content_end, max(agreed, content_end))
        end = -1 if stop is None else max(agreed, stop[1])
    if end <= start:
        raise ValueError(
            f"{where}: the chat template renders its end differently when later messages follow "
            f"({tail[:40]!r} after the content as the last turn, "
            f"{full.text[content_end : content_end + 40]!r} in the whole conversation) and writes no "
            f"special token there, so the turn cannot be segmented exactly; {MARKERS_FIX}"
        )
    return end


def _structural_spans(tok, messages: list[dict], tools, full: _Tokens, first: int) -> list[tuple[int, int]]:
    """Character spans of the assistant turns ``>= first`` in the conversation (module docstring)."""
    spans = []
    for i, message in enumerate(messages):
        if i < first or message.get("role") != "assistant":
            continue
        last = _render(tok, messages[: i + 1], tools)
        start = _turn_start(tok, messages, tools, i, full, last)
        end = (
            len(last) if full.text.startswith(last) else _turn_end(tok, messages, tools, i, full, last, start)
        )
        if spans and start < spans[-1][1]:
            raise ValueError(f"assistant turn {i} overlaps the turn before it; {MARKERS_FIX}")
        spans.append((start, end))
    return spans


_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def _closes_turns(tok: PreTrainedTokenizerBase) -> bool:
    """Whether the template ends an assistant turn with a special token of its own (ChatML's
    ``<|im_end|>``): False for the GLM-4.5 kind, whose turn ends where the next message's marker
    begins (a probe's last turn renders no special token after its content)."""
    try:
        probe = _Tokens(tok, _render(tok, _PROBE, None))
    except ValueError:
        return True
    return probe.first_special(probe.text.rfind("Hello") + len("Hello"), len(probe.text)) is not None


def _next_marker(tok, messages: list[dict], tools, full: _Tokens, i: int) -> int | None:
    """The id of the special token a message following the last one, assistant turn ``i``, opens with
    (``tool`` after a tool call, else ``user``), in a template that closes no turn; or None."""
    if len(messages) != i + 1:
        return None
    role = "tool" if messages[i].get("tool_calls") else "user"
    try:
        longer = _render(tok, [*messages, {"role": role, "content": _SENTINEL}], tools)
    except ValueError:
        return None
    if not longer.startswith(full.text):
        return None
    found = _Tokens(tok, longer).after(len(full.text))
    return None if found is None else found[1]


def _stop_refusal(template: str, i, tokens: list[int], decode) -> str:
    what = decode(tokens[-8:]) if tokens else ""
    return (
        f"assistant turn {i} would train no stop token: {template or 'the chat template'} writes no special "
        f"token at its end (its targets end {what!r}), so a model trained on it never learns to end a turn; "
        f"fix: a chat template whose assistant turns end with an end-of-turn token, or one with "
        "{% generation %} markers that include it, given as data.chat_template=<that .jinja file>"
    )


def _check_stops(tok, ids: list[int], mask: list[bool], turns: list[int], template: str) -> None:
    """Refuse a conversation whose trained assistant turn ends without a special token (whitespace
    after it aside): its model would never learn to stop. ``turns``: the message index of each run of
    consecutive targets, in order."""
    special, runs, run = _special_ids(tok), [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    runs += [run] if run else []
    for k, targets in enumerate(runs):
        trimmed = list(targets)
        while trimmed and trimmed[-1] not in special and not tok.decode([trimmed[-1]]).strip():
            trimmed.pop()
        if not trimmed or trimmed[-1] not in special:
            i = turns[k] if len(turns) == len(runs) else "?"
            raise ValueError(_stop_refusal(template, i, targets, tok.decode))


def chat_tokens(
    tok: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list[dict] | None = None,
    first: int = 0,
    template: str = "",
) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation as its chat template renders it, and its loss mask.

    Args:
        tok: a tokenizer with a chat template.
        messages: ``[{role, content, ...}]`` (assistant ``tool_calls``, ``tool`` turns as the
            template defines them).
        tools: JSON schemas of the tools the system prompt offers (``apply_chat_template``'s).
        first: messages before this index are context only (a conversational prompt): their
            assistant turns take no loss.
        template: names the template in refusals (e.g. ``data.chat_template=<file>``).

    Returns:
        (ids, mask): ids equal ``apply_chat_template(messages, tools=tools, tokenize=True)``, plus
        the next role's marker after a last assistant turn of a template that closes no turn itself
        (GLM-4.5, see the module docstring); mask is True on the tokens of the trained assistant turns.

    Raises:
        ValueError: the template cannot render the conversation, cannot be segmented exactly
            (naming the turn and how to add generation markers), or an assistant turn would train no
            stop token (naming the turn and the template).
    """
    full = _Tokens(tok, _render(tok, messages, tools))
    trained = [i for i, m in enumerate(messages) if i >= first and m.get("role") == "assistant"]
    if GENERATION_TAG.search(tok.get_chat_template(None, tools)):  # the template tools select, if named
        ids, mask = _marked(tok, messages, tools, first, full)
    else:
        ids, mask = _structural(tok, messages, tools, first, full)
    _check_stops(tok, ids, mask, trained, template)
    return ids, mask


def _marked(tok, messages: list[dict], tools, first: int, full: _Tokens) -> tuple[list[int], list[bool]]:
    """ids and mask of a template with ``{% generation %}`` markers (transformers' assistant mask)."""
    marked = tok.apply_chat_template(
        messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True
    )
    assert list(marked["input_ids"]) == full.ids, "apply_chat_template tokenizes the rendering it returns"
    context = _render(tok, messages[:first], tools, gen=True) if first else ""
    if not full.text.startswith(context):
        raise ValueError(
            "the chat template renders the prompt differently from its generation prompt "
            "(add_generation_prompt), so the completion cannot be told apart"
        )
    masks = zip(marked["assistant_masks"], full.offsets, strict=True)
    return list(full.ids), [bool(m) and s >= len(context) for m, (s, _) in masks]


def _structural(tok, messages: list[dict], tools, first: int, full: _Tokens) -> tuple[list[int], list[bool]]:
    """ids and mask by the structural rule (module docstring), the next role's marker included."""
    spans = _structural_spans(tok, messages, tools, full, first)
    ids, appended = list(full.ids), []
    if spans and not _closes_turns(tok):
        turns = [i for i, m in enumerate(messages) if i >= first and m.get("role") == "assistant"]
        for k, (i, (s, e)) in enumerate(zip(turns, spans, strict=True)):
            if (found := full.after(e)) is not None:
                spans[k] = (s, found[0])  # the next message's marker: <|user|>, <|observation|>
            elif e == len(full.text) and (marker := _next_marker(tok, messages, tools, full, i)) is not None:
                appended = [marker]  # what a following message would open with
    mask = [any(s < b and e > a for s, e in spans) for a, b in full.offsets]  # transformers' overlap rule
    return ids + appended, mask + [True] * len(appended)


def _probe_stops(tok: PreTrainedTokenizerBase, messages: list[dict], tools, after: str) -> list[int]:
    """The special tokens a probe's last assistant turn trains after the text ``after`` (its content)."""
    text = _render(tok, messages, tools)
    ids, mask = chat_tokens(tok, messages, tools)
    offsets = _Tokens(tok, text).offsets
    offsets += [(len(text), len(text))] * (len(ids) - len(offsets))  # a marker appended (GLM-4.5)
    at = text.rfind(after) + len(after) if after else 0
    special = _special_ids(tok)
    return [t for t, m, (s, _) in zip(ids, mask, offsets, strict=True) if m and s >= at and t in special]


_CALL = {"type": "function", "function": {"name": "nodetrain_probe", "arguments": {"x": "y"}}}
_TOOL = {
    "type": "function",
    "function": {"name": "nodetrain_probe", "description": "A probe.", "parameters": {"type": "object"}},
}


def turn_terminators(tok: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens that end an assistant's output in ``tok``'s chat template, for the stop list
    of an export (export.py): the first special token a reply's last turn trains after its content
    (ChatML's ``<|im_end|>``, Llama-3's ``<|eot_id|>``, GPT-OSS's ``<|return|>``, GLM-4.5's
    ``<|user|>``), then the last one a tool call's turn trains (GPT-OSS's ``<|call|>``, GLM-4.5's
    ``<|observation|>``) when the template renders tool calls. Empty without a template or when the
    template cannot render the probes."""
    if not tok.chat_template:
        return []
    out = []
    try:
        out += _probe_stops(tok, _PROBE, None, "Hello")[:1]
    except ValueError:
        return []
    call = [_PROBE[0], {"role": "assistant", "content": "", "tool_calls": [_CALL]}]
    try:
        if "nodetrain_probe" in _render(tok, call, [_TOOL]):
            out += _probe_stops(tok, call, [_TOOL], "")[-1:]
    except ValueError:
        pass
    return list(dict.fromkeys(out))


def turn_terminator(tok: PreTrainedTokenizerBase) -> int | None:
    """The special token that ends an assistant's reply in ``tok``'s chat template (the first of
    :func:`turn_terminators`), or None."""
    found = turn_terminators(tok)
    return found[0] if found else None
