"""Local chat tokenizers for the fine-tuning tests (no hub): a small byte-level BPE with the special
tokens of Qwen3 and Llama-3, and their chat templates.

``templates/qwen3.jinja`` is Qwen3's chat template byte for byte as Qwen/Qwen3-0.6B ships it (the copy
TRL keeps to recognise it, trl/chat_templates/qwen3.jinja; tests/parity/test_trl_agreement.py checks they are
equal). ``templates/qwen3_marked.jinja`` is that template with ``{% generation %}`` markers around
each assistant turn's output and nothing else changed (tests/unit/test_chat_masks.py checks it renders
the same tokens), so transformers' ``return_assistant_tokens_mask`` on it is an independent
reference for the segmentation of the unmarked one.

``templates/{glm4moe,gptoss,deepseekv3,phi3}.jinja`` are the stock templates of GLM-4.5, GPT-OSS,
DeepSeek-V3 and Phi-3 as TRL keeps them to recognise those models (trl 1.16,
``trl/chat_templates/<name>.jinja``; tests/unit/test_chat_families.py checks they are TRL's), each with a
tokenizer of that family's special tokens (:func:`family_tokenizer`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import transformers
from conftest import SONNET
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEMPLATES = Path(__file__).resolve().parent / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")

QWEN3_MARKED = (TEMPLATES / "qwen3_marked.jinja").read_text(encoding="utf-8")
"""``qwen3.jinja`` with the assistant header ('<|im_start|>assistant\\n') split from the output and
``{% generation %}`` ... ``{% endgeneration %}`` from after it through the turn's '<|im_end|>\\n'."""

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Qwen3's tokenizer adds these as tokens that are not special (they decode with skip_special_tokens)."""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CHAT = [
    {"role": "system", "content": "You answer in verse."},
    {"role": "user", "content": "Is it a summer's day in Verona?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Verona"}}}
        ],
    },
    {"role": "tool", "content": '{"sky": "clear", "wind": "rough"}'},
    {"role": "assistant", "content": "Rough winds do shake the darling buds of May."},
]
"""A Qwen3 tool-calling conversation: a call, its response (a ``tool`` turn), the answer."""
MULTI_TURN = [
    {"role": "system", "content": "You answer in verse."},
    {"role": "user", "content": "Compare me to a day."},
    {"role": "assistant", "content": "Thou art more lovely and more temperate."},
    {"role": "user", "content": "And the wind?"},
    {"role": "assistant", "content": "Rough winds do shake the darling buds of May."},
]


@functools.cache
def _bpe() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=290, special_tokens=SPECIAL, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator([SONNET] * 20, trainer)
    return tok.to_str()


def bpe_tokenizer(post: str = "none", **special: str) -> transformers.PreTrainedTokenizerFast:
    """The BPE as a ``transformers`` tokenizer with the given post-processor: ``none``, ``bos``
    (``<s> $A``, Llama-3-style) or ``bos_eos`` (``<s> $A </s>``, Llama-2-style with add_eos)."""
    tok = Tokenizer.from_str(_bpe())
    tok.add_tokens(PLAIN_ADDED)
    ids = {t: tok.token_to_id(t) for t in ("<s>", "</s>")}
    if post == "bos":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=list(ids.items()))
    elif post == "bos_eos":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=list(ids.items())
        )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def qwen3_tokenizer(eos: str = "<|im_end|>", template: str = QWEN3) -> transformers.PreTrainedTokenizerFast:
    """A Qwen3-style tokenizer: ``eos`` ``<|im_end|>`` as the instruct models' config has it, or
    ``<|endoftext|>`` as the base models' has it; pad ``<|endoftext|>``, no BOS."""
    tok = bpe_tokenizer(eos_token=eos, pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    return tok


def save(tok: transformers.PreTrainedTokenizerFast, directory: Path) -> Path:
    """``tok`` written to ``directory`` (save_pretrained), which is returned."""
    tok.save_pretrained(directory)
    return directory


FAMILIES = {
    # name: (special tokens, plain added tokens, bos, eos, pad)
    "glm4moe": (
        ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
        ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
        None,
        "<|endoftext|>",
        "<|endoftext|>",
    ),
    "gptoss": (
        ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"],
        [],
        None,
        "<|return|>",
        "<|endoftext|>",
    ),
    "deepseekv3": (
        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
        [
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ],
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
    ),
    "phi3": (
        ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        [],
        "<s>",
        "<|endoftext|>",
        "<|endoftext|>",
    ),
}
"""Per stock template of ``templates/``: its model's special tokens as the hub's tokenizer marks them
(GLM-4.5's role markers special, DeepSeek-V3's ``<｜User｜>``/``<｜Assistant｜>`` added but not special),
and its bos/eos/pad."""


def family_tokenizer(name: str) -> transformers.PreTrainedTokenizerFast:
    """The BPE with family ``name``'s tokens (:data:`FAMILIES`) and its stock chat template."""
    special, plain, bos, eos, pad = FAMILIES[name]
    tok = bpe_tokenizer(eos_token=eos, pad_token=pad, **({"bos_token": bos} if bos else {}))
    tok.add_tokens(plain)
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return tok


def target_runs(tok, ids: list[int], mask: list[bool]) -> list[str]:
    """The decoded runs of consecutive target tokens (``mask`` true) of ``ids``, in order."""
    runs, run = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            run.append(i)
        elif run:
            runs, run = [*runs, run], []
    return [tok.decode(r) for r in [*runs, run] if r]
