"""A model's shape as the planner's arithmetic sees it: its units' sizes, the parameters each block
multiplies per token, and what its decoder layers hold (attention heads, MLP widths, experts).

Owns: ``ModelShape`` and reading it off the HF adapter (``shape_of``; its templates live on the
meta device). Does not own: the bytes and seconds those cost (``memory.py``, ``compute.py``,
``step_time.py``). Total parameters (every expert) are what the store, the window and the link
carry; a mixture of experts' active ones (k of E experts per token) are what a token multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodetrain.model import HFModel

__all__ = ["ModelShape", "shape_of"]


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a model; built from the HF adapter by ``shape_of``."""

    unit_numels: tuple[int, ...]
    """Elements of each unit in the host store (0 = embed, 1..L = layers, L+1 = head)."""
    load_numels: tuple[int, ...]
    """Elements each block binds, i.e. one H2D load and one D2H gradient offload (the tied head
    binds the embedding too)."""
    largest_tensors: tuple[int, ...]
    """Elements of the largest tensor each block binds."""
    costs: tuple[int, ...]
    """Parameters each block multiplies per token (``HFModel.block_cost``; 0 for the embedding)."""
    tied: bool
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    """Qwen3's per-head RMSNorm on q and k."""
    mlp_widths: tuple[int, ...] = ()
    """Per unit, the SwiGLU width one token runs through: a dense MLP's F; a mixture of experts'
    k·F_e plus its shared experts' widths. Empty: ``intermediate`` for every layer."""
    mlp_weights: tuple[int, ...] = ()
    """Per unit, the elements of one of its MLP's three matrices summed over all its experts (and
    shared experts): E·F_e·D + F_s·D. Empty: D·F for every layer."""
    routing: tuple[tuple[int, int], ...] = ()
    """Per unit, (experts per token k, routed experts E); (0, 0) for a dense layer. Empty: all dense."""

    @property
    def num_params(self) -> int:
        """Total parameters (every expert): what the store, the window and the link carry."""
        return sum(self.unit_numels)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: the blocks' ``costs`` (k of E experts) plus its embedding row's
        table (counted whole, as model cards count it)."""
        return sum(self.costs) + self.unit_numels[0]

    def width(self, block: int | None) -> int:
        """The MLP width a token of ``block`` runs through (:attr:`mlp_widths`)."""
        return self.mlp_widths[block] if self.mlp_widths and block is not None else self.intermediate

    def mlp_weight(self, block: int | None) -> int:
        """Elements of one of ``block``'s MLP matrices over all its experts (:attr:`mlp_weights`)."""
        return (
            self.mlp_weights[block]
            if self.mlp_weights and block is not None
            else self.hidden * self.intermediate
        )

    def routed(self, block: int | None) -> tuple[int, int]:
        """(k, E) of ``block`` (:attr:`routing`); (0, 0) when dense."""
        return self.routing[block] if self.routing and block is not None else (0, 0)

    @property
    def num_layers(self) -> int:
        return len(self.unit_numels) - 2


def shape_of(model: HFModel) -> ModelShape:
    """The ``ModelShape`` of an HF adapter (its templates live on the meta device: nothing allocated).

    DeepSeek-V3's MLA attention is priced as attention of H heads of (qk + v head dims) / 2, its
    queries and keys of ``qk_nope_head_dim + qk_rope_head_dim``, values of ``v_head_dim``."""
    c = model.config
    heads = c.num_attention_heads
    mla = getattr(c, "qk_nope_head_dim", None)
    head_dim = (mla + c.qk_rope_head_dim + c.v_head_dim) // 2 if mla else None
    return ModelShape(
        unit_numels=tuple(u.numel for u in model.units),
        load_numels=tuple(sum(b.numel for b in bs) for bs in model.bindings),
        largest_tensors=tuple(max(b.numel for b in bs) for bs in model.bindings),
        costs=tuple(model.block_cost(i) for i in range(len(model.units))),
        tied=model.tied,
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
        heads=heads,
        kv_heads=heads if mla else getattr(c, "num_key_value_heads", None) or heads,
        head_dim=head_dim or getattr(c, "head_dim", None) or c.hidden_size // heads,
        qk_norm=c.architectures[0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        **(_experts_of(model) if model.family.moe else {}),
    )


def _experts_of(model: HFModel) -> dict:
    """A mixture of experts' per-unit ``mlp_widths``, ``mlp_weights`` and ``routing``, read off each
    block's bindings: stacked experts ``…experts.down_proj`` [E, D, F_e] (or [E, F_e, D]), dense or
    shared SwiGLU matrices ``…gate_proj.weight`` [F, D]."""
    d, k = model.config.hidden_size, model.config.num_experts_per_tok
    widths, weights, routing = [], [], []
    for bindings in model.bindings:
        e = f_e = dense = 0
        for b in bindings:
            if b.local_name.endswith("experts.down_proj"):
                e, f_e = b.shape[0], b.numel // (b.shape[0] * d)
            elif b.local_name.endswith("gate_proj.weight"):
                dense += b.numel // d
        widths.append(k * f_e + dense)
        weights.append((e * f_e + dense) * d)
        routing.append((k, e) if e else (0, 0))
    return {"mlp_widths": tuple(widths), "mlp_weights": tuple(weights), "routing": tuple(routing)}
