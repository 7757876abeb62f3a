"""One stage's forward and backward of a micro-batch over its streamed blocks.

Owns: running the stage's blocks in order (forward, no autograd graph kept but for the ``kept``
layers, ``stream.recompute``) and in reverse (backward: recompute each block from its saved input,
or for a kept layer take its kept graph (kept.py), then take gradients of its input and
weights), the saved inputs of in-flight micro-batches (on the device, or waiting in host RAM:
activations.py, ``stream.offload_activations``), the token-weighted loss on the last
stage, and which blocks each action loads and offloads (:meth:`StageRunner.loads`). Does not own:
the window mechanics (window.py) or the order of micro-batches (core/schedule.py).

With waves (``pipeline.wave`` = W > 1, :meth:`StageRunner.forward_wave` / :meth:`StageRunner.backward_wave`)
each block is acquired once per item and run on its W micro-batches in a row (layer-major), each
micro-batch's gradients offloaded as before (the window sums them over the wave, device_acc.py).

The last stage's head (final norm + lm_head) runs once per micro-batch: a training forward
computes its loss and gradients chunk by chunk over tokens (linear_ce.py), offloads the weight
gradients at once and keeps only the gradient of its input for the backward, which therefore
neither reloads nor recomputes the head. Full logits [B, T, V] are never built.

A streamed embedding (a block of ``window.rows``) is not a dense layer: the forward gathers only
the rows of the micro-batch's distinct ids (``Window.gather_rows``) and the backward sums the
output gradient into those rows and offloads them (``Window.offload_rows``), so neither V × D
weights nor a V × D gradient cross per micro-batch. The distinct ids of every micro-batch of a step
are found on the host and their row indices cross once per step (:meth:`StageRunner.first_inputs`).

Shapes: B = micro-batch size, T = sequence length, D = hidden, V = vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nodetrain.core.step_plan import stage_loads, stage_offloads
from nodetrain.engine.device.activations import LiveBytes, Offloaded, SavedOffload
from nodetrain.engine.device.kept import KeptBlock
from nodetrain.engine.device.window import Window
from nodetrain.engine.linear_ce import IGNORE_INDEX, linear_cross_entropy
from nodetrain.engine.step_batch import to_device
from nodetrain.model import HFModel

__all__ = ["StageRunner", "EmbeddingRows", "IGNORE_INDEX"]


@dataclass(frozen=True)
class EmbeddingRows:
    """A micro-batch's token ids as a streamed embedding reads them (U = its distinct ids)."""

    index: torch.Tensor
    """[U] int64 on the host: the distinct ids, sorted (the rows gathered and offloaded)."""
    inverse: torch.Tensor
    """[B, T] int64 on the device: each token's position in ``index``."""
    padding: torch.Tensor | None
    """[U] bool on the device: ``index == padding_idx`` (that row gets no gradient); None without one."""


@contextlib.contextmanager
def _replay_rng(rng):
    """Replays the forward's dropout masks during recompute (as torch.utils.checkpoint does)."""
    if rng is None:
        yield
        return
    devices = [torch.cuda.current_device()] if rng[1] is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1])
        yield


