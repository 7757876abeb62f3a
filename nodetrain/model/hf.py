"""Hugging Face adapter: split a decoder-stack CausalLM into units and run them as stateless templates.

Owns: building the HF config, the templates on the ``meta`` device (no storage anywhere), the
flat layout of each unit's parameters, random init, and the forward of one block with weights
bound per call (``torch.func.functional_call``). What a family does between its units (embedding
scale, logit soft-capping, per-layer rotary) is a hook of families.py; the router auxiliary loss
of mixture-of-experts layers is moe.py's. Does not own: where weights live (store.py), how they
reach the device (window.py), or which stage runs what (core/schedule.py).

Shapes: B = sequences in a micro-batch, T = tokens per sequence, D = hidden size, V = vocab.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.func import functional_call
from transformers import AutoConfig, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from nodetrain.config.checks import config_source
from nodetrain.config.constants import SUPPORTED_ARCHS
from nodetrain.config.schema import ModelConfig
from nodetrain.model.families import Family, family_of, refusal
from nodetrain.model.moe import RouterAux, aux_refusal, router_modules, switch_aux_loss, with_aux_grad

__all__ = ["SUPPORTED_ARCHS", "Param", "Unit", "Binding", "HFModel", "build_hf_config"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Param:
    """One tensor of a unit: its HF state-dict name, its name inside the block template, and its
    place in the unit's flat buffer (``offset``/``numel`` in elements)."""

    hf_name: str
    local_name: str
    shape: tuple[int, ...]
    offset: int
    decay: bool
    """True for matrices (weight decay applies), False for norms and biases (also an expert's
    2-D ``*_bias``)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    """The smallest thing that streams: ``embed``, ``layers.<i>`` or ``head``.

    Params are laid out decay-first, so ``[0, num_decay)`` and ``[num_decay, numel)`` of the flat
    buffer are the two AdamW parameter groups.
    """

    index: int
    name: str
    params: tuple[Param, ...]
    numel: int
    num_decay: int


@dataclass(frozen=True)
class Binding:
    """A template parameter bound to a range of some unit's flat buffer. A block normally binds only
    its own unit; the tied head also binds the embedding unit's weight."""

    local_name: str
    unit: int
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Head(nn.Module):
    """Final norm + lm_head (+ the family's logit hook): ``h [B, T, D] -> logits [B, T, V]``."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, family: Family, config: PretrainedConfig):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self._logits, self._config = family.logits, config

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(h))
        return logits if self._logits is None else self._logits(logits, self._config)


def build_hf_config(cfg: ModelConfig, vocab_size: int | None = None) -> PretrainedConfig:
    """The HF config of the run's model.

    With a config directory (``model.config_path``, else ``model.init_from``) it is what
    ``AutoConfig.from_pretrained`` builds from that directory (every config dialect transformers
    reads, its architecture and its ``vocab_size``: a padded embedding keeps its rows), with
    ``model.hf_override`` on top; ``model.arch`` and ``model.hf`` are then not used. Without one it
    is ``model.arch`` with the fields of ``model.hf``.

    Args:
        cfg: the model section of the run config.
        vocab_size: the tokenizer's vocabulary size, used only without a config directory and when
            ``cfg.hf`` sets none.

    Raises:
        ValueError: unsupported ``model.arch``, a config directory of an unsupported architecture,
            a config the adapter cannot run exactly (families.py, with the reason), or a router
            auxiliary loss it cannot compute (moe.py).
    """
    source = config_source(cfg)
    if source is not None:
        hf = AutoConfig.from_pretrained(source, **cfg.hf_override)
        arch = (hf.architectures or [None])[0]
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"{source}: architectures={hf.architectures} is not supported; nodetrain trains "
                f"{', '.join(SUPPORTED_ARCHS)}"
            )
        _log_config_source(cfg, source, hf)
    else:
        if cfg.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"model.arch={cfg.arch!r} is not supported; use one of {sorted(SUPPORTED_ARCHS)}"
            )
        fields = dict(cfg.hf)
        if vocab_size is not None and "vocab_size" not in fields:
            fields["vocab_size"] = vocab_size
        hf = AutoConfig.for_model(SUPPORTED_ARCHS[cfg.arch], **fields)
        hf.architectures = [cfg.arch]
    hf.use_cache = False
    family = family_of(hf)
    why = refusal(hf) or aux_refusal(cfg.router_aux_loss, hf, family.moe, family.router_aux)
    if why:
        raise ValueError(f"{hf.architectures[0]}: {why}")
    return hf


def _log_config_source(cfg: ModelConfig, source: Path, hf: PretrainedConfig) -> None:
    log.info(
        "model: %s from %s (%d layers, hidden %d, vocab %d)",
        hf.architectures[0],
        source,
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.vocab_size,
    )
    if cfg.hf:
        log.info(
            "model.hf of model=%s (%s) is not used: the model is %s's config.json; change a field of it "
            "with +model.hf_override.<key>=<value>",
            cfg.name,
            ", ".join(sorted(cfg.hf)),
            source,
        )
    for key, value in cfg.hf_override.items():
        log.warning("model.hf_override.%s=%r replaces the value in %s's config.json", key, value, source)


def _decays(local_name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not local_name.endswith("bias")


def _layout(index: int, name: str, named: list[tuple[str, str, torch.Tensor]]) -> Unit:
    ordered = sorted(named, key=lambda item: not _decays(item[1], item[2]))  # stable: decay params first
    params, offset, num_decay = [], 0, 0
    for hf_name, local_name, t in ordered:
        decay = _decays(local_name, t)
        params.append(Param(hf_name, local_name, tuple(t.shape), offset, decay))
        offset += t.numel()
        num_decay += t.numel() if decay else 0
    return Unit(index, name, tuple(params), offset, num_decay)


class HFModel:
    """A decoder-stack CausalLM (``families.FAMILIES``) as units + meta templates; holds no weights.

    Units (and blocks, one per unit, same index): 0 = embed, 1..L = decoder layers, L+1 = head.

    Args:
        hf_config: from :func:`build_hf_config`.
        router_aux: the per-layer router auxiliary loss of an MoE run (moe.py), or None: none.
    """

    def __init__(self, hf_config: PretrainedConfig, router_aux: RouterAux | None = None):
        self.config = hf_config
        arch = hf_config.architectures[0]
        self.family = family_of(hf_config)
        with torch.device("meta"):
            self._meta = getattr(transformers, arch)(hf_config)
        self._meta.train()
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        inner = self._meta.model
        self.templates: list[nn.Module] = [
            inner.embed_tokens,
            *inner.layers,
            _Head(inner.norm, self._meta.lm_head, self.family, hf_config),
        ]
        self._padding_idx = getattr(inner.embed_tokens, "padding_idx", None)
        self.routers = [router_modules(type(inner), layer) for layer in inner.layers]
        self.router_aux = router_aux
        num_moe = sum(map(bool, self.routers))
        if router_aux is not None and not num_moe:
            raise ValueError(f"{arch}: a router auxiliary loss needs experts; this model has none")
        self._aux_scale = router_aux.scale(num_moe) if router_aux else 0.0
        self._aux_weight = router_aux.weight(num_moe) if router_aux else 0.0
        self.aux_coef = router_aux.coef if router_aux else 0.0
        """``router_aux_loss_coef`` of the run's auxiliary loss; 0 without one."""
        self.units = self._build_units()
        self.bindings = [self._bindings(u) for u in self.units]
        self.constants = self._build_constants()
        self._constants_on: dict[tuple[int, torch.device], dict[str, torch.Tensor]] = {}
        self.ignored_keys = tuple(getattr(type(self._meta), "_keys_to_ignore_on_load_unexpected", None) or ())
        """Regexes of checkpoint tensors transformers skips on load (DeepSeek-V3's MTP layer 61)."""
        self.has_dropout = any(float(getattr(hf_config, k, 0.0) or 0.0) > 0 for k in self.family.random_keys)
        self._rotary: dict[torch.device, nn.Module] = {}

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """Inside the block the templates are in eval mode (no dropout, so no random numbers are
        drawn: evaluation leaves the training RNG stream as it found it); train mode again after."""
        self._meta.eval()
        try:
            yield
        finally:
            self._meta.train()

    def _build_units(self) -> list[Unit]:
        units = [_layout(0, "embed", [("model.embed_tokens.weight", "weight", self.templates[0].weight)])]
        for i in range(self.num_layers):
            named = [(f"model.layers.{i}.{n}", n, p) for n, p in self.templates[1 + i].named_parameters()]
            units.append(_layout(1 + i, f"layers.{i}", named))
        head = [("model.norm.weight", "norm.weight", self.templates[-1].norm.weight)]
        if not self.tied:
            head.append(("lm_head.weight", "lm_head.weight", self.templates[-1].lm_head.weight))
        units.append(_layout(self.num_layers + 1, "head", head))
        return units

    def _build_constants(self) -> list[dict[str, tuple[str, torch.Tensor]]]:
        """Per block: local name -> (HF name, fp32 CPU tensor) of the persistent buffers of its
        template (DeepSeek-V3's router ``e_score_correction_bias``). transformers saves and loads
        them but never trains them (no gradient reaches them: they only choose experts), so they
        live here, not in the host store: read at import (hf_import), written at export, the
        module's init (zeros) otherwise, bound to every call as they are."""
        out: list[dict[str, tuple[str, torch.Tensor]]] = [{} for _ in self.templates]
        for i in range(self.num_layers):
            template = self.templates[1 + i]
            for name, buf in template.named_buffers():
                owner, _, leaf = name.rpartition(".")
                if leaf not in template.get_submodule(owner)._non_persistent_buffers_set:
                    out[1 + i][name] = (
                        f"model.layers.{i}.{name}",
                        torch.zeros(buf.shape, dtype=torch.float32),
                    )
        return out

    def set_constant(self, block: int, local_name: str, value: torch.Tensor) -> None:
        """Replace a constant (import: before any forward; see ``_build_constants``)."""
        self.constants[block][local_name][1].copy_(value)
        self._constants_on.clear()

    def _bound_constants(self, block: int, device: torch.device) -> dict[str, torch.Tensor]:
        key = (block, device)
        if key not in self._constants_on:
            self._constants_on[key] = {k: t.to(device) for k, (_, t) in self.constants[block].items()}
        return self._constants_on[key]

    def _bindings(self, unit: Unit) -> tuple[Binding, ...]:
        own = [Binding(p.local_name, unit.index, p.offset, p.shape) for p in unit.params]
        if unit.name == "head" and self.tied:
            emb = self.units[0].params[0]
            own.append(Binding("lm_head.weight", 0, emb.offset, emb.shape))
        return tuple(own)

    def block_cost(self, index: int) -> int:
        """Compute cost of a block in parameters multiplied per token (2 FLOPs each, forward).

        The embedding is a lookup (no matmul, cost 0); the head counts its ``V × D`` matmul,
        also when that weight is the tied embedding's. A mixture of experts' layer counts its
        active parameters: each token runs ``num_experts_per_tok`` of the E stacked experts.
        """
        if index == 0:
            return 0
        return round(sum(b.numel * self._active_fraction(b) for b in self.bindings[index]))

    def _active_fraction(self, b: Binding) -> float:
        experts = getattr(self.config, "num_local_experts", None) or getattr(self.config, "num_experts", 0)
        if self.family.moe and ".experts." in f".{b.local_name}" and b.shape[0] == experts:
            return self.config.num_experts_per_tok / experts
        return 1.0

    def init_unit(self, unit: Unit, out: torch.Tensor, seed: int) -> None:
        """Random init of one unit into ``out`` ([unit.numel] fp32), independent of the stage layout.

        Matrices ~ N(0, initializer_range) (as HF's ``_init_weights`` for these architectures),
        attention sinks too, norm weights = 1, biases = 0. The generator is seeded by (seed, unit index).
        """
        gen = torch.Generator().manual_seed(seed * 1_000_003 + unit.index)
        std = float(getattr(self.config, "initializer_range", 0.02))
        for p in unit.params:
            view = out[p.offset : p.offset + p.numel]
            if p.decay or p.local_name.endswith("sinks"):
                view.copy_(torch.randn(p.numel, generator=gen) * std)
            elif p.local_name.endswith("bias"):
                view.zero_()
            else:
                view.fill_(1.0)

    # ---- compute ---------------------------------------------------------------------------

    def context(
        self,
        h: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        packed: bool = True,
        token_mask: torch.Tensor | None = None,
    ) -> dict:
        """Per micro-batch inputs every decoder layer needs: rotary (cos, sin), position ids, masks.

        Args:
            h: [B, T, D] hidden states (any dtype/device); only shape, dtype and device are used.
            position_ids: [B, T] int64 on h's device, or None (0..T-1 in every row). Packed rows
                restart at 0 for each document; transformers' mask functions then detect the
                packing (``find_packed_sequence_indices``) and make the causal mask block-diagonal,
                so no token attends across a document boundary.
            packed: False when the caller knows that no row of ``position_ids`` restarts: the masks
                are then built without position ids (the same causal mask, without the detection,
                whose ``.all()`` is a device sync on CUDA). Without ``position_ids`` they never see any.
            token_mask: [B, T] bool on h's device, False on padding (``PackedRows.token_mask``): the
                router auxiliary loss leaves those tokens out (moe.py); None = no padding.
        """
        device = h.device
        if device not in self._rotary:
            self._rotary[device] = type(self._meta.model.rotary_emb)(self.config).to(device)
        if position_ids is None:
            pos = torch.arange(h.shape[1], device=device).unsqueeze(0)  # [1, T]
        else:
            pos = position_ids  # [B, T], moved by the caller (once per step, not per block)
        mask_pos = pos if position_ids is not None and packed else None  # None: no packing detection
        rotary = self._rotary[device]
        if self.family.rope_per_layer_type:  # Gemma 3: local and global layers, each its own base
            cos_sin = {t: rotary(h, pos, t) for t in sorted(set(self.config.layer_types))}
        else:
            cos_sin = rotary(h, pos)
        # The first four arguments positionally: the KV cache's keyword is ``past_key_values`` up to
        # 5.23 and ``cache`` from 5.24 (the old one deprecated), so ``cache=`` fails on 5.17.
        args = (self.config, h, None, None)  # config, inputs_embeds, attention_mask, KV cache
        masks = {"full_attention": create_causal_mask(*args, position_ids=mask_pos)}
        if getattr(self.config, "sliding_window", None) is not None:
            masks["sliding_attention"] = create_sliding_window_causal_mask(*args, position_ids=mask_pos)
        return {"position_embeddings": cos_sin, "position_ids": pos, "masks": masks, "token_mask": token_mask}

    def _rope_for(self, layer: int, cos_sin):
        return cos_sin[self.config.layer_types[layer]] if isinstance(cos_sin, dict) else cos_sin

    def _mask_for(self, layer: int, masks: dict) -> torch.Tensor | None:
        types = getattr(self.config, "layer_types", None)
        if types is not None:
            return masks.get(types[layer], masks["full_attention"])
        return masks.get("sliding_attention", masks["full_attention"])

    def forward_block(
        self, index: int, params: dict[str, torch.Tensor], x: torch.Tensor, ctx: dict | None, aux_out=None
    ):
        """Run block ``index`` with ``params`` bound.

        Args:
            params: local name -> tensor (compute dtype, on the compute device).
            x: embed: input ids [B, T] int64; layer and head: hidden [B, T, D].
            ctx: from :meth:`context` (layers only).
            aux_out: a list that an MoE layer carrying the auxiliary loss appends its term of the
                step's ``aux_loss`` to (fp32 scalar, detached: Σ aux / (L_moe · M), moe.py), or None.

        Returns:
            [B, T, D] hidden for embed and layers; [B, T, V] logits for the head.

        The embedding is the plain lookup (as the engine's gather by rows); the family's embedding
        scale is applied on entry to the first decoder layer. With a router auxiliary loss and
        autograd on (the backward's recompute), an MoE layer's output carries its term (moe.py).
        """
        template = self.templates[index]
        if index == 0:
            return F.embedding(x, params["weight"], self._padding_idx)
        if index == len(self.units) - 1:
            return functional_call(template, params, (x,))
        if index == 1 and self.family.embed is not None:
            x = self.family.embed(x, self.config)
        layer = index - 1
        if self.constants[index]:  # not leaves of the backward: no gradient, never updated
            params = {**params, **self._bound_constants(index, x.device)}
        kwargs = {
            "attention_mask": self._mask_for(layer, ctx["masks"]),
            "position_embeddings": self._rope_for(layer, ctx["position_embeddings"]),
            "position_ids": ctx["position_ids"],
        }
        if self.router_aux is None or not self.routers[layer] or not torch.is_grad_enabled():
            return functional_call(template, params, (x,), kwargs)
        return self._forward_with_aux(layer, template, params, x, kwargs, aux_out, ctx.get("token_mask"))

    def _forward_with_aux(
        self, layer: int, template: nn.Module, params: dict, x, kwargs: dict, aux_out, mask
    ):
        """A MoE layer whose output carries ``scale · Σ aux`` of its routers into the backward."""
        logits: list[torch.Tensor] = []
        hooks = [r.register_forward_hook(lambda m, i, o: logits.append(o[0])) for r in self.routers[layer]]
        try:
            out = functional_call(template, params, (x,), kwargs)
        finally:
            for h in hooks:
                h.remove()
        keep = None if mask is None else mask.reshape(-1)  # [B·T], the routers' token order
        aux = sum(switch_aux_loss(z, self.router_aux.top_k, keep) for z in logits)
        if aux_out is not None:
            aux_out.append(aux.detach() * self._aux_weight)
        return with_aux_grad(out, aux, self._aux_scale)
