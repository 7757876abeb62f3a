"""Model adapters: Hugging Face CausalLMs split into units with stateless meta templates."""

from nodetrain.model.hf import SUPPORTED_ARCHS, Binding, HFModel, Param, Unit, build_hf_config

__all__ = ["SUPPORTED_ARCHS", "Binding", "HFModel", "Param", "Unit", "build_hf_config"]