class StageRunner:
    """Forward/backward of micro-batches through the blocks ``blocks`` (contiguous, in order).

    Args:
        model: the HF adapter (templates, no weights).
        blocks: this stage's block indices.
        window: the streaming window over exactly these blocks.
        compute_dtype: dtype of activations and device math.
        offload: where the saved inputs wait between a micro-batch's forward and its backward
            (``stream.offload_activations``, activations.py); None: on the device.
        kept: decoder layers whose training forward keeps its autograd graph for the backward
            instead of being recomputed (``RunShape.kept``, core/recompute.py; not with ``offload``).
    """

    def __init__(
        self,
        model: HFModel,
        blocks: range,
        window: Window,
        compute_dtype: torch.dtype,
        offload: SavedOffload | None = None,
        kept=frozenset(),
    ):
        assert not (kept and offload is not None), "kept activations are not offloaded (config/checks.py)"
        self.model, self.blocks, self.window = model, list(blocks), window
        self.dtype = compute_dtype
        self.is_first = self.blocks[0] == 0
        self.is_last = self.blocks[-1] == len(model.units) - 1
        self._head = self.blocks[-1] if self.is_last else None
        self._recomputed = [b for b in self.blocks if b != self._head]  # what a backward recomputes
        self._rows = set(window.rows)  # the embedding, gathered by rows
        self._padding_idx = getattr(model.templates[0], "padding_idx", None)
        self._saved: dict[int, tuple[list, torch.Tensor | None]] = {}  # mb -> (inputs, d loss/d head in)
        last = len(model.units) - 1
        self.kept = frozenset(b for b in kept if b in self.blocks and 0 < b < last)
        """The decoder layers whose graph a training forward keeps (not recomputed)."""
        self._graphs: dict[int, dict[int, KeptBlock]] = {}  # mb -> kept layer -> its graph
        self._offload = offload
        self.live = offload.live if offload is not None else LiveBytes()
        """The saved inputs alive on the device (their high-water mark: ``saved_peak_bytes``)."""
        self._aux_terms: list[torch.Tensor] = []  # the router aux loss's terms of this step's backwards

    def loads(self, kind: str) -> list[int]:
        """Blocks a training action of ``kind`` ("F" or "B") loads through the window, in order
        (an evaluation forward loads what "F" does)."""
        return stage_loads(self.blocks, self.is_last, self._rows, kind)

    def offloads(self, kind: str) -> list[int]:
        """Blocks whose gradients a training action of ``kind`` offloads, in order: the head's
        at its forward, every other block's at the backward, last block first."""
        return stage_offloads(self.blocks, self.is_last, kind)

    def first_inputs(self, ids: torch.Tensor) -> list:
        """The first stage's input of each micro-batch of a step, with one H2D copy per step.

        A dense embedding gets the token ids on the device; a streamed one (``window.rows``) the
        :class:`EmbeddingRows` of each micro-batch: distinct ids found on the host, the row indices
        (and padding flags) of all micro-batches moved together.

        Args:
            ids: [N, B, T] int64 token ids on the host.

        Returns:
            N inputs for :meth:`forward`: [B, T] int64 on the device, or :class:`EmbeddingRows`.
        """
        device = self.window.device
        if 0 not in self._rows:
            return list(to_device(ids, device).unbind(0))
        found = [torch.unique(x, return_inverse=True) for x in ids]  # per micro-batch: [U], [B, T]
        index = [i for i, _ in found]
        inverse = to_device(torch.stack([inv for _, inv in found]), device)  # [N, B, T]
        padding = [None] * len(found)
        if self._padding_idx is not None:
            flags = to_device(torch.cat(index) == self._padding_idx, device)  # [Σ U] bool
            padding = flags.split([len(i) for i in index])
        return [EmbeddingRows(i, inv, p) for i, inv, p in zip(index, inverse, padding, strict=True)]

    def forward(
        self,
        mb: int,
        x,
        labels: torch.Tensor | None,
        keep: bool = True,
        position_ids: torch.Tensor | None = None,
        loss_scale: float = 1.0,
        packed: bool = True,
        token_mask: torch.Tensor | None = None,
    ):
        """Forward micro-batch ``mb`` (a wave of one: :meth:`forward_wave`).

        Args:
            x: first stage: its input from :meth:`first_inputs`, or input ids [B, T] int64 on the
                device (a streamed embedding: also on the host; its rows are then found now);
                others: hidden [B, T, D] compute dtype on the device.
            labels: last stage: [B, T] int64 next-token ids (-100 = ignore) on the device; else None.
            keep: training: save block inputs for a later :meth:`backward` and, on the last stage,
                offload the head's weight gradients now (False for evaluation: the loss only).
            position_ids: [B, T] int64 on the device (packed documents restart at 0), or None (0..T-1).
            loss_scale: last stage, training: 1 / (valid tokens of the whole step), the scale of
                the head's gradients (see :meth:`backward`).
            packed: False when no row of ``position_ids`` restarts (``HFModel.context``).
            token_mask: [B, T] bool on the device, False on padding (the router auxiliary loss leaves
                it out, ``HFModel.context``), or None: no padding.

        Returns:
            hidden [B, T, D] to send on, or on the last stage the summed token loss (fp32 scalar).
        """
        if self._rows and isinstance(x, torch.Tensor):  # a caller outside a step: this micro-batch's rows now
            (x,) = self.first_inputs(x.cpu()[None])
        (out,) = self.forward_wave(
            [mb], [x], [labels], keep, [position_ids], loss_scale, [packed], [token_mask]
        )
        return out

    def forward_wave(
        self,
        mbs: list[int],
        xs: list,
        labels: list,
        keep: bool,
        positions: list,
        loss_scale: float,
        packed: list,
        masks: list,
    ) -> list:
        """Forward a wave of W micro-batches ``mbs`` layer-major: each block is acquired once and run on
        every micro-batch of the wave in order before it is released (W = 1: :meth:`forward`).

        Args:
            mbs: the micro-batches (numbered across the step); xs, labels, positions, packed, masks: per
                micro-batch, as :meth:`forward`'s ``x``, ``labels``, ``position_ids``, ``packed``,
                ``token_mask``; keep, loss_scale: as :meth:`forward`.

        Returns:
            per micro-batch, hidden [B, T, D] compute dtype on the device, or on the last stage its
            summed token loss (fp32 scalar).
        """
        w = len(mbs)
        saved, ctxs, grad_hs, xs = [[] for _ in range(w)], [None] * w, [None] * w, list(xs)
        with torch.no_grad():
            for block in self.blocks:
                if block in self._rows:
                    for j in range(w):
                        xs[j], used = self._gather_embedding(block, xs[j])
                        saved[j].append((used, None))
                    continue
                params = self.window.acquire(block)
                for j, mb in enumerate(mbs):
                    if block == self._head:
                        xs[j], grad_hs[j] = self._head_forward(
                            block, params, xs[j], labels[j], keep, loss_scale
                        )
                        continue
                    if ctxs[j] is None and block != 0:
                        ctxs[j] = self.model.context(xs[j], positions[j], packed[j], masks[j])
                    if keep and block in self.kept:  # its graph, not its RNG: no recompute to replay
                        saved[j].append((self._save(mb, xs[j]), None))
                        xs[j] = self._kept_forward(mb, block, params, xs[j], ctxs[j])
                    else:
                        saved[j].append((self._save(mb, xs[j]) if keep else xs[j], self._rng_state()))
                        xs[j] = self.model.forward_block(block, params, xs[j], ctxs[j])
                self.window.release()
        if keep:
            for j, mb in enumerate(mbs):
                self._saved[mb] = (saved[j], None if grad_hs[j] is None else self._save(mb, grad_hs[j]))
                if self._offload is not None:
                    self._offload.done(mb)
        return xs

    def _kept_forward(self, mb: int, block: int, params, x: torch.Tensor, ctx) -> torch.Tensor:
        """A kept layer's forward with autograd (its router aux term collected here, once), its graph
        kept without its weights until :meth:`backward`; returns its output [B, T, D], detached."""
        graph = KeptBlock(params)
        with torch.enable_grad(), graph.hooks():
            out = self.model.forward_block(block, graph.leaves, graph.input(x), ctx, self._aux_terms)
        self._graphs.setdefault(mb, {})[block] = graph
        return graph.keep(out)

    def _save(self, mb: int, t: torch.Tensor):
        """A tensor the backward needs (a block's input, the head's input gradient): kept on the
        device, or put in host RAM (token ids stay: they are the step's, on the device anyway)."""
        if not t.is_floating_point():
            return t
        self.live.note(t)  # alive until put lets it go, or until its backward
        return t if self._offload is None else self._offload.put(mb, t)

    def _restore(self, mb: int) -> tuple[list, torch.Tensor | None]:
        """Micro-batch ``mb``'s saved (input, RNG state) per block and head input gradient, on the device."""
        saved, grad_h = self._saved.pop(mb)
        if self._offload is None:
            return saved, grad_h
        back = self._offload.take(mb)
        saved = [(back[x.k] if isinstance(x, Offloaded) else x, rng) for x, rng in saved]
        return saved, back[grad_h.k] if isinstance(grad_h, Offloaded) else grad_h

    def take_stats(self) -> dict[str, float]:
        """The step's saved-input figures (``SavedOffload.take_stats``; without offload only the
        device high-water mark, the rest 0), reset for the next step."""
        if self._offload is not None:
            return self._offload.take_stats()
        out = {"act_d2h_bytes": 0, "act_h2d_bytes": 0, "act_stall_s": 0.0, "saved_host_bytes": 0}
        out["saved_peak_bytes"] = self.live.peak_bytes
        self.live.reset_peak()
        return out

    def _head_forward(self, block, params, h, labels, train: bool, loss_scale: float):
        """The head's loss (and, training, its gradients: weights offloaded, input's returned)."""
        head = lambda p, x: self.model.forward_block(block, p, x, None)  # noqa: E731
        loss, grads, grad_h = linear_cross_entropy(
            head, params, h, labels, loss_scale=loss_scale, grads=train
        )
        if train:
            self.window.offload(block, grads)
        return loss, grad_h

    def backward(
        self,
        mb: int,
        grad_out: torch.Tensor | None,
        labels=None,
        loss_scale: float = 1.0,
        position_ids: torch.Tensor | None = None,
        packed: bool = True,
        token_mask: torch.Tensor | None = None,
    ):
        """Backward micro-batch ``mb`` (a wave of one: :meth:`backward_wave`): recompute each block (a
        kept layer: take its kept graph), offload its weight gradients.

        The last stage's head was differentiated in :meth:`forward` (its ``loss_scale``, 1 /
        valid tokens of the whole step, makes the summed gradient that of the token-weighted mean
        loss over all micro-batches); its input's gradient starts the backward here.

        Args:
            grad_out: gradient of the stage output [B, T, D] (None on the last stage).
            labels, loss_scale: unused (the head's loss was taken in forward); kept for callers.
            position_ids, packed, token_mask: the same as in forward.

        Returns:
            gradient of the stage input [B, T, D], or None on the first stage.
        """
        (g,) = self.backward_wave([mb], [grad_out], [position_ids], [packed], [token_mask])
        return g

    def backward_wave(self, mbs: list[int], grad_outs: list, positions: list, packed: list, masks: list):
        """Backward a wave of W micro-batches ``mbs`` layer-major: each block, last first, is acquired
        once, recomputed (or its kept graph taken) and differentiated for every micro-batch of the wave
        in order, each micro-batch's weight gradients offloaded (the window sums them over the wave),
        then released (W = 1: :meth:`backward`).

        Args:
            mbs: the micro-batches; grad_outs: per micro-batch, :meth:`backward`'s ``grad_out``;
            positions, packed, masks: per micro-batch, as :meth:`forward_wave`'s.

        Returns:
            per micro-batch, the gradient of the stage input [B, T, D] (compute dtype, device), or None
            on the first stage.
        """
        w, grads = len(mbs), list(grad_outs)
        saved, ctxs, graphs = [], [None] * w, []
        for j, mb in enumerate(mbs):
            inputs, grad_h = self._restore(mb)
            saved.append(inputs)
            graphs.append(self._graphs.pop(mb, {}))
            if self.is_last:
                grads[j] = grad_h
        for block in reversed(self._recomputed):
            held = [s.pop() for s in saved]  # per micro-batch: (input, RNG state)
            if block in self._rows:
                for (x, _), g in zip(held, grads, strict=True):
                    self._embedding_backward(block, x, g)
                return [None] * w
            params = self.window.acquire(block)
            for j, (x, rng) in enumerate(held):
                if block in graphs[j]:  # kept: its forward's graph, re-bound to the weights loaded now
                    weight_grads, grads[j] = graphs[j].pop(block).backward(params, grads[j])
                    self.window.offload(block, weight_grads)
                    continue
                if ctxs[j] is None and block != 0:
                    ctxs[j] = self.model.context(x, positions[j], packed[j], masks[j])
                grads[j] = self._backward_block(block, params, x, rng, ctxs[j], grads[j])
            self.window.release()
        return grads

    def _backward_block(self, block, params, x, rng, ctx, grad_out):
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        x_in = x.detach().requires_grad_(x.is_floating_point())
        with torch.enable_grad(), _replay_rng(rng):
            out = self.model.forward_block(block, leaves, x_in, ctx, self._aux_terms)
        inputs = list(leaves.values()) + ([x_in] if x_in.requires_grad else [])
        grads = torch.autograd.grad(out, inputs, grad_out)
        self.window.offload(block, dict(zip(leaves, grads[: len(leaves)], strict=True)))
        return grads[len(leaves)] if x_in.requires_grad else None

    def close(self) -> None:
        """Release the activation offload's host buffers (their page-locks on CUDA), if any."""
        if self._offload is not None:
            self._offload.close()

    def take_aux_loss(self) -> torch.Tensor:
        """This stage's share of the step's router ``aux_loss`` (moe.py; fp64 scalar on the device,
        0 without one): the sum of its MoE layers' terms since the last call, each layer and
        micro-batch once: a recomputed layer's from its backward, a kept layer's from its forward."""
        terms, self._aux_terms = self._aux_terms, []
        total = torch.zeros((), dtype=torch.float64, device=self.window.device)
        for t in terms:
            total += t
        return total

    def _gather_embedding(self, block: int, x: EmbeddingRows) -> tuple[torch.Tensor, EmbeddingRows]:
        """Embedding by gathered rows: [B, T, D] compute dtype on the device, and ``x`` (the backward's)."""
        rows = self.window.gather_rows(block, x.index)  # [U, D]
        return F.embedding(x.inverse, rows), x

    def _embedding_backward(self, block: int, used: EmbeddingRows, grad_out: torch.Tensor) -> None:
        """Σ of grad_out [B, T, D] over the positions of each used row (fp32), offloaded as rows;
        the padding row gets none (``nn.Embedding(padding_idx=...)``'s rule)."""
        g = grad_out.flatten(0, 1).float()  # [N, D]
        rows = torch.zeros(len(used.index), g.shape[1], dtype=torch.float32, device=g.device)  # [U, D]
        rows.index_add_(0, used.inverse.flatten(), g)
        if used.padding is not None:
            rows.masked_fill_(used.padding[:, None], 0.0)
        self.window.offload_rows(block, used.index, rows.to(self.dtype))

    def _rng_state(self):
        if not self.model.has_dropout:
            return None
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return torch.get_rng_state(), cuda
