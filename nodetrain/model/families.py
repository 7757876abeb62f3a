"""Per-family hooks of the HF adapter: what a decoder family does outside its decoder layers.

Owns: the table of the causal-LM architectures nodetrain splits into units (:data:`FAMILIES`,
keyed like ``config.constants.SUPPORTED_ARCHS``) and, per family, the few small hooks the
adapter calls at the seams between units:

- ``embed``: the scale of the embedding output (Gemma's √D rounded to the compute dtype,
  Granite's ``embedding_multiplier``). The embedding unit is a plain lookup (the engine may
  gather it by rows, never through the template), so the scale is applied on entry to the first
  decoder layer: the same arithmetic, inside that layer's autograd graph.
- ``logits``: what transformers' ``*ForCausalLM.forward`` does to ``lm_head``'s output (Gemma's
  ``final_logit_softcapping``, Granite's ``logits_scaling``), applied in the head unit.
- ``rope_per_layer_type``: the rotary embedding takes the layer's attention type (Gemma 3: local
  and global layers have their own base frequency).
- ``refuse``: a config this adapter cannot run exactly, with the reason (raised by name).
- ``random_keys``: config fields whose non-zero value draws random numbers inside a layer
  (dropout): the engine then replays the RNG for the backward's recompute.

Everything inside a decoder layer (extra norms, q/k norms, fused projections, attention sinks,
per-layer sliding windows, NoPE layers, experts and routers) is transformers' own module, bound
per call. Does not own: units, templates and compute (hf.py), the router auxiliary loss (moe.py).

Known differences from transformers' own models on packed rows (GPT-OSS, DeepSeek-V3): docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from nodetrain.config.constants import SUPPORTED_ARCHS

__all__ = ["FAMILIES", "Family", "family_of", "refusal"]


def _no_refusal(config: PretrainedConfig) -> str | None:
    return None


@dataclass(frozen=True)
class Family:
    """The hooks of one architecture (see the module docstring); the defaults are Llama's."""

    embed: Callable[[torch.Tensor, PretrainedConfig], torch.Tensor] | None = None
    """``(h [B, T, D], config) -> h``, on entry to the first decoder layer; None: unscaled."""
    logits: Callable[[torch.Tensor, PretrainedConfig], torch.Tensor] | None = None
    """``(logits [..., V], config) -> logits`` after ``lm_head``; None: as they are."""
    rope_per_layer_type: bool = False
    refuse: Callable[[PretrainedConfig], str | None] = _no_refusal
    random_keys: tuple[str, ...] = ("attention_dropout",)
    moe: bool = False
    """Some decoder layers route tokens to experts (router modules, see moe.py)."""
    router_aux: bool = True
    """transformers has a router auxiliary loss for it (its config's ``output_router_logits``)."""


def _gemma_embed_scale(h: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    # Gemma3TextScaledWordEmbedding: ``embedding * embed_scale.to(weight.dtype)``, √D rounded first.
    return h * torch.tensor(config.hidden_size**0.5, dtype=h.dtype, device=h.device)


def _gemma_softcap(logits: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _granite_embed(h: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    return h * config.embedding_multiplier


def _granite_logits(logits: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    return logits / config.logits_scaling


def _gemma_refuse(config: PretrainedConfig) -> str | None:
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True is an encoder's attention (EmbeddingGemma), not a causal LM"
    return None


def _mixtral_refuse(config: PretrainedConfig) -> str | None:
    if getattr(config, "router_jitter_noise", 0.0):
        return (
            f"router_jitter_noise={config.router_jitter_noise} multiplies the router input by fresh "
            "noise in place; set it to 0"
        )
    return None


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(),
    "Qwen3ForCausalLM": Family(),
    "Gemma3ForCausalLM": Family(
        embed=_gemma_embed_scale, logits=_gemma_softcap, rope_per_layer_type=True, refuse=_gemma_refuse
    ),
    "Phi3ForCausalLM": Family(random_keys=("attention_dropout", "resid_pdrop")),
    "Olmo2ForCausalLM": Family(),
    "GraniteForCausalLM": Family(embed=_granite_embed, logits=_granite_logits),
    "SmolLM3ForCausalLM": Family(),
    "Qwen3MoeForCausalLM": Family(moe=True),
    "MixtralForCausalLM": Family(moe=True, refuse=_mixtral_refuse),
    "GptOssForCausalLM": Family(moe=True),
    # Its multi-token-prediction layers (``num_nextn_predict_layers``; the hub's model.layers.61) are
    # not in transformers' model, which skips them on load; so does the import. Balancing is the
    # router's e_score_correction_bias, a buffer transformers loads and never updates: a constant here.
    "DeepseekV3ForCausalLM": Family(moe=True, router_aux=False),
}
"""HF causal-LM class → its hooks; the same keys as ``SUPPORTED_ARCHS`` (a test checks it)."""


_REFUSED = {
    "Gemma3ForConditionalGeneration": "the vision tower is not a decoder stack; train the text model "
    "(architectures=['Gemma3ForCausalLM'], model_type gemma3_text)",
    "Gemma2ForCausalLM": "its attention soft-capping runs only in eager attention; not tested here",
}
"""Architectures people ask for that the adapter refuses, with the reason."""


def family_of(config: PretrainedConfig) -> Family:
    """The hooks of ``config.architectures[0]``.

    Raises:
        ValueError: the architecture is not one nodetrain splits into units.
    """
    arch = (config.architectures or [None])[0]
    if arch not in FAMILIES:
        why = f" ({_REFUSED[arch]})" if arch in _REFUSED else ""
        raise ValueError(
            f"architecture {arch} is not supported{why}; nodetrain trains {', '.join(SUPPORTED_ARCHS)}"
        )
    return FAMILIES[arch]


def refusal(config: PretrainedConfig) -> str | None:
    """Why the adapter cannot run ``config`` exactly, or None when it can."""
    return family_of(config).refuse(config)
