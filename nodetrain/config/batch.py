"""A step's batch as numbers: the one place its micro-batches and sequences are computed.

Owns: :class:`BatchShape` (micro-batch size, micro-batches per round, rounds per step, replicas) and
the rule deriving rounds per step from ``train.batch_size`` (:func:`grad_accum_for`): ``grad_accum ×
pipeline.microbatches`` micro-batches per replica, × replicas for the global batch. A derived value of
the config, built once the ``auto`` sizes are resolved (``core/batch.py``); every reader (the data
checks, the router loss, the checkpoint, the engine, the training loop) takes it from there. Does not
own choosing the sizes (core/batch.py) or filling the batch (data/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the schema imports nothing of this module: types only
    from nodetrain.config.schema import Config

__all__ = ["BatchShape", "grad_accum_for", "microbatches_per_step"]


def grad_accum_for(cfg: Config, micro_batch_size: int, microbatches: int, num_replicas: int) -> int:
    """Pipeline rounds per optimizer step of each replica: ``train.batch_size / (micro_batch_size ×
    microbatches × num_replicas)`` when ``train.batch_size`` > 0 (validated to divide), else
    ``train.grad_accum``."""
    if cfg.train.batch_size > 0:
        return cfg.train.batch_size // (micro_batch_size * microbatches * num_replicas)
    return cfg.train.grad_accum


def microbatches_per_step(grad_accum: int, microbatches: int) -> int:
    """Micro-batches one replica runs per optimizer step: ``grad_accum`` rounds (G) of
    ``pipeline.microbatches`` (M), G·M. The one place this product is taken (tests/unit/test_layout.py)."""
    return grad_accum * microbatches


@dataclass(frozen=True)
class BatchShape:
    """One optimizer step's batch, every count a number (``auto`` resolved).

    Attributes:
        micro_batch_size: B, sequences per micro-batch; seq_len: T, tokens per sequence.
        microbatches: M, micro-batches per pipeline round as configured (``pipeline.microbatches``).
        grad_accum: G, rounds per step of each replica (1F1B runs them as one round of G·M).
        num_replicas: K, pipelines (nodes) sharing the global batch.
    """

    micro_batch_size: int
    seq_len: int
    microbatches: int
    grad_accum: int
    num_replicas: int = 1

    @property
    def microbatches_per_step(self) -> int:
        """Micro-batches one replica runs per step, G·M (:func:`microbatches_per_step`)."""
        return microbatches_per_step(self.grad_accum, self.microbatches)

    @property
    def global_microbatches(self) -> int:
        """Micro-batches of the global batch, G·M·K (every replica builds it and keeps its share)."""
        return self.microbatches_per_step * self.num_replicas

    @property
    def sequences_per_step(self) -> int:
        """Sequences of the global batch, B·G·M·K."""
        return self.micro_batch_size * self.global_microbatches

    @property
    def eval_sequences(self) -> int:
        """Sequences of one evaluation batch, B·M (``train.eval_batches`` of them per evaluation)."""
        return self.micro_batch_size * self.microbatches

    @property
    def tokens_per_step(self) -> int:
        """Token positions of the global batch, B·T·G·M·K (valid or not)."""
        return self.sequences_per_step * self.seq_len

    @classmethod
    def of(cls, cfg: Config, num_replicas: int = 1, micro_batch_size=None, microbatches=None) -> BatchShape:
        """The batch of ``cfg`` (or of the sizes given in place of its ``auto`` keys).

        Raises:
            ValueError: a size still ``auto`` (resolve it first, :func:`resolve_batch`).
        """
        b = cfg.train.micro_batch_size if micro_batch_size is None else micro_batch_size
        m = cfg.pipeline.microbatches if microbatches is None else microbatches
        if b == "auto" or m == "auto":
            raise ValueError("train.micro_batch_size / pipeline.microbatches=auto: resolve_batch first")
        return cls(b, cfg.train.seq_len, m, grad_accum_for(cfg, b, m, num_replicas), num_replicas)
