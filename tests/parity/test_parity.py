"""Exact arithmetic (DESIGN invariant 2): nodetrain in fp32 matches plain transformers + AdamW.

Each case saves a seeded tiny HF model (``save_pretrained``, fp32), launches nodetrain on it with
torchrun (``parity_worker.py``, gloo, one stage per rank) over five steps of padded,
variable-length micro-batches, and replays the same tokens in this process through a reference
written here from scratch: the ``transformers`` model loaded from the same directory, one forward
over the whole step's batch with the attention mask, loss = Σ token cross-entropy / valid tokens,
``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW`` with two groups (ndim ≥ 2 decay, the
rest not) and the warmup + cosine schedule written out below. Per-step loss, pre-clip gradient
norm and learning rate, and every final master weight must agree to 1e-5 relative.

The nine launches cover every value of the acceptance matrix without the cross product: stages
1/2/4, gpipe/1f1b, window slots 1/2, grad_accum 2 × 4 micro-batches (and other splits, some with
fewer micro-batches than stages), clipping that bites (and none), tied embeddings across stages,
a slow copy worker (a missing wait would read stale weights), and the Llama, Qwen3 (q/k norms),
Qwen2 (q/k/v biases) and Mistral (sliding window shorter than the sequence) architectures.
A 1f1b step runs grad_accum × M micro-batches as one pipeline round (one case does it with
in-backward updates, whose per-unit offload counts must follow), and a block used twice in a row
loads once: each stage's H2D bytes per step must equal that closed form (``_step_h2d_numel``).
All but one (``-sync``) run with the optimizer overlapped (the default, ``optim.overlap``). Two
more cover the overlap and residency: a slowed optimizer thread (20 ms per unit; a load that did
not wait for its unit's update would read stale weights) with units resident on the device, once
updating during the backward (no clipping, the tied embedding bound by two blocks of one stage)
and once after the all-reduce (clipping, the tied embedding shared across stages).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from conftest import run_torchrun
from safetensors.torch import load_file, save_file

from nodetrain.config.constants import SUPPORTED_ARCHS
from nodetrain.core.schedule import build_schedule, step_rounds

WORKER = Path(__file__).resolve().parents[1] / "parity_worker.py"
IGNORE = -100

SEQ_LEN, MICRO_BATCH, STEPS = 16, 2, 5
VOCAB = 256
# eps = 1e-4 rather than 1e-8: Adam's update g / (|g| + eps) turns an absolute gradient error δg
# into a weight error of up to lr·δg/eps, so with eps = 1e-8 the few elements whose gradient is
# near zero amplify fp32 summation-order noise to O(lr). Measured on the first case: two correct
# plain-PyTorch references (one batch vs 8 accumulated micro-batches) end 4.4e-4 apart with
# eps = 1e-8, 1.5e-5 with 1e-6 and 3.7e-7 with 1e-4. Gradients here are ~1e-3, so Adam still
# normalises almost every element; the engine runs with the same eps.
OPTIM = {
    "lr": 1e-2,
    "min_lr": 1e-3,
    "warmup_steps": 2,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-4,
}
HF_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
}

RTOL = 1e-5
# Losses, gradient norms: O(1) numbers, rtol alone. Weights: matrices are ~N(0, 0.02) and elements
# that pass near zero have no relative scale, so they need an absolute floor. With the eps above,
# summation-order noise leaves ≤ 4e-7 (measured, see above); 1e-6 is 1e-4 × lr, one part in 10^4
# of a single step's update, while a stale weight, a lost micro-batch, a skipped clip or a decayed
# norm/bias moves elements by ≥ 1e-4 (the mutant checks below measure it).
ATOL_WEIGHT = 1e-6


@dataclass(frozen=True)
class Case:
    id: str
    arch: str
    stages: int
    schedule: str
    slots: int
    grad_accum: int
    microbatches: int
    max_grad_norm: float = 0.3
    """Small enough that every step clips (asserted on the reference), or 0 = no clipping."""
    tied: bool = False
    delay_s: float = 0.0
    overlap: bool = True
    optim_delay_s: float = 0.0
    """Test-only sleep of the optimizer thread before each unit's update."""
    device_budget: int = 0
    """Device bytes for resident units, weights and fp32 gradient accumulator (fp32 here: 8 B per
    parameter, an embedding or head 131,072/131,584, a layer 295,936); the last stage's head first."""
    resident: tuple[str, ...] = ()
    """Units expected resident under ``device_budget`` (all stages)."""
    on_device: tuple[str, ...] = ()
    """Resident units expected to keep their optimizer on the device (``optim.on_device=true`` if any)."""
    grad_acc: tuple[str, ...] = ()
    """Streamed units expected to accumulate their gradient on the device (``stream.grad_on_device=true``
    if any)."""
    hf: dict = field(default_factory=dict)
    mutants: tuple[str, ...] = ()
    """Reference variants the engine must NOT match (shows the comparison can fail)."""
    router_aux_loss: str = ""
    """``model.router_aux_loss`` (mixtures of experts; "" = the default)."""
    steps: int = STEPS
    atol_weight: float = ATOL_WEIGHT
    """Absolute floor of the final weights' comparison (longer runs: more summation-order noise)."""
    accum_chunk: int = 0
    """Test-only: elements per thread of a host add's chunk (``Faults.accum_chunk_per_thread``; 0 = the
    default): small, the tiny model's adds are shared with the idle optimizer thread."""


