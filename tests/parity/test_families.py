"""Every supported family through nodetrain's own stage code, in one process, in fp32: the loss and
every weight gradient equal plain transformers autograd (1e-5), on one stage and split over two.

Stage level (``StageRunner`` + ``Window`` over a host store, as ``test_sparse_embedding``): the
embedding gathered by rows or dense, each block recomputed in the backward, the chunked head, the
tied embedding's two uses summed across stages. The torchrun parity cases (test_parity.py) add the
pipeline schedule and the optimizer for one dense family and one mixture of experts.

Mixtures of experts: without an auxiliary loss (transformers' default, ``output_router_logits``
False) and with the per-layer one (moe.py), against a reference that adds ``coef / (L_moe · M)``
times transformers' own ``load_balancing_loss_func`` of each layer's logits over M = 2
micro-batches. The pooled form transformers computes is refused; a mutant shows its gradients
are another objective's (so the refusal is not a formality).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
import transformers
from family_configs import AUX_ARCHS, MOE_ARCHS, tiny_config
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from nodetrain.config.constants import SUPPORTED_ARCHS
from nodetrain.config.schema import ModelConfig
from nodetrain.engine.device.window import Window
from nodetrain.engine.linear_ce import IGNORE_INDEX
from nodetrain.engine.stage import StageRunner
from nodetrain.model import HFModel, build_hf_config
from nodetrain.model.families import FAMILIES
from nodetrain.model.moe import RouterAux, switch_aux_loss
from nodetrain.store import HostStore, StoreLayout

B, T = 2, 12
MICROBATCHES = 2
COEF = 0.5  # large, so that the auxiliary term's gradient is far above the tolerance


def _reference(config) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config).float().train()
    with torch.no_grad():  # norms and biases off their 1/0 init, routers off zero
        for name, p in model.named_parameters():
            if p.ndim < 2 or "router" in name or "gate.weight" in name:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():  # DeepSeek-V3: a bias that changes which experts are chosen
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def _bind_constants(model: HFModel, state: dict) -> None:
    for block, constants in enumerate(model.constants):
        for local, (hf_name, _) in constants.items():
            model.set_constant(block, local, state[hf_name])


def _batches():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (MICROBATCHES, B, T), generator=gen)
    labels = torch.randint(0, 64, (MICROBATCHES, B, T), generator=gen)
    labels[torch.rand(labels.shape, generator=gen) < 0.2] = IGNORE_INDEX
    return ids, labels


def _reference_grads(ref, ids, labels, aux: str = "", masks=None) -> tuple[torch.Tensor, dict]:
    """Σ CE (all micro-batches) and the gradients of Σ CE / valid (+ the auxiliary term); the
    per-layer form's aux_loss (its mean over layers and micro-batches) in ``ref.aux_mean``. ``masks``:
    [M, B, T] attention masks (0 on right padding), given to the model and to the auxiliary loss."""
    ref.zero_grad(set_to_none=True)
    scale, total = 1.0 / int((labels != IGNORE_INDEX).sum()), 0.0
    ref.aux_mean = 0.0
    experts, k = ref.config.num_local_experts if aux else 0, getattr(ref.config, "num_experts_per_tok", 0)
    for mb in range(len(ids)):
        mask = None if masks is None else masks[mb]
        out = ref(input_ids=ids[mb], attention_mask=mask, output_router_logits=bool(aux))
        logits, target = out.logits.flatten(0, 1), labels[mb].flatten()
        ce = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
        objective = ce * scale
        if aux == "per_layer":
            per_layer = [load_balancing_loss_func((z,), experts, k, mask) for z in out.router_logits]
            objective = objective + COEF / (len(per_layer) * len(ids)) * sum(per_layer)
            ref.aux_mean += float(sum(per_layer).detach()) / (len(per_layer) * len(ids))
        elif aux == "pooled":  # transformers' own: all layers of the forward pooled
            objective = objective + COEF / len(ids) * load_balancing_loss_func(out.router_logits, experts, k)
        objective.backward()
        total += ce.detach()
    return total, {n: p.grad.clone() for n, p in ref.named_parameters()}


def _store(model: HFModel, state: dict, shm_dir, name: str) -> HostStore:
    layout = StoreLayout(tuple(u.numel for u in model.units), torch.float32, (0,) if model.tied else ())
    store = HostStore.create(layout, shm_dir, name)
    store.unlink()
    for u in model.units:
        for p in u.params:
            store.master(u.index)[p.offset : p.offset + p.numel].copy_(state[p.hf_name].reshape(-1))
        store.compute(u.index).copy_(store.master(u.index))
    return store


def _stage_grads(model: HFModel, store: HostStore, cuts: list[int], ids, labels, rows: bool, masks=None):
    """Σ CE, every unit's gradient and Σ of the stages' aux_loss shares, split into stages at ``cuts``
    (``masks``: [M, B, T] bool, False on padding, as the engine passes ``token_mask``)."""
    edges = [0, *cuts, len(model.units)]
    ranges = [range(a, b) for a, b in itertools.pairwise(edges)]
    windows = [
        Window(store, model.bindings, r, 1, "cpu", owned_units=r, rows=[0] if rows and 0 in r else [])
        for r in ranges
    ]
    scale, total = 1.0 / int((labels != IGNORE_INDEX).sum()), 0.0
    try:
        runners = [StageRunner(model, r, w, torch.float32) for r, w in zip(ranges, windows, strict=True)]
        for runner, w in zip(runners, windows, strict=True):
            w.begin((runner.loads("F") + runner.loads("B")) * len(ids))
        for mb in range(len(ids)):
            x, mask = ids[mb], None if masks is None else masks[mb]
            for runner in runners:
                x = runner.forward(
                    mb, x, labels[mb] if runner.is_last else None, True, None, scale, True, mask
                )
            total += x
            grad = None
            for runner in reversed(runners):
                grad = runner.backward(mb, grad, token_mask=mask)
        for w in windows:
            w.flush()
        aux = sum(float(r.take_aux_loss()) for r in runners)
    finally:
        for w in windows:
            w.close()
    grads = {}
    for u in model.units:
        g = store.grad(u.index)
        if u.index == 0 and len(ranges) > 1 and model.tied:  # the head's use, on the last stage
            g = g + store.buffer(0, "grad_tied")
        grads.update({p.hf_name: g[p.offset : p.offset + p.numel].view(p.shape) for p in u.params})
    return total, grads, aux


def _check(arch: str, shm_dir, cuts: list[int], rows: bool, aux: str = "", padded: bool = False) -> None:
    config = tiny_config(arch)
    ref = _reference(config)
    ids, labels = _batches()
    masks = _padding(labels) if padded else None
    want_loss, want = _reference_grads(ref, ids, labels, aux, masks)
    router_aux = RouterAux(COEF, config.num_experts_per_tok, MICROBATCHES) if aux else None
    model = HFModel(config, router_aux)
    _bind_constants(model, ref.state_dict())
    store = _store(model, ref.state_dict(), shm_dir, f"fam-{arch}-{len(cuts)}-{rows}-{aux}-{padded}")
    loss, got, got_aux = _stage_grads(
        model, store, cuts, ids, labels, rows, None if masks is None else masks.bool()
    )
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_aux, ref.aux_mean, rtol=1e-5, atol=0)  # 0 without the aux loss
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


STAGINGS = {"1stage-rows": ([], True), "2stage-dense": ([2], False)}
OLD = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}  # test_parity's
NEW = sorted(set(SUPPORTED_ARCHS) - OLD)


@pytest.mark.parametrize("staging", STAGINGS)
@pytest.mark.parametrize("arch", NEW)
def test_stages_give_transformers_loss_and_gradients(arch: str, staging: str, shm_dir) -> None:
    """No auxiliary loss (every MoE config's default): the cross-entropy's loss and gradients."""
    cuts, rows = STAGINGS[staging]
    _check(arch, shm_dir, cuts, rows)


@pytest.mark.parametrize("arch", AUX_ARCHS)
def test_per_layer_aux_loss_gradients(arch: str, shm_dir) -> None:
    """The per-layer auxiliary loss over two micro-batches and two stages (cut inside the MoE layers)."""
    _check(arch, shm_dir, [3], rows=True, aux="per_layer")


def test_switch_aux_loss_is_transformers_on_one_layer() -> None:
    logits = torch.randn(40, 6, generator=torch.Generator().manual_seed(5))
    for k in (1, 2):
        torch.testing.assert_close(switch_aux_loss(logits, k), load_balancing_loss_func((logits,), 6, k))


def _padding(labels: torch.Tensor) -> torch.Tensor:
    """[M, B, T] int64 attention masks of right-padded rows: row b of micro-batch m keeps its first
    T - 1 - (m + b) % 4 tokens (0 to 3 pads), the pads' labels set to -100 in place, as packing does."""
    m, b, t = labels.shape
    keep = t - 1 - (torch.arange(m)[:, None] + torch.arange(b)[None, :]) % 4  # [M, B]
    mask = (torch.arange(t)[None, None, :] < keep[..., None]).long()
    labels[mask == 0] = IGNORE_INDEX
    return mask


def test_switch_aux_loss_leaves_padding_out_as_transformers_attention_mask() -> None:
    """Issue 32, item 4: with right padding, the value and its gradient are transformers'
    ``load_balancing_loss_func`` with the ``attention_mask`` (PR #28517), not those of every token."""
    gen = torch.Generator().manual_seed(6)
    mask = (torch.arange(16)[None, :] < torch.tensor([[13], [16], [9]])).long()  # [B=3, T=16]
    for k in (1, 2):
        logits = torch.randn(48, 6, generator=gen, requires_grad=True)
        got = switch_aux_loss(logits, k, mask.reshape(-1).bool())
        (g_got,) = torch.autograd.grad(got, logits)
        want = load_balancing_loss_func((logits,), 6, k, mask)
        (g_want,) = torch.autograd.grad(want, logits)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-9)
        assert (g_got[mask.reshape(-1) == 0] == 0).all(), "padding's router logits get no gradient"
        unmasked = load_balancing_loss_func((logits,), 6, k)
        assert abs(float((unmasked - want).detach())) > 1e-3, "the mask matters here"


