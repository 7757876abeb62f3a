"""Where each tensor of a Hugging Face checkpoint lies in a unit's parameters (fused experts).

transformers 5 holds a mixture of experts' weights stacked in the module (``experts.gate_up_proj``
[E, 2I, D], ``experts.down_proj`` [E, D, I]), but its checkpoints — the hub's, and what its own
``save_pretrained`` writes (``transformers/conversion_mapping.py`` reverts the fusion on save, 5.17 to 5.24
alike) — hold one tensor per expert and projection, under transformers 4's module names:

    Qwen3-MoE, DeepSeek-V3  mlp.experts.<e>.gate_proj.weight [I, D], .up_proj.weight [I, D],
               .down_proj.weight [D, I]
    Mixtral    block_sparse_moe.experts.<e>.w1.weight (gate), .w3.weight (up), .w2.weight (down);
               block_sparse_moe.gate.weight (the router, ``mlp.gate.weight`` in the module)

Each of these is one contiguous range of the fused parameter (expert e's gate is rows [0, I) of
slab e of ``gate_up_proj``, its up rows [I, 2I)), so import reads into, and export writes from,
views of the unit's flat buffer: no copy, no second buffer. GPT-OSS checkpoints are fused
already (``gate_up_proj`` [E, D, 2I], interleaved, with biases): one piece per parameter, as for
every dense family.

Owns: :func:`checkpoint_pieces` (the layout transformers saves; export writes it) and
:func:`import_pieces` (either layout, whichever the directory holds). Does not own: reading and
checking files (hf_import.py, tensors.py) nor writing them (writer.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from nodetrain.model import HFModel, Param

__all__ = ["Piece", "checkpoint_pieces", "import_pieces"]


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor: its name, and where it lies in a parameter (``offset`` elements
    from the parameter's start, ``shape``; contiguous)."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# model_type → (module prefix in the checkpoint, gate name, up name, down name, router renamed)
_PER_EXPERT = {
    "qwen3_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj", None),
    "deepseek_v3": ("mlp.experts", "gate_proj", "up_proj", "down_proj", None),
    "mixtral": ("block_sparse_moe.experts", "w1", "w3", "w2", "block_sparse_moe.gate.weight"),
}
_FUSED = re.compile(r"^(model\.layers\.\d+\.)mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)$")


def checkpoint_pieces(model: HFModel, param: Param) -> tuple[Piece, ...]:
    """The tensors transformers' ``save_pretrained`` writes for ``param``, in its layout."""
    layout = _PER_EXPERT.get(model.config.model_type)
    match = _FUSED.match(param.hf_name) if layout is not None else None
    if match is None:
        return (Piece(param.hf_name, 0, param.shape),)
    prefix, gate, up, down, router = layout
    layer, kind = match.group(1), match.group(3)
    if kind is None:  # the router
        return (Piece(layer + router, 0, param.shape) if router else Piece(param.hf_name, 0, param.shape),)
    experts, rows, cols = param.shape  # gate_up: [E, 2I, D]; down: [E, D, I]
    name = f"{layer}{prefix}.{{e}}.{{w}}.weight"
    if kind == "down_proj":
        return tuple(Piece(name.format(e=e, w=down), e * rows * cols, (rows, cols)) for e in range(experts))
    half = rows // 2
    return tuple(
        Piece(name.format(e=e, w=w), (2 * e + j) * half * cols, (half, cols))
        for e in range(experts)
        for j, w in enumerate((gate, up))
    )


_HEAD = "lm_head.weight"


def import_pieces(model: HFModel | None, param: Param, names) -> tuple[Piece, ...]:
    """The pieces of ``param`` a directory holding tensors ``names`` provides: the parameter under
    its own name when present (a fused checkpoint, e.g. another trainer's), else transformers'
    saved layout (:func:`checkpoint_pieces`; the caller reports what is missing). A tied model's
    embedding whose one stored matrix is named ``lm_head.weight`` is read from it (transformers
    loads such a checkpoint: either name fills the tied pair). Without a model: the parameter's own
    name."""
    if param.hf_name in names or model is None:
        return (Piece(param.hf_name, 0, param.shape),)
    if model.tied and param.hf_name == model.units[0].params[0].hf_name and _HEAD in names:
        return (Piece(_HEAD, 0, param.shape),)
    return checkpoint_pieces(model, param)