# fmt: off
CASES = [
    #    id                                                 arch                  S  schedule  slots accum M
    Case("llama-1stage-gpipe-slots1-accum2x4",              "LlamaForCausalLM",   1, "gpipe", 1,    2,    4,
         mutants=("no_clip",)),
    # 64-element chunks: the D2H worker's adds are shared with the idle optimizer thread (helper.py),
    # deferred (clipping) and between the in-backward updates (no clipping)
    Case("llama-1stage-1f1b-slots2-accum2x4-sharedadds",    "LlamaForCausalLM",   1, "1f1b",  2,    2,    4,
         accum_chunk=64),
    Case("llama-1stage-1f1b-slots2-accum2x4-sharedadds-noclip",
                                                            "LlamaForCausalLM",   1, "1f1b",  2,    2,    4,
         max_grad_norm=0.0, accum_chunk=64),
    Case("llama-2stage-1f1b-slots2-accum2x4-sync",          "LlamaForCausalLM",   2, "1f1b",  2,    2,    4,
         overlap=False),
    Case("llama-4stage-1f1b-slots1-accum2x4",               "LlamaForCausalLM",   4, "1f1b",  1,    2,    4),
    Case("llama-4stage-gpipe-slots2-accum3x2-delay3ms",     "LlamaForCausalLM",   4, "gpipe", 2,    3,    2,
         delay_s=0.003),
    Case("llama-2stage-tied-gpipe-slots1-accum2x4",         "LlamaForCausalLM",   2, "gpipe", 1,    2,    4,
         tied=True, mutants=("untied_grad",)),
    Case("qwen3-2stage-tied-1f1b-slots1-accum1x8-delay3ms", "Qwen3ForCausalLM",   2, "1f1b",  1,    1,    8,
         tied=True, delay_s=0.003, hf={"head_dim": 16}),
    Case("qwen2-2stage-gpipe-slots2-accum2x4-noclip",       "Qwen2ForCausalLM",   2, "gpipe", 2,    2,    4,
         max_grad_norm=0.0, mutants=("decay_biases",)),
    Case("mistral-4stage-1f1b-slots2-accum3x2-window8",     "MistralForCausalLM", 4, "1f1b",  2,    3,    2,
         hf={"sliding_window": 8}),
    # 1f1b runs grad_accum × M = 6 micro-batches as one round, updating each unit in the backward
    Case("llama-2stage-1f1b-slots1-accum3x2-noclip",         "LlamaForCausalLM",   2, "1f1b",  1,    3,    2,
         max_grad_norm=0.0),
    # resident: the tied head first, then embed and layers.0 (equal savings per byte: block order);
    # layers 1-3 stream. The embedding and the head accumulate into one range (unit 0's grad).
    Case("llama-1stage-tied-gpipe-slots2-accum2x4-noclip-resident-optdelay",
                                                            "LlamaForCausalLM",   1, "gpipe", 2,    2,    4,
         max_grad_norm=0.0, tied=True, optim_delay_s=0.02, device_budget=558_592,
         resident=("embed", "layers.0", "head"), mutants=("untied_grad",)),
    # resident: embed on stage 0; on stage 1 the tied head (binding stage 0's embedding: its device
    # accumulator lands in grad_tied), whose 2 slots stream layers.2 and layers.3
    Case("llama-2stage-tied-1f1b-slots2-accum2x4-resident-optdelay",
                                                            "LlamaForCausalLM",   2, "1f1b",  2,    2,    4,
         tied=True, optim_delay_s=0.02, device_budget=295_936, resident=("embed", "head")),
]
# fmt: on


# ----------------------------------------------------------------------------- reference


