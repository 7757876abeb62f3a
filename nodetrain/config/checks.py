"""Start-up validation of the config: every field and cross-field rule, checked once, before any allocation.

Owns: what a valid config is beyond one key's range (those sit on the fields, walked first by
fields.py): rules between keys grouped by section, the Hugging Face keys each arch accepts, the model
shape, stages vs ranks vs layers, batch divisibility; and the one ``ConfigError`` that lists every
problem as ``key=value: what is wrong; fix``. Runs identically on every rank. Does not own: the
schema's fields, defaults and one-field rules (nodetrain/config/schema.py, which re-exports
``validate``, ``ConfigError``, ``HF_KEYS`` and ``SUPPORTED_ARCHS``), reading YAML (Hydra), or anything
that needs torch.distributed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodetrain.config.constants import SUPPORTED_ARCHS
from nodetrain.config.fields import check_fields
from nodetrain.config.tier_checks import check_tier

if TYPE_CHECKING:  # the schema imports this module: types only, no runtime import back
    from nodetrain.config.schema import Config, ModelConfig, PipelineConfig, TrainConfig

__all__ = [
    "HF_KEYS",
    "MAX_STAGES",
    "REQUIRED_HF_KEYS",
    "SUPPORTED_ARCHS",
    "ConfigError",
    "DataError",
    "Problems",
    "check_unknown_keys",
    "config_source",
    "no_effect",
    "validate",
]


class ConfigError(ValueError):
    """A user mistake in the config; the message lists every problem, one per line."""


class DataError(ValueError):
    """The data cannot serve this run (missing or unreadable source, too short, vocabulary too large for
    the model); the message names the key, the file and the fix."""


MAX_STAGES = 8  # one stage per GPU of one node
REQUIRED_HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_INT_HF_KEYS = ("num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim")
_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads")

_COMMON_HF_KEYS = frozenset(
    """attention_dropout bos_token_id chunk_size_feed_forward dtype eos_token_id hidden_act hidden_size
    id2label initializer_range intermediate_size is_encoder_decoder label2id max_position_embeddings
    num_attention_heads num_hidden_layers num_key_value_heads output_attentions output_hidden_states
    pad_token_id problem_type return_dict rms_norm_eps rope_parameters tie_word_embeddings use_cache
    vocab_size rope_theta rope_scaling torch_dtype""".split()
)
# rope_theta, rope_scaling and torch_dtype are legacy spellings transformers 5 still accepts.
_QWEN_HF_KEYS = {"layer_types", "max_window_layers", "sliding_window", "use_sliding_window"}
HF_KEYS: dict[str, frozenset[str]] = {
    "LlamaForCausalLM": _COMMON_HF_KEYS | {"attention_bias", "head_dim", "mlp_bias", "pretraining_tp"},
    "MistralForCausalLM": _COMMON_HF_KEYS | {"head_dim", "sliding_window"},
    "Qwen2ForCausalLM": _COMMON_HF_KEYS | _QWEN_HF_KEYS,
    "Qwen3ForCausalLM": _COMMON_HF_KEYS | _QWEN_HF_KEYS | {"attention_bias", "head_dim"},
    "Gemma3ForCausalLM": _COMMON_HF_KEYS - {"hidden_act"}
    | set(
        """_sliding_window_pattern attention_bias attn_logit_softcapping final_logit_softcapping
        head_dim hidden_activation layer_types query_pre_attn_scalar sliding_window
        use_bidirectional_attention""".split()
    ),
    "Phi3ForCausalLM": _COMMON_HF_KEYS
    | {"embd_pdrop", "original_max_position_embeddings", "resid_pdrop", "sliding_window"},
    "Olmo2ForCausalLM": _COMMON_HF_KEYS | {"attention_bias"},
    "GraniteForCausalLM": _COMMON_HF_KEYS
    | set(
        """attention_bias attention_multiplier embedding_multiplier logits_scaling mlp_bias
        residual_multiplier""".split()
    ),
    "SmolLM3ForCausalLM": _COMMON_HF_KEYS
    | set(
        """attention_bias layer_types mlp_bias no_rope_layer_interval no_rope_layers sliding_window
        use_sliding_window""".split()
    ),
    "Qwen3MoeForCausalLM": _COMMON_HF_KEYS
    | set(
        """attention_bias decoder_sparse_step head_dim mlp_only_layers moe_intermediate_size norm_topk_prob
        num_experts_per_tok num_local_experts output_router_logits router_aux_loss_coef sliding_window
        use_sliding_window num_experts""".split()
    ),
    "MixtralForCausalLM": _COMMON_HF_KEYS
    | set(
        """head_dim num_experts_per_tok num_local_experts output_router_logits router_aux_loss_coef
        router_jitter_noise sliding_window""".split()
    ),
    "GptOssForCausalLM": _COMMON_HF_KEYS
    | set(
        """attention_bias head_dim layer_types num_experts_per_tok num_local_experts output_router_logits
        router_aux_loss_coef sliding_window swiglu_alpha swiglu_limit""".split()
    ),
    "DeepseekV3ForCausalLM": _COMMON_HF_KEYS
    | set(
        """attention_bias first_k_dense_replace head_dim kv_lora_rank moe_intermediate_size n_group
        n_routed_experts n_shared_experts norm_topk_prob num_experts_per_tok num_nextn_predict_layers
        output_router_logits pretraining_tp q_lora_rank qk_head_dim qk_nope_head_dim qk_rope_head_dim
        rope_interleave routed_scaling_factor topk_group v_head_dim""".split()
    ),
}
"""Keys ``model.hf`` may set, per arch (the fields of the transformers 5 config class). HF config
classes silently keep unknown kwargs, so a typo such as ``num_hidden_layer`` is refused here."""


def _fmt(value: Any) -> str:
    """A value as the config spells it: ``true``/``false`` (YAML, not Python's True/False), ``<unset>``
    for None, ``''`` for an empty string."""
    if value is None:
        return "<unset>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or "''"
    return str(value)


class Problems(list):
    """Collected problems, each ``key=value: what is wrong; fix``."""

    def add(self, key: str, value: Any, what: str, fix: str) -> None:
        self.append(f"{key}={_fmt(value)}: {what}; {fix}")

    def raise_if_any(self) -> None:
        if self:
            lines = "\n".join(f"  - {p}" for p in self)
            raise ConfigError(f"{len(self)} config problem(s):\n{lines}")


def _unknown_keys(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Keys a ``+key=value`` override forced into a typed node (``to_object`` keeps them as attributes)."""
    if not dataclasses.is_dataclass(obj):
        return []
    known = {f.name for f in dataclasses.fields(obj)}
    found = [(f"{prefix}{k}", v) for k, v in vars(obj).items() if k not in known]
    for name in sorted(known):
        found += _unknown_keys(getattr(obj, name), f"{prefix}{name}.")
    return found


def check_unknown_keys(cfg: Config) -> None:
    """Refuse keys that are not in the schema (forced into a typed node with ``+key=value``).

    Raises:
        ConfigError: listing every such key, as ``key=value: unknown key; remove it``.
    """
    problems = Problems()
    for key, value in _unknown_keys(cfg):
        problems.add(key, value, "unknown key", "remove it (the schema is nodetrain/config/schema.py)")
    problems.raise_if_any()


def _check_data(cfg: Config, problems: Problems) -> None:
    """``data``'s rules between keys."""
    if cfg.data.tokenizer in ("", "bpe") and cfg.data.vocab_size < 257:  # data preparation's rule
        problems.add(
            "data.vocab_size",
            cfg.data.vocab_size,
            "must be >= 257 for the BPE data.tokenizer trains",
            "a byte-level BPE needs the 256 bytes and the end-of-text token",
        )


def _check_optim(cfg: Config, infinite: set[str], problems: Problems) -> None:
    """``optim``'s rules between keys (``infinite``: keys :func:`check_fields` found non-finite)."""
    if not infinite & {"optim.lr", "optim.min_lr"} and not 0 <= cfg.optim.min_lr <= cfg.optim.lr:
        problems.add("optim.min_lr", cfg.optim.min_lr, f"must be <= optim.lr={cfg.optim.lr}", "lower it")
    if cfg.optim.state == "lean" and cfg.train.dtype != "bfloat16":
        problems.add(
            "optim.state",
            "lean",
            f"keeps bf16 master weights, train.dtype={cfg.train.dtype}",
            "set train.dtype=bfloat16",
        )
    if cfg.stream.offload_activations and cfg.stream.recompute is False:  # auto recomputes with it
        problems.add(
            "stream.recompute",
            "false",
            "keeps every layer's activations on the device, which stream.offload_activations=true "
            "moves off it (it offloads saved block inputs only)",
            "set stream.recompute=auto or true (or stream.offload_activations=false)",
        )
    if cfg.stream.offload_activations and type(cfg.pipeline.wave) is int and cfg.pipeline.wave > 1:
        what = "runs a wave of micro-batches per load; stream.offload_activations=true does not order waves"
        fix = "set pipeline.wave=1 (or stream.offload_activations=false)"
        problems.add("pipeline.wave", cfg.pipeline.wave, what, fix)
    if cfg.optim.state == "lean" and cfg.optim.speculative is True:  # auto: no speculation with lean
        problems.add(
            "optim.speculative",
            True,
            "backs up fp32 master weights and moments, which optim.state=lean does not keep",
            "set optim.speculative=false (or optim.state=full)",
        )


def _check_on_device(cfg: Config, problems: Problems) -> None:
    """``optim.on_device=true`` keeps fp32 master weights and moments on the device, loaded from and
    saved to the host store's fp32 state: it needs that state in RAM (``auto`` then keeps none)."""
    if cfg.optim.on_device is not True:
        return
    if cfg.optim.state != "full":
        problems.add(
            "optim.on_device",
            True,
            f"keeps fp32 master weights and moments on the device, optim.state={cfg.optim.state} has none",
            "set optim.on_device=auto or false (or optim.state=full)",
        )
    if cfg.store.tier != "ram":
        problems.add(
            "optim.on_device",
            True,
            f"loads the optimizer state from the host store, store.tier={cfg.store.tier} keeps it in files",
            "set optim.on_device=auto or false (or store.tier=ram)",
        )


def no_effect(cfg: Config) -> list[str]:
    """Settings the user asked for that this combination of keys ignores, one line each (logged at
    start-up, train.run): not errors, but never silent."""
    o, notes = cfg.optim, []
    if o.speculative is True:
        off = [
            k
            for k, on in (
                ("optim.overlap=false", o.overlap),
                (f"optim.max_grad_norm={o.max_grad_norm} (no clipping)", o.max_grad_norm > 0),
                ("optim.update_in_backward=false", o.update_in_backward),
            )
            if not on
        ]
        if off:
            notes.append(
                "optim.speculative=true has no effect: speculation needs optim.overlap, clipping and "
                f"optim.update_in_backward, and this run has {', '.join(off)}"
            )
    return notes


def config_source(model: ModelConfig) -> Path | None:
    """The directory or ``config.json`` that defines the model: ``model.config_path``, else
    ``model.init_from``; None when the model is built from ``model.arch`` + ``model.hf``."""
    source = model.config_path or model.init_from
    return Path(source).expanduser() if source else None


def _check_hf_keys(model: ModelConfig, problems: Problems) -> None:
    if model.arch not in SUPPORTED_ARCHS:
        problems.add("model.arch", model.arch, "not supported", f"use one of {', '.join(SUPPORTED_ARCHS)}")
        return
    for key in sorted(set(model.hf) - HF_KEYS[model.arch]):
        what = f"not a field of the {model.arch} config"
        problems.add(f"model.hf.{key}", model.hf[key], what, "check the spelling against HF's config.json")


def _effective_hf(model: ModelConfig, problems: Problems) -> dict[str, Any]:
    """The HF fields of the run's model: the config directory's ``config.json`` (if any) with
    ``model.hf_override`` on top, else ``model.hf``."""
    source = config_source(model)
    if source is None:
        return dict(model.hf)
    key = "model.config_path" if model.config_path else "model.init_from"
    path = source / "config.json" if source.is_dir() else source
    if key == "model.init_from" and not source.is_dir():
        return dict(model.hf_override)  # reported by the field check
    try:
        base = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        fix = "point it at an HF config.json or the directory holding one"
        problems.add(key, str(source), f"cannot be read ({e})", fix)
        return dict(model.hf_override)
    archs = base.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHS:
        what = f"{path} has architectures={archs}"
        problems.add(key, str(source), what, f"nodetrain trains {', '.join(SUPPORTED_ARCHS)}")
    else:
        for name in sorted(set(model.hf_override) - HF_KEYS[arch]):
            what = f"not a field of the {arch} config"
            problems.add(f"model.hf_override.{name}", model.hf_override[name], what, "check the spelling")
    return {**base, **model.hf_override}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_shape(model: ModelConfig, hf: dict[str, Any], problems: Problems) -> None:
    for key in REQUIRED_HF_KEYS:
        if key not in hf and config_source(model) is None:
            problems.add(f"model.hf.{key}", None, "required", "set it in the model YAML or model.init_from")
    for key in (*REQUIRED_HF_KEYS, *_OPTIONAL_INT_HF_KEYS):
        if hf.get(key) is not None and not _positive_int(hf[key]):
            problems.add(f"model.hf.{key}", hf[key], "must be a positive integer", "fix or remove it")
    hidden, heads, kv_heads = (hf.get(k) for k in ("hidden_size", *_HEAD_KEYS))
    if _positive_int(hidden) and _positive_int(heads) and hf.get("head_dim") is None and hidden % heads:
        what = f"not divisible by model.hf.num_attention_heads={heads}"
        problems.add("model.hf.hidden_size", hidden, what, "change either, or set model.hf.head_dim")
    if _positive_int(heads) and _positive_int(kv_heads) and heads % kv_heads:
        what = f"not divisible by model.hf.num_key_value_heads={kv_heads}"
        problems.add("model.hf.num_attention_heads", heads, what, "GQA needs whole groups; change either")


def _check_model_vs_run(cfg: Config, hf: dict[str, Any], problems: Problems) -> None:
    max_pos, vocab = hf.get("max_position_embeddings"), hf.get("vocab_size")
    if _positive_int(max_pos) and cfg.train.seq_len > max_pos:
        what = f"longer than model.hf.max_position_embeddings={max_pos}"
        problems.add("train.seq_len", cfg.train.seq_len, what, "shorten the sequences")
    trains_bpe = cfg.data.tokenizer == "bpe" or not (cfg.data.tokenizer or cfg.model.init_from)
    if _positive_int(vocab) and trains_bpe and vocab < cfg.data.vocab_size:
        what = f"smaller than data.vocab_size={cfg.data.vocab_size}"
        problems.add("model.hf.vocab_size", vocab, what, "remove it (the tokenizer then sets it) or raise it")


def _check_stages(
    cfg: Config, world_size: int, per_node: int, hf: dict[str, Any], problems: Problems
) -> None:
    stages, layers = cfg.pipeline.stages or per_node, hf.get("num_hidden_layers")
    if cfg.pipeline.stages < 0:
        return
    if stages != per_node or world_size % per_node:
        nodes = f" on each of {world_size // per_node} nodes" if world_size > per_node else ""
        what = f"must equal the ranks per node, {per_node}{nodes} (one stage per rank)"
        fix = f"launch with torchrun --nproc_per_node {stages}, or set pipeline.stages=0"
        problems.add("pipeline.stages", cfg.pipeline.stages, what, fix)
    if stages > MAX_STAGES:
        what = f"more than {MAX_STAGES} stages (one per GPU of a node)"
        problems.add("pipeline.stages", stages, what, f"launch with torchrun --nproc_per_node {MAX_STAGES}")
    if _positive_int(layers) and stages > layers:
        what = (
            f"more stages than decoder layers (model.hf.num_hidden_layers={layers}, {layers + 2} units "
            "with embedding and head), so a stage would hold no layer"
        )
        problems.add("pipeline.stages", stages, what, f"use at most {layers} stages or a deeper model")


def _check_batch(train: TrainConfig, pipeline: PipelineConfig, nodes: int, problems: Problems) -> None:
    if not all(type(v) is int for v in (train.micro_batch_size, pipeline.microbatches)):
        return  # auto (the planner picks a divisor) or already reported
    if type(pipeline.wave) is int and pipeline.wave >= 1 and pipeline.microbatches % pipeline.wave:
        m = pipeline.microbatches
        what = f"does not divide pipeline.microbatches={m} (a wave is W micro-batches of a round)"
        problems.add("pipeline.wave", pipeline.wave, what, "use a divisor of pipeline.microbatches, or 1")
    per_round = train.micro_batch_size * pipeline.microbatches * nodes
    if train.batch_size <= 0 or train.micro_batch_size < 1 or pipeline.microbatches < 1:
        return
    if train.batch_size % per_round:
        nodes_factor = f" × {nodes} nodes" if nodes > 1 else ""
        what = f"not a multiple of train.micro_batch_size × pipeline.microbatches{nodes_factor} = {per_round}"
        problems.add("train.batch_size", train.batch_size, what, "change it, or use 0 to derive it")
        return
    derived = train.batch_size // per_round
    if train.grad_accum not in (1, derived):
        what = f"contradicts train.batch_size={train.batch_size}, which implies grad_accum={derived}"
        problems.add("train.grad_accum", train.grad_accum, what, "leave it at 1 when train.batch_size is set")


def validate(cfg: Config, world_size: int, local_world_size: int = 0) -> None:
    """Check every field and cross-field rule once, before any allocation (identically on every rank).

    Args:
        cfg: the typed config (see ``to_typed``).
        world_size: ranks in the launch (torchrun ``--nnodes`` × ``--nproc_per_node``).
        local_world_size: ranks per node (``--nproc_per_node``); 0 = ``world_size`` (one node).

    Raises:
        ConfigError: listing every problem found, one per line, as ``key=value: what is wrong; fix``.
    """
    assert world_size >= 1, f"world_size must be >= 1, got {world_size}"
    problems = Problems()
    infinite = check_fields(cfg, problems)  # every section's one-field rules (config/fields.py)
    _check_data(cfg, problems)
    _check_optim(cfg, infinite, problems)
    _check_hf_keys(cfg.model, problems)
    hf = _effective_hf(cfg.model, problems)
    _check_shape(cfg.model, hf, problems)
    _check_model_vs_run(cfg, hf, problems)
    per_node = local_world_size or world_size
    _check_stages(cfg, world_size, per_node, hf, problems)
    _check_batch(cfg.train, cfg.pipeline, max(1, world_size // per_node), problems)
    check_tier(cfg, problems)
    _check_on_device(cfg, problems)
    problems.raise_if_any()
