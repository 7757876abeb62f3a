"""Tiny configs of every supported architecture, each with the fields that exercise its family's
hooks (not a test itself: test_hf_model, test_families and test_family_io build from it).

Every config is built by transformers from fields (no hub download), fp32, a few layers of hidden
32, seq ≤ 16. ``WINDOW`` < the tests' sequence length, so sliding-window layers differ from full ones.
"""

from __future__ import annotations

import transformers

from nodetrain.config.constants import SUPPORTED_ARCHS

WINDOW = 4
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    use_cache=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
_MOE = dict(num_experts_per_tok=2, num_hidden_layers=3)
FIELDS: dict[str, dict] = {
    "MistralForCausalLM": dict(sliding_window=WINDOW),
    "Qwen2ForCausalLM": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    # local then global layer (each its own rope base), √D embedding scale, final logit soft-capping
    "Gemma3ForCausalLM": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=8,
        tie_word_embeddings=True,
    ),
    "Phi3ForCausalLM": dict(sliding_window=WINDOW),
    "Olmo2ForCausalLM": dict(),
    "GraniteForCausalLM": dict(
        embedding_multiplier=6.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.2
    ),
    "SmolLM3ForCausalLM": dict(no_rope_layers=[1, 0]),  # layer 1 has no rotary (NoPE)
    # layer 0 dense, layers 1-2 of 4 experts
    "Qwen3MoeForCausalLM": dict(_MOE, num_experts=4, moe_intermediate_size=16, mlp_only_layers=[0]),
    "MixtralForCausalLM": dict(_MOE, num_local_experts=4, intermediate_size=16),
    "GptOssForCausalLM": dict(
        _MOE,
        num_local_experts=4,
        intermediate_size=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW,
        attention_bias=True,
    ),
    # layer 0 dense (first_k_dense_replace), 1-2: 4 routed experts in 2 groups + a shared one; MLA
    "DeepseekV3ForCausalLM": dict(
        _MOE,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=16,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        head_dim=4,  # DeepSeek: the rotary part of a head (qk_rope_head_dim)
        qk_nope_head_dim=4,
        v_head_dim=8,
        routed_scaling_factor=2.0,
    ),
}
"""Architecture → the fields on top of ``TINY`` that give it its family's features."""

MOE_ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM")
AUX_ARCHS = MOE_ARCHS[:3]
"""Mixtures of experts with a router auxiliary loss in transformers (not DeepSeek-V3)."""


def tiny_config(arch: str, **fields) -> transformers.PretrainedConfig:
    """The tiny config of ``arch`` (``FIELDS`` on top of ``TINY``, then ``fields``)."""
    fields = {**TINY, **FIELDS.get(arch, {}), **fields}
    config = transformers.AutoConfig.for_model(SUPPORTED_ARCHS[arch], **fields)
    config.architectures = [arch]
    return config