def lr_schedule(step: int, total_steps: int) -> float:
    """Linear warmup to lr over ``warmup_steps`` updates (the first update already at lr/warmup),
    then half a cosine from lr down to min_lr, reached at update ``total_steps``."""
    lr, min_lr, warmup = OPTIM["lr"], OPTIM["min_lr"], OPTIM["warmup_steps"]
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    decay_steps = max(total_steps - warmup, 1)
    t = min((step - warmup) / decay_steps, 1.0)
    return min_lr + (lr - min_lr) * (math.cos(math.pi * t) + 1) / 2


def hf_fields(case: Case) -> dict:
    return {**HF_BASE, **case.hf, "tie_word_embeddings": case.tied}


def save_seeded_model(case: Case, model_dir: Path) -> None:
    """A seeded random model, fp32, with norms and biases moved off their 1/0 init so that decaying
    them (or not) shows in the weights."""
    config = transformers.AutoConfig.for_model(SUPPORTED_ARCHS[case.arch], **hf_fields(case))
    torch.manual_seed(zlib.crc32(case.id.encode()))
    model = getattr(transformers, case.arch)(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim < 2:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: it changes the experts chosen
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(model_dir)
    # the run's tokenizer (data.tokenizer): VOCAB ids, so data.vocab_size need not be a trained BPE's >= 257
    words = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")
    )
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(model_dir)


