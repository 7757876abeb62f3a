"""Mixture-of-experts decoder layers as streamed units: their routers and the router auxiliary loss.

An MoE decoder layer is one unit like any other: its experts' weights (3-D ``gate_up_proj`` /
``down_proj``, E experts stacked), its router and its attention stream together and run as
transformers' own module, bound per call. This module owns what transformers does with the
routers outside the layer: the load-balancing loss, chosen by ``model.router_aux_loss``:

- ``auto`` (default): what the model's config says. ``output_router_logits=False`` (the default of
  every supported MoE config): no auxiliary loss, as transformers. ``True``: transformers' pooled
  form, which is refused (below).
- ``off``: no auxiliary loss, whatever the config says.
- ``per_layer``: each MoE layer's own load-balancing loss, Switch Transformer's (Fedus et al.,
  arXiv:2101.03961, eq. 4) with top-k assignments: ``aux_l = E · Σ_e f_e · P_e`` over the
  micro-batch's tokens, f_e the fraction of top-k assignments that go to expert e and P_e the
  mean router probability of e (``switch_aux_loss``; equal to transformers'
  ``load_balancing_loss_func`` given one layer's logits and the same mask). The step's objective is the
  token-mean cross-entropy plus ``router_aux_loss_coef / (L_moe · M) · Σ_mb Σ_l aux_l`` (L_moe MoE
  layers, M micro-batches per step: the mean over both). Its gradient enters each layer's backward
  through Megatron-LM's ``MoEAuxLossAutoScaler`` (``_AuxLossGrad``): the layer's output carries
  the term, whose gradient is the constant scale, so no stage sends anything more. Padding does
  not count: the tokens of a micro-batch are its rows' documents (``HFModel.context``'s
  ``token_mask``, from ``packing.PackedRows.token_mask``), transformers' value with the
  ``attention_mask`` of right-padded rows (PR #28517). The reported loss is transformers'
  ``outputs.loss``: the cross-entropy plus ``router_aux_loss_coef · aux_loss``, with
  ``aux_loss = Σ_mb Σ_l aux_l / (L_moe · M)`` (what transformers returns as ``outputs.aux_loss``,
  unscaled), logged on its own as well.

The pooled form is refused: each layer's gradient would need the router counts of other stages'
layers (the reason in full: docs/models.md).

Shapes: N = tokens of a micro-batch (B × T), E = routed experts, k = experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nodetrain.config.schema import Config

__all__ = [
    "AUX_FORMS",
    "RouterAux",
    "aux_refusal",
    "router_aux_of",
    "router_modules",
    "switch_aux_loss",
    "with_aux_grad",
]

AUX_FORMS = ("auto", "off", "per_layer")
"""Values of ``model.router_aux_loss``."""


def switch_aux_loss(logits: torch.Tensor, top_k: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's load-balancing loss ``E · Σ_e f_e · P_e`` (Switch Transformer eq. 4, top-k) over
    the tokens ``token_mask`` keeps: padding does not vote (transformers' ``load_balancing_loss_func``
    with an ``attention_mask``, PR #28517).

    Args:
        logits: [N, E] router logits (any float dtype) of one layer's tokens.
        top_k: experts each token is sent to.
        token_mask: [N] bool on the logits' device, False on padding; None = every token counts.

    Returns:
        fp32 scalar; differentiable through P (the softmax), not through f (the assignments).
    """
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
    chosen = torch.topk(probs, top_k, dim=-1).indices  # [N, k]
    if token_mask is None:
        counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
        counts.index_add_(0, chosen.flatten(), torch.ones(chosen.numel(), device=logits.device))
        f = counts / probs.shape[0]  # [E] assignments per token
        return num_experts * torch.sum(f * probs.mean(dim=0))
    keep = token_mask.to(torch.float32)  # [N]
    tokens = keep.sum().clamp(min=1.0)  # no sync: a micro-batch of padding only gives 0
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device)
    counts.index_add_(0, chosen.flatten(), keep.repeat_interleave(top_k))
    p = (probs * keep[:, None]).sum(dim=0) / tokens  # [E] mean probability over kept tokens
    return num_experts * torch.sum(counts / tokens * p)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; the backward also gives ``aux`` the gradient ``scale`` (Megatron-LM's
    ``MoEAuxLossAutoScaler``): ``d(objective)/d aux`` is a constant of the step."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux, ctx.scale), None