@pytest.mark.parametrize("arch", AUX_ARCHS)
def test_per_layer_aux_loss_leaves_padding_out(arch: str, shm_dir) -> None:
    """Right-padded rows (``data.packing=false``) through two stages: the loss, the auxiliary loss
    and every gradient are transformers' with the rows' ``attention_mask``."""
    _check(arch, shm_dir, [3], rows=True, aux="per_layer", padded=True)


def test_pooled_aux_loss_is_another_objective() -> None:
    """Mutant: transformers' pooled form (all layers of a forward) gives other router gradients than
    the per-layer form nodetrain computes, so computing one where the other is claimed is caught."""
    config = tiny_config("Qwen3MoeForCausalLM")
    ref = _reference(config)
    ids, labels = _batches()
    _, per_layer = _reference_grads(ref, ids, labels, "per_layer")
    _, pooled = _reference_grads(ref, ids, labels, "pooled")
    router = "model.layers.1.mlp.gate.weight"
    assert (per_layer[router] - pooled[router]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", AUX_ARCHS)
def test_aux_loss_is_off_by_default_and_pooled_refused(arch: str) -> None:
    hf = dict(tiny_config(arch).to_diff_dict())
    hf.pop("architectures", None), hf.pop("model_type", None)
    assert HFModel(build_hf_config(ModelConfig(name="m", arch=arch, hf=hf))).router_aux is None
    with pytest.raises(ValueError, match="pooled load_balancing_loss_func"):
        build_hf_config(ModelConfig(name="m", arch=arch, hf={**hf, "output_router_logits": True}))
    off = ModelConfig(name="m", arch=arch, hf={**hf, "output_router_logits": True}, router_aux_loss="off")
    assert build_hf_config(off).output_router_logits


def test_every_supported_arch_has_a_family() -> None:
    assert set(FAMILIES) == set(SUPPORTED_ARCHS)


@pytest.mark.parametrize(
    ("arch", "fields", "reason"),
    [
        ("DeepseekV3ForCausalLM", {}, "no auxiliary loss for this family"),
        ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "encoder's attention"),
        ("MixtralForCausalLM", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("LlamaForCausalLM", {}, "per_layer: the model has no experts"),
    ],
)
def test_refused_by_name(arch: str, fields: dict, reason: str) -> None:
    aux = "per_layer" if not fields else "auto"
    with pytest.raises(ValueError, match=reason):
        cfg = ModelConfig(name="m", arch=arch, hf={"hidden_size": 32, **fields}, router_aux_loss=aux)
        build_hf_config(cfg)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_block_cost_counts_active_experts(arch: str) -> None:
    """FLOPs (MFU) count the parameters a token multiplies: k of the E experts, every other one."""
    config = tiny_config(arch)
    model = HFModel(config)
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    for i in range(1, len(model.units) - 1):
        layer = dict(
            getattr(transformers, config.architectures[0])(config).model.layers[i - 1].named_parameters()
        )
        expert = sum(p.numel() for n, p in layer.items() if ".experts." in f".{n}")
        dense = sum(p.numel() for p in layer.values()) - expert
        assert model.block_cost(i) == dense + expert * config.num_experts_per_tok // experts, i


def test_deepseek_router_bias_is_a_constant_that_chooses_experts(shm_dir) -> None:
    """DeepSeek-V3's ``e_score_correction_bias`` is a buffer in transformers (no gradient, never
    updated): no unit holds it (so AdamW, clipping and weight decay cannot touch it), and it is bound
    to every call: without it the stage code's loss is another model's."""
    config = tiny_config("DeepseekV3ForCausalLM")
    model = HFModel(config)
    held = {p.hf_name for u in model.units for p in u.params}
    names = {hf for c in model.constants for hf, _ in c.values()}
    assert names == {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)}
    assert not names & held
    ref = _reference(config)
    ids, labels = _batches()
    _, want = _reference_grads(ref, ids, labels)
    store = _store(model, ref.state_dict(), shm_dir, "fam-bias")  # constants left at zero
    _, got, _ = _stage_grads(model, store, [], ids, labels, rows=False)
    name = "model.layers.1.mlp.experts.gate_up_proj"  # other experts chosen: other experts' gradients
    assert (got[name] - want[name]).abs().max() > 100 * 1e-6  # 100 × the comparisons' tolerance


