"""The constant tables several subsystems check against: their one home.

Owns: the HF architectures nodetrain can split into units, the pipeline schedule names and the dtype
names a config may give (``train.dtype``, ``checkpoint.export_dtype``), and where the configs live
(``CONFIG_DIR``: train.py, the planner and the reference page compose from it). The config checks,
the model adapter, the pipeline, the engine and the checkpoint writer all read them from here.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CONFIG_DIR", "DTYPES", "SCHEDULES", "SUPPORTED_ARCHS"]


def _config_dir() -> Path:
    """``nodetrain/conf`` of an installed package (``pip install .`` ships ``conf/`` there, as Hydra
    apps ship their configs), else ``conf/`` of the source checkout (editable install, PYTHONPATH)."""
    here = Path(__file__).resolve().parents[1]  # nodetrain/
    installed = here / "conf"
    return installed if (installed / "config.yaml").is_file() else here.parent / "conf"


CONFIG_DIR = _config_dir()
"""The directory Hydra composes ``config.yaml`` and ``plan.yaml`` from (absolute)."""

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