def with_aux_grad(out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """``out`` unchanged, carrying ``scale · aux`` into its backward (see ``_AuxLossGrad``)."""
    if not torch.is_grad_enabled():
        return out
    return _AuxLossGrad.apply(out, aux, scale)


def router_modules(model_cls: type, layer: nn.Module) -> list[nn.Module]:
    """The router modules of a decoder layer template: the class transformers records
    ``router_logits`` from (``_can_record_outputs``), whose output 0 is [N, E] logits."""
    recorder = getattr(model_cls, "_can_record_outputs", {}).get("router_logits")
    if recorder is None:
        return []
    return [m for m in layer.modules() if isinstance(m, recorder.target_class)]


@dataclass(frozen=True)
class RouterAux:
    """The per-layer auxiliary loss of a run (see the module docstring): each MoE layer's term of
    a micro-batch is weighted ``coef / (L_moe · num_microbatches)`` (``scale``)."""

    coef: float
    """``router_aux_loss_coef`` of the HF config."""
    top_k: int
    num_microbatches: int
    """Micro-batches per optimizer step."""

    def weight(self, num_moe_layers: int) -> float:
        """The weight of one layer's term of one micro-batch in the step's ``aux_loss`` (its mean)."""
        return 1.0 / (num_moe_layers * self.num_microbatches)

    def scale(self, num_moe_layers: int) -> float:
        """The weight of one layer's term of one micro-batch in the step's objective."""
        return self.coef * self.weight(num_moe_layers)


def aux_refusal(form: str, config: PretrainedConfig, moe: bool, has_aux: bool = True) -> str | None:
    """Why ``model.router_aux_loss=form`` cannot run on ``config``, or None (``moe``: the model has
    experts; ``has_aux``: transformers has an auxiliary loss for the family)."""
    if form not in AUX_FORMS:
        return f"model.router_aux_loss={form!r}: use one of {', '.join(AUX_FORMS)}"
    if form == "per_layer" and not moe:
        return "model.router_aux_loss=per_layer: the model has no experts"
    if form == "per_layer" and not has_aux:
        return (
            "model.router_aux_loss=per_layer: transformers has no auxiliary loss for this family (its "
            "routers choose by sigmoid scores plus e_score_correction_bias, not the softmax the Switch "
            "loss balances)"
        )
    if form == "auto" and moe and has_aux and getattr(config, "output_router_logits", False):
        return (
            "output_router_logits=True asks for transformers' pooled load_balancing_loss_func, which "
            "pools the router statistics of all layers of one forward (across pipeline stages); "
            "nodetrain cannot compute it exactly. Set model.router_aux_loss=per_layer (each layer's "
            "Switch Transformer loss, see nodetrain/model/moe.py) or =off"
        )
    return None


def router_aux_of(cfg: Config, config: PretrainedConfig, num_microbatches: int) -> RouterAux | None:
    """The run's :class:`RouterAux` (``model.router_aux_loss``), or None: no auxiliary loss.

    Args:
        cfg: the validated run config (``build_hf_config`` has refused a form that cannot run).
        config: the run's HF config.
        num_microbatches: micro-batches of the global batch (``BatchShape.global_microbatches``): every
            replica's (their gradients are summed, as the cross-entropy's token weights are global).
    """
    if cfg.model.router_aux_loss != "per_layer":
        return None
    return RouterAux(float(config.router_aux_loss_coef), int(config.num_experts_per_tok), num_microbatches)