@pytest.mark.parametrize("form", ["per_layer", "auto"])
def test_logged_loss_is_transformers_outputs_loss(form: str, tmp_path, shm_dir, one_rank_world) -> None:
    """What a step reports (``StepResult``, the metrics row) against transformers' own model: with the
    auxiliary loss on, ``loss`` is its ``outputs.loss`` (the cross-entropy plus
    ``router_aux_loss_coef · aux_loss``) and ``aux_loss`` its ``outputs.aux_loss``; off (``auto``,
    the config's default), ``loss`` is the cross-entropy and the row has no ``aux_loss``. One MoE
    layer and one micro-batch, where transformers' pooled form and the per-layer one are equal."""
    from bench._engine import base_config
    from nodetrain.checkpoint import load_hf_weights
    from nodetrain.config.batch import BatchShape
    from nodetrain.engine.startup import build_engine
    from nodetrain.model import router_aux_of
    from nodetrain.run.faults import BadSteps
    from nodetrain.train import _record

    config = tiny_config("Qwen3MoeForCausalLM", num_hidden_layers=2, router_aux_loss_coef=COEF)
    ref = _reference(config)
    ref.save_pretrained(tmp_path)
    hf = {k: v for k, v in config.to_diff_dict().items() if k not in ("architectures", "model_type")}
    cfg = base_config(
        ModelConfig(name="aux", arch="Qwen3MoeForCausalLM", hf=hf, router_aux_loss=form),
        train={"seq_len": T, "micro_batch_size": B, "steps": 1, "dtype": "float32"},
        pipeline={"microbatches": 1},
        data={"vocab_size": 64},
        store={"dir": str(shm_dir)},
    )
    hf_config = build_hf_config(cfg.model)
    model = HFModel(hf_config, router_aux_of(cfg, hf_config, BatchShape.of(cfg).global_microbatches))
    assert (model.router_aux is None) == (form == "auto")
    ids, labels = (t[:1] for t in _batches())  # [1, B, T]
    labels[..., -1] = IGNORE_INDEX  # transformers' labels are the inputs, shifted inside: none for the last

    def init_from(store, units):
        load_hf_weights(tmp_path, store, units, model)

    engine = build_engine(
        cfg,
        model,
        rank=0,
        world_size=1,
        local_rank=0,
        run_id=f"aux-{form}",
        device=torch.device("cpu"),
        init_from=init_from,
    )
    try:
        r = engine.train_step(0, ids, labels)
    finally:
        engine.close()
    hf_labels = torch.cat([torch.full((B, 1), IGNORE_INDEX), labels[0, :, :-1]], dim=1)
    with torch.no_grad():
        want = ref(input_ids=ids[0], labels=hf_labels, output_router_logits=form == "per_layer")
    row = _record(0, r, BadSteps(1))
    torch.testing.assert_close(r.loss, want.loss.item(), rtol=1e-5, atol=0)
    assert row["loss"] == r.loss
    if form == "auto":
        assert r.aux_loss is None and "aux_loss" not in row
        return
    torch.testing.assert_close(r.aux_loss, want.aux_loss.item(), rtol=1e-5, atol=0)
    assert row["aux_loss"] == r.aux_loss
    assert COEF * r.aux_loss > 1e-3 * r.loss  # the term is far above the tolerance
