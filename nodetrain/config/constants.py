"""The constant tables several subsystems check against: their one home.

Owns: the HF architectures nodetrain can split into units, the pipeline schedule names and the dtype
names a config may give (``train.dtype``, ``checkpoint.export_dtype``). The config checks, the model
adapter, the pipeline, the engine and the checkpoint writer all read them from here.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "SCHEDULES", "SUPPORTED_ARCHS"]

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
"""HF causal-LM class (``architectures[0]`` of a config.json, ``model.arch``) → its ``model_type``."""

SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules (``pipeline.schedule``)."""

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""Config dtype name (``train.dtype``, ``checkpoint.export_dtype``) → torch dtype."""
