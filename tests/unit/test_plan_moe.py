"""The planner on mixtures of experts: every conf/model MoE shape's total and active parameters
against the totals its publisher states, and the planner's counts of each shape, scaled down, against
transformers' own model of that config (built on the meta device, counted by ``numel``).

Total parameters are what the store, the window and the link carry; active ones (k of E routed
experts per token) are what a token multiplies, the FLOPs and MFU (``HFModel.block_cost``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import yaml

from nodetrain.config.schema import ModelConfig
from nodetrain.cost.shape import shape_of
from nodetrain.model import HFModel, build_hf_config

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"

PUBLISHED = {
    # name: (total, active, whether the publisher's active count includes the embedding table)
    "qwen3_30b_a3b": (30.5e9, 3.3e9, True),  # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated
    "qwen3_235b_a22b": (235e9, 22e9, True),  # Qwen3-235B-A22B model card: 235B, 22B activated
    "deepseek_v3_671b": (671e9, 36.6e9, False),  # README_WEIGHTS.md: 671B, 36.6B activated (head incl.)
    "gpt_oss_120b": (116.8e9, 5.1e9, False),  # OpenAI model card: 116.8B total, 5.1B active
    # Moonshot: 1.04T total (with its multi-token-prediction layer, not in transformers' model), 32B active
    "kimi_k2_1t": (1.04e12, 32e9, False),
}
TOTAL_TOLERANCE = 0.02
"""Published totals are rounded (and Kimi-K2's counts its MTP layer, ~1.3% of it)."""
ACTIVE_TOLERANCE = 0.03


def _shape(name: str, **hf):
    y = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    fields = {**y["hf"], **hf}
    model = HFModel(build_hf_config(ModelConfig(name=name, arch=y["arch"], hf=fields), fields["vocab_size"]))
    return y["arch"], model, shape_of(model)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_shapes_have_their_published_parameter_counts(name: str) -> None:
    total, active, with_embedding = PUBLISHED[name]
    _, _, shape = _shape(name)
    ours = shape.active_params if with_embedding else sum(shape.costs)
    assert shape.num_params == pytest.approx(total, rel=TOTAL_TOLERANCE)
    assert ours == pytest.approx(active, rel=ACTIVE_TOLERANCE)
    assert shape.active_params == sum(shape.costs) + shape.unit_numels[0]


SMALL = dict(hidden_size=64, num_hidden_layers=4, vocab_size=512, intermediate_size=96)
"""Scaled-down fields common to every shape (each keeps its own experts-per-token and layer pattern)."""
SMALL_OF = {
    "qwen3_30b_a3b": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=24,
        num_experts=16,
        num_experts_per_tok=4,
    ),
    "qwen3_235b_a22b": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=24,
        num_experts=16,
        num_experts_per_tok=4,
    ),
    "deepseek_v3_671b": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        moe_intermediate_size=24,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        head_dim=8,
        v_head_dim=16,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=2,
    ),
    "gpt_oss_120b": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=16, intermediate_size=24
    ),
    "kimi_k2_1t": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=24,
        moe_intermediate_size=24,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        head_dim=8,
        v_head_dim=16,
    ),
}


def _reference_counts(arch: str, config) -> tuple[int, int]:
    """(total, active) of transformers' model of ``config`` on the meta device: every parameter's numel;
    active: a routed expert tensor (a parameter of an ``experts`` module) counts k/E of it, the
    embedding table none."""
    config = type(config).from_dict(config.to_dict())
    config.architectures = [arch]
    with torch.device("meta"):
        model = getattr(transformers, arch)(config)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    experts = experts or config.n_routed_experts
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name == "model.embed_tokens.weight":
            continue
        routed = ".experts." in name and ".shared_experts." not in name
        active += p.numel() * config.num_experts_per_tok // experts if routed else p.numel()
    return total, active


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_counts_equal_transformers_model_of_a_scaled_down_config(name: str) -> None:
    arch, model, shape = _shape(name, **{**SMALL, **SMALL_OF[name]})
    total, active = _reference_counts(arch, model.config)
    assert shape.num_params == total
    assert sum(shape.costs) == active
    assert any(k for k, _ in shape.routing) and total > active + shape.unit_numels[0]  # experts were routed
