"""Model adapters: Hugging Face CausalLMs split into units with stateless meta templates.

Owns units, meta templates, ties and HF config dialects (hf.py), the per-family hooks
(families.py) and the experts' router auxiliary loss (moe.py). Must not import anything above
config and store.
"""

from nodetrain.model.hf import SUPPORTED_ARCHS, Binding, HFModel, Param, Unit, build_hf_config
from nodetrain.model.moe import RouterAux, router_aux_of

__all__ = [
    "SUPPORTED_ARCHS",
    "Binding",
    "HFModel",
    "Param",
    "RouterAux",
    "Unit",
    "build_hf_config",
    "router_aux_of",
]