def make_batches(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs, labels [steps, N, B, T] int64 and lengths [steps, N, B]: right-padded sequences of
    random length; labels are -100 past the length and at a few random places inside it."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 1)
    n = case.grad_accum * case.microbatches
    shape = (case.steps, n, MICRO_BATCH, SEQ_LEN)
    inputs = torch.randint(0, VOCAB, shape, generator=gen)
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    lengths = torch.randint(2, SEQ_LEN + 1, shape[:-1], generator=gen)
    pad = torch.arange(SEQ_LEN) >= lengths[..., None]
    inputs[pad] = 0
    labels[pad] = IGNORE
    labels[torch.rand(shape, generator=gen) < 0.1] = IGNORE
    return inputs, labels, lengths


@dataclass
class Reference:
    losses: list[float]
    norms: list[float]
    lrs: list[float]
    tokens: list[int]
    weights: dict[str, torch.Tensor]
    tied_ok: bool
    aux_losses: list[float] = field(default_factory=list)
    """With ``router_aux_loss``: each step's auxiliary loss without its coefficient."""


def run_reference(
    case: Case, model_dir: Path, inputs, labels, lengths, variant: str = "", device: str = "cpu"
) -> Reference:
    """Plain transformers + torch.optim.AdamW on the same tokens, on ``device`` (weights returned on
    the CPU). ``variant`` injects one mistake, or is ``per_microbatch``: a correct reference with
    another summation order (a forward and backward per micro-batch, as the engine runs them,
    instead of one over the step's batch)."""
    model = getattr(transformers, case.arch).from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    named = list(model.named_parameters())  # a tied lm_head appears once, as the embedding
    # matrices decay; norms and biases (also an expert's 2-D ``*_bias``) do not
    decay = {
        n
        for n, p in named
        if (p.ndim >= 2 and not n.endswith("bias")) or (variant == "decay_biases" and n.endswith(".bias"))
    }
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": OPTIM["weight_decay"]},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=(OPTIM["beta1"], OPTIM["beta2"]), eps=OPTIM["eps"])
    max_norm = case.max_grad_norm if case.max_grad_norm > 0 and variant != "no_clip" else math.inf
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    out = Reference([], [], [], [], {}, tied_ok=embed is head.weight)
    if variant == "untied_grad":  # the lm_head use's gradient never reaches the tied embedding
        assert out.tied_ok
        del head.weight
    inputs, labels, lengths = inputs.to(device), labels.to(device), lengths.to(device)
    for step in range(case.steps):
        mask = (torch.arange(SEQ_LEN, device=device) < lengths[step][..., None]).long()  # [N, B, T]
        if variant == "untied_grad":
            head.weight = embed.detach()
        valid = int((labels[step] != IGNORE).sum())
        opt.zero_grad(set_to_none=True)
        if case.router_aux_loss:
            loss, aux = _backward_with_aux(model, case, inputs[step], labels[step], valid, variant)
            out.aux_losses.append(aux.item())
        else:
            parts = (
                zip(inputs[step], labels[step], mask, strict=True)
                if variant == "per_microbatch"
                else [(inputs[step].flatten(0, 1), labels[step].flatten(0, 1), mask.flatten(0, 1))]
            )
            loss = 0.0
            for ids, lab, m in parts:  # [rows, T] each: the step's N·B rows, or one micro-batch's B
                logits = model(input_ids=ids, attention_mask=m).logits  # [rows, T, V]
                part = F.cross_entropy(
                    logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="sum"
                )
                (part / valid).backward()
                loss = loss + part.detach() / valid
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        lr = lr_schedule(step, case.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        out.losses.append(loss.item())
        out.norms.append(norm.item())
        out.lrs.append(lr)
        out.tokens.append(valid)
    out.weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return out


def _backward_with_aux(model, case: Case, inputs, labels, valid: int, variant: str):
    """One step's backward with the per-layer router auxiliary loss (nodetrain/model/moe.py): a
    forward per micro-batch (inputs, labels [N, B, T]) without a padding mask (the engine has none:
    right padding changes no valid token's logits, and every token counts in the routers' loss),
    the token-mean cross-entropy plus ``coef / (L_moe · N) × Σ_mb Σ_l`` transformers'
    ``load_balancing_loss_func`` of layer l's logits. ``pooled_aux``: transformers' own form (all
    layers of a forward at once). Returns the step's objective, the cross-entropy plus
    ``coef · aux`` (what the engine reports as the loss, as transformers' ``outputs.loss``), and
    ``aux`` (the engine's ``aux_loss``, as transformers' ``outputs.aux_loss``)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    c, ce_total, aux_total = model.config, 0.0, 0.0
    experts, k = c.num_local_experts, c.num_experts_per_tok
    for ids, lab in zip(inputs, labels, strict=True):
        out = model(input_ids=ids, output_router_logits=True)
        ce = (
            F.cross_entropy(out.logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE, reduction="sum")
            / valid
        )
        layers = out.router_logits
        if variant == "pooled_aux":
            aux = load_balancing_loss_func(layers, experts, k) / len(inputs)
        else:
            aux = sum(load_balancing_loss_func((z,), experts, k) for z in layers) / (
                len(layers) * len(inputs)
            )
        (ce + c.router_aux_loss_coef * aux).backward()
        ce_total, aux_total = ce_total + ce.detach(), aux_total + aux.detach()
    return ce_total + c.router_aux_loss_coef * aux_total, aux_total


# ----------------------------------------------------------------------------- nodetrain run


@dataclass
class Run:
    steps: list[dict]
    weights: dict[str, torch.Tensor]
    units: list[list[str]]
    """Unit names owned by each rank, in rank order."""
    resident: list[str]
    """Resident units of all ranks, in rank order."""


def run_nodetrain(
    case: Case,
    tmp: Path,
    shm_dir: Path,
    model_dir: Path,
    inputs,
    labels,
    torchrun,
    device: str = "cpu",
    overrides: dict | None = None,
) -> Run:
    spec_file = write_spec(case, tmp, shm_dir, model_dir, inputs, labels, overrides, device=device)
    torchrun(case.stages, WORKER, str(spec_file), timeout_s=150)
    return read_run(case, tmp / "out")


def launch_cases(cases: list[Case], root: Path, overrides: dict[str, dict] | None = None) -> dict:
    """One torchrun launch of every case in ``cases`` (one stage count: as many ranks), each with its
    seeded model and batches under ``root/<id>`` and ``overrides[id]`` (config keys) over its spec's.

    Returns:
        per case id ``(run, its ranks' reports, model_dir, inputs, labels, lengths)``.

    Raises:
        AssertionError: a file left in the store directory after the launch.
    """
    shm = Path(tempfile.mkdtemp(prefix="nt-test-", dir="/dev/shm"))
    prepared, specs = {}, []
    for case in cases:
        tmp = root / case.id
        save_seeded_model(case, tmp / "hf")
        inputs, labels, lengths = make_batches(case)
        more = (overrides or {}).get(case.id, {})
        specs.append(str(write_spec(case, tmp, shm, tmp / "hf", inputs, labels, overrides=more)))
        prepared[case.id] = (tmp, inputs, labels, lengths)
    launch_specs(cases[0].stages, specs, shm, timeout_s=120 + 60 * len(cases))
    out = {}
    for case in cases:
        tmp, *rest = prepared[case.id]
        reports = [json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in range(case.stages)]
        out[case.id] = (read_run(case, tmp / "out"), reports, tmp / "hf", *rest)
    return out


RUN_MARKER = "parity_worker: run "
"""What rank 0 of parity_worker.py prints before each run of a launch, followed by its ``run_id``."""


def launch_specs(nproc: int, specs: list, shm: Path, timeout_s: float) -> str:
    """One torchrun launch of ``nproc`` ranks running the ``specs`` (files) one after another, their
    host stores in the /dev/shm directory ``shm`` (removed afterwards); returns the launch's output.

    Raises:
        AssertionError: a file left in ``shm`` after the launch.
    """
    try:
        output = run_torchrun(nproc, WORKER, *map(str, specs), timeout_s=timeout_s)
        left = sorted(p.name for p in shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert not left, f"files left in the store directory: {left}"
    return output


def run_output(output: str, run_id: str) -> str:
    """The part of a launch's ``output`` that its run ``run_id`` printed: from rank 0's line naming it
    (parity_worker.py's ``RUN_MARKER``, between two barriers) to the next run's line."""
    start = output.index(f"{RUN_MARKER}{run_id}\n")
    end = output.find(RUN_MARKER, start + len(RUN_MARKER))
    return output[start : end if end >= 0 else len(output)]


def write_spec(
    case: Case, tmp: Path, shm_dir: Path, model_dir: Path, inputs, labels, overrides=None, **extra
) -> Path:
    """parity_spec's spec written to ``tmp/spec.json`` (its output directory ``tmp/out`` made), with
    ``overrides`` (config keys) over the case's."""
    spec = parity_spec(case, tmp, shm_dir, model_dir, inputs, labels, **extra)
    spec["overrides"].update(overrides or {})
    Path(spec["out_dir"]).mkdir()
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(spec))
    return spec_file


def parity_spec(case: Case, tmp: Path, shm_dir: Path, model_dir: Path, inputs, labels, **extra) -> dict:
    """parity_worker.py's spec of ``case`` (its batch file written under ``tmp``, output in ``tmp/out``);
    ``extra`` goes into the spec as is (``device``, ``variants``, ``export_grads``, ``export_fields``)."""
    batch_file, out_dir = tmp / "batch.safetensors", tmp / "out"
    save_file({"inputs": inputs, "labels": labels}, str(batch_file))
    overrides = {
        "train.dtype": "float32",
        "train.seq_len": SEQ_LEN,
        "train.micro_batch_size": MICRO_BATCH,
        "train.steps": case.steps,
        "train.grad_accum": case.grad_accum,
        "data.vocab_size": VOCAB,
        "data.tokenizer": str(model_dir),
        "pipeline.stages": case.stages,
        "pipeline.schedule": case.schedule,
        "pipeline.microbatches": case.microbatches,
        "stream.slots": case.slots,
        "stream.device_budget": case.device_budget,
        "optim.overlap": case.overlap,
        "optim.max_grad_norm": case.max_grad_norm,
        "store.dir": str(shm_dir),
        **{f"optim.{k}": v for k, v in OPTIM.items()},
        **({"model.router_aux_loss": case.router_aux_loss} if case.router_aux_loss else {}),
        "optim.on_device": bool(case.on_device),  # the placement the case names, not auto's
        "stream.grad_on_device": bool(case.grad_acc),
    }
    spec = {
        "arch": case.arch,
        "hf": hf_fields(case),
        "overrides": overrides,
        "faults": {
            "copy_delay_s": case.delay_s,
            "optim_delay_s": case.optim_delay_s,
            "accum_chunk_per_thread": case.accum_chunk,
        },
        "model_dir": str(model_dir),
        "batch_file": str(batch_file),
        "out_dir": str(out_dir),
        "run_id": f"parity-{case.id}",
        "device": "cpu",
        **extra,
    }
    return spec


def read_run(case: Case, out_dir: Path) -> Run:
    """What parity_worker.py wrote under ``out_dir`` for ``case``."""
    weights, units, resident = {}, [], []
    for rank in range(case.stages):
        part = load_file(str(out_dir / f"weights_rank{rank}.safetensors"))
        assert not set(part) & set(weights), f"rank {rank} exports weights another rank owns"
        weights.update(part)
        report = json.loads((out_dir / f"rank{rank}.json").read_text())
        units.append(report["units"])
        resident += report["resident"]
    return Run(json.loads((out_dir / "steps.json").read_text()), weights, units, resident)


def _sliding_window_matters(case: Case, model_dir: Path, ids: torch.Tensor) -> bool:
    """The reference's logits change when the window is removed, i.e. the case exercises it."""
    model = getattr(transformers, case.arch).from_pretrained(model_dir, dtype=torch.float32)
    assert case.hf["sliding_window"] < SEQ_LEN == ids.shape[-1]
    with torch.no_grad():
        windowed = model(input_ids=ids).logits
        model.config.sliding_window = None
        full = model(input_ids=ids).logits
    return not torch.allclose(windowed, full, rtol=1e-3, atol=1e-3)


def _block_numels(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Elements each block loads, from the HF state dict (a tied head loads the embedding too)."""
    out: dict[str, int] = {}
    for name, p in state.items():
        if name.startswith("model.layers."):
            key = "layers." + name.split(".")[2]
        else:
            key = "embed" if name.startswith("model.embed_tokens") else "head"
        out[key] = out.get(key, 0) + p.numel()
    return out


def _step_h2d_numel(case: Case, stage: int, names: list[str], numel: dict[str, int], rows: int) -> int:
    """Closed form of one step's H2D elements of a stage (no residency): the stage's load sequence
    over the step's schedule (1f1b: ONE round of G·M micro-batches; gpipe: G rounds of M), a forward
    loading every block but the embedding, a backward every block but the embedding and the last
    stage's head (its gradients are taken in its forward), in reverse; a use right after a use of the
    same block shares its load (window.py). The embedding moves only ``rows`` (the step's distinct
    ids × hidden, summed over micro-batches). G rounds of 1f1b would reuse fewer."""
    rounds, per_round = step_rounds(case.schedule, case.grad_accum, case.microbatches)
    actions = build_schedule(case.schedule, case.stages, stage, per_round) * rounds
    fwd = [n for n in names if n != "embed"]
    bwd = [n for n in fwd if not (stage == case.stages - 1 and n == "head")][::-1]
    seq = [n for a in actions for n in (fwd if a.kind == "F" else bwd)]
    loaded = [n for k, n in enumerate(seq) if k == 0 or seq[k - 1] != n]
    return sum(numel[n] for n in loaded) + (rows if "embed" in names else 0)


def unit_of(hf_name: str) -> str:
    """The nodetrain unit an HF tensor belongs to (embed, layers.<i>, head = final norm + lm_head)."""
    if hf_name.startswith("model.layers."):
        return "layers." + hf_name.split(".")[2]
    return "embed" if hf_name.startswith("model.embed_tokens.") else "head"


def check_d2h_bytes(case: Case, run: Run, weights: dict[str, torch.Tensor]) -> None:
    """Gradient bytes leaving each stage's device per step (fp32, from the HF state dict's sizes): a
    resident unit's once (its device accumulator, 4 B/param; none with its optimizer on the device,
    ``Case.on_device``), as a streamed unit's with a device accumulator (``Case.grad_acc``), another
    streamed unit's at every one of the
    ``grad_accum × microbatches`` backwards; the tied head binds the embedding (``lm_head.weight``)."""
    load = {}
    for name, w in weights.items():
        load[unit_of(name)] = load.get(unit_of(name), 0) + 4 * w.numel()
    backwards = case.grad_accum * case.microbatches
    for s, names in enumerate(run.units):
        once = set(case.resident) | set(case.grad_acc)
        want = sum(load[u] * (0 if u in case.on_device else 1 if u in once else backwards) for u in names)
        got = {step["breakdown"][f"stage{s}/d2h_bytes"] for step in run.steps}
        assert got == {want}, f"stage {s}: D2H bytes per step {got}, expected {want}"


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(case)``: what ``check_run`` takes for ``case``, from one torchrun launch of every
    case with its stage count (started at the first such case a test asks for)."""
    root, groups = tmp_path_factory.mktemp("parity"), {}

    def get(case: Case) -> tuple:
        if case.stages not in groups:
            groups[case.stages] = launch_cases([c for c in CASES if c.stages == case.stages], root)
        run, _, *rest = groups[case.stages][case.id]
        return run, *rest

    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parity_with_transformers_adamw(case: Case, launched) -> None:
    check_run(case, *launched(case))


@pytest.mark.parametrize("case", [c for c in CASES if c.accum_chunk], ids=lambda c: c.id)
def test_the_idle_optimizer_thread_shares_the_host_adds(case: Case, launched) -> None:
    """The shared-adds cases above match the reference (their parity test) and their optimizer thread
    really took chunks of the adds: ``accum_helped_bytes`` > 0 over the run, within the step's
    accumulation bytes each step."""
    run = launched(case)[0]
    helped = [(s["breakdown"]["accum_helped_bytes"], s["breakdown"]["accum_host_bytes"]) for s in run.steps]
    assert all(0 <= h <= total for h, total in helped), helped
    assert sum(h for h, _ in helped) > 0, helped


def check_parity(
    case: Case, tmp_path: Path, shm_dir: Path, torchrun, device: str = "cpu", overrides: dict | None = None
) -> Run:
    """Run ``case`` on ``device`` (one rank per stage; ``overrides``: config keys over the case's) and
    compare it with the reference on the same device; returns the run. On CUDA each rank takes its own
    GPU (parity_worker.py: ``cuda:<local rank>``, NCCL refuses two ranks on one device), so a case of
    more stages than the machine has GPUs is skipped, named."""
    if device == "cuda" and case.stages > torch.cuda.device_count():
        pytest.skip(f"{case.id}: {case.stages} stages need as many GPUs, {torch.cuda.device_count()} here")
    model_dir = tmp_path / "hf"
    save_seeded_model(case, model_dir)
    inputs, labels, lengths = make_batches(case)
    run = run_nodetrain(case, tmp_path, shm_dir, model_dir, inputs, labels, torchrun, device, overrides)
    check_run(case, run, model_dir, inputs, labels, lengths, device)
    return run


MAX_MEASURED_ATOL = 1e-5
"""The most a measured weight tolerance may be: 1e-3 × lr. The mutants of the CUDA cases move
weights by 2.7e-2 (``no_clip``) and 5.4e-2 (``untied_grad``), measured on CPU references, and
must stay 100× outside the tolerance used."""


def measured_weight_atol(case: Case, ref: Reference, model_dir: Path, inputs, labels, lengths, device: str):
    """The final weights' absolute floor on ``device``: ``case.atol_weight`` (set from CPU noise), or 4×
    the largest gap between two correct references on ``device`` where that is more (``ref`` and a
    ``per_microbatch`` one; on the H200, nodetrain in fp32 on CUDA ended 2.17e-6 from a CPU
    reference at one element of 16,384, past the CPU's 1e-6).

    Raises:
        AssertionError: the two correct references differ by more than ``MAX_MEASURED_ATOL`` / 4
            (too noisy to test against).
    """
    other = run_reference(case, model_dir, inputs, labels, lengths, "per_microbatch", device)
    noise = _max_diff(ref.weights, other.weights)
    assert 4 * noise <= MAX_MEASURED_ATOL, f"two correct {device} references end {noise:.2e} apart"
    return max(case.atol_weight, 4 * noise)


def check_run(case: Case, run: Run, model_dir: Path, inputs, labels, lengths, device: str = "cpu") -> None:
    """Compare nodetrain's ``run`` of ``case`` with the reference on the same model, tokens and
    ``device``; on CUDA with its measured weight tolerance (``measured_weight_atol``), on CPU with
    ``case.atol_weight`` unless the weights end farther apart than that: then this CPU's own measured
    tolerance (its kernels' summation order sets the noise: one machine's two correct references of
    the unclipped resident case end 1.05e-6 apart, past the floor set from another's 4e-7)."""
    ref = run_reference(case, model_dir, inputs, labels, lengths, device=device)
    atol = case.atol_weight
    if device != "cpu" or (
        set(run.weights) == set(ref.weights) and _max_diff(ref.weights, run.weights) > atol
    ):
        atol = measured_weight_atol(case, ref, model_dir, inputs, labels, lengths, device)

    # one stage per rank, each a non-empty contiguous slice, together every unit in order
    layers = case.hf.get("num_hidden_layers", HF_BASE["num_hidden_layers"])
    assert [u for rank_units in run.units for u in rank_units] == (
        ["embed"] + [f"layers.{i}" for i in range(layers)] + ["head"]
    )
    assert all(run.units), f"a stage owns no unit: {run.units}"
    assert run.resident == list(case.resident), "the case does not exercise the residency it names"
    if case.resident or case.grad_acc:
        check_d2h_bytes(case, run, ref.weights)

    assert [s["tokens"] for s in run.steps] == ref.tokens
    torch.testing.assert_close([s["lr"] for s in run.steps], ref.lrs, rtol=1e-12, atol=0)
    torch.testing.assert_close([s["loss"] for s in run.steps], ref.losses, rtol=RTOL, atol=0)
    torch.testing.assert_close([s["grad_norm"] for s in run.steps], ref.norms, rtol=RTOL, atol=0)
    if case.router_aux_loss == "per_layer":
        torch.testing.assert_close([s["aux_loss"] for s in run.steps], ref.aux_losses, rtol=RTOL, atol=0)
    else:
        assert {s["aux_loss"] for s in run.steps} == {None}, "an aux_loss without a router auxiliary loss"
    if case.max_grad_norm > 0:
        assert min(ref.norms) > case.max_grad_norm, f"clipping does not bite: norms {ref.norms}"

    assert sorted(run.weights) == sorted(ref.weights), "exported names differ from the HF state dict"
    for name, want in ref.weights.items():
        torch.testing.assert_close(
            run.weights[name], want, rtol=RTOL, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )

    if not case.resident:
        numel = _block_numels(ref.weights)
        hidden = ref.weights["model.embed_tokens.weight"].shape[1]
        rows = [sum(len(torch.unique(mb)) for mb in inputs[i]) * hidden for i in range(case.steps)]
        for s, names in enumerate(run.units):
            want = [4 * _step_h2d_numel(case, s, names, numel, r) for r in rows]
            assert [st["breakdown"][f"stage{s}/h2d_bytes"] for st in run.steps] == want, s

    if case.tied:
        assert ref.tied_ok, "the reference model does not tie lm_head to the embedding"
        assert torch.equal(run.weights["lm_head.weight"], run.weights["model.embed_tokens.weight"])
    if case.arch == "Qwen3ForCausalLM":
        assert "model.layers.0.self_attn.q_norm.weight" in ref.weights
    if case.arch == "Qwen2ForCausalLM":
        assert "model.layers.0.self_attn.q_proj.bias" in ref.weights
    if case.arch == "MistralForCausalLM":
        assert _sliding_window_matters(case, model_dir, inputs[0, 0])

    # The same comparison against a reference with one deliberate mistake must fail, by far.
    for variant in case.mutants:
        wrong = run_reference(case, model_dir, inputs, labels, lengths, variant, device)
        names = [n for n in wrong.weights if variant != "decay_biases" or n.endswith(".bias")]
        gap = _max_diff({n: run.weights[n] for n in names}, {n: wrong.weights[n] for n in names})
        assert gap > 100 * atol, f"{variant}: the engine is within {gap:.2e} of a wrong reference"


# ----------------------------------------------------------------------------- activation offload

OFFLOAD_CASE = Case(
    "llama-2stage-dropout-offload",
    "LlamaForCausalLM",
    2,
    "1f1b",
    2,
    1,
    4,
    delay_s=0.003,
    hf={"attention_dropout": 0.1},
)
"""Attention dropout (each recompute replays its forward's random numbers), a slowed H2D worker
(a backward that did not wait for its inputs' prefetch would read unfilled memory)."""


def test_activation_offload_is_bit_exact_on_two_stages(tmp_path: Path, shm_dir: Path, torchrun) -> None:
    """``stream.offload_activations`` (issue 23) on two stages, GPipe and 1F1B, in one launch of four
    engines one after the other: with the offload every step's loss and gradient norm, every unit's
    gradient after every step and the final master weights equal the run without it bit for bit
    (no reference model: dropout); and each stage moved every saved input once each way per step
    (each layer's input, on the last stage also the head's input gradient: [B, T, D] fp32 each)."""
    case, model_dir = OFFLOAD_CASE, tmp_path / "hf"
    save_seeded_model(case, model_dir)
    inputs, labels, _ = make_batches(case)
    variants = {
        f"{sched}-{'on' if on else 'off'}": {"pipeline.schedule": sched, "stream.offload_activations": on}
        for sched in ("gpipe", "1f1b")
        for on in (False, True)
    }
    runs_spec = [
        {"out_dir": str(tmp_path / "out" / name), "run_id": f"parity-offload-{name}", "overrides": overrides}
        for name, overrides in variants.items()
    ]
    spec = write_spec(
        case, tmp_path, shm_dir, model_dir, inputs, labels, variants=runs_spec, export_grads=True
    )
    torchrun(case.stages, WORKER, str(spec), timeout_s=240)
    runs = {name: read_run(case, tmp_path / "out" / name) for name in variants}
    grads = {
        name: {
            k: v
            for r in range(case.stages)
            for k, v in load_file(str(tmp_path / "out" / name / f"grads_rank{r}.safetensors")).items()
        }
        for name in variants
    }
    hidden = HF_BASE["hidden_size"]
    saved_bytes = MICRO_BATCH * SEQ_LEN * hidden * 4
    for schedule in ("gpipe", "1f1b"):
        off, on = runs[f"{schedule}-off"], runs[f"{schedule}-on"]
        for a, b in zip(off.steps, on.steps, strict=True):
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), schedule
        assert sorted(grads[f"{schedule}-off"]) == sorted(grads[f"{schedule}-on"])
        assert len(grads[f"{schedule}-on"]) == STEPS * (2 + HF_BASE["num_hidden_layers"])  # every unit
        for k, g in grads[f"{schedule}-off"].items():
            assert torch.equal(g, grads[f"{schedule}-on"][k]), (schedule, k)
        for k, w in off.weights.items():
            assert torch.equal(w, on.weights[k]), (schedule, k)
        for s, names in enumerate(on.units):
            saved = sum(n.startswith("layers.") for n in names) + (s == case.stages - 1)
            want = case.grad_accum * case.microbatches * saved * saved_bytes
            for a, b in zip(off.steps, on.steps, strict=True):
                assert a["breakdown"][f"stage{s}/act_d2h_bytes"] == 0
                assert b["breakdown"][f"stage{s}/act_d2h_bytes"] == want, (schedule, s)
                assert b["breakdown"][f"stage{s}/act_h2d_bytes"] == want, (schedule, s)
