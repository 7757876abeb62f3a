"""Model adapters: Hugging Face CausalLMs split into units with stateless meta templates.

Owns units, meta templates, ties and HF config dialects. Must not import anything above config and store.
"""

from nodetrain.model.hf import SUPPORTED_ARCHS, Binding, HFModel, Param, Unit, build_hf_config

__all__ = ["SUPPORTED_ARCHS", "Binding", "HFModel", "Param", "Unit", "build_hf_config"]
