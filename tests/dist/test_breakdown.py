"""The step breakdown (breakdown.py): phases, FLOPs, the per-stage record, and a real 2-stage run.

Pure parts first: the timeline's arithmetic against sleeps, the FLOP count against a hand count
of a ``transformers`` model's parameters (PaLM arXiv:2204.02311 App. B), the step-level combine
against hand arithmetic. Then the acceptance check on CPU: in a 2-stage run the phases of every
stage sum to its step time within 10%, the byte counts equal their closed forms, and waits
injected on purpose (slow copies, a slow optimizer) show up in the phase they belong to.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from nodetrain.model import HFModel
from nodetrain.run.breakdown import (
    PHASES,
    StepBreakdown,
    Timeline,
    combine_stages,
    flops_per_token,
    mfu_warning,
    peak_flops_line,
)
from nodetrain.run.metrics import format_progress

WORKER = Path(__file__).resolve().parents[1] / "parity_worker.py"
HF = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 320,
    "max_position_embeddings": 64,
}


def test_timeline_attributes_sleeps_to_their_phase() -> None:
    tl = Timeline("cpu")
    with tl.phase("stall"):  # not started: no effect, no error
        pass
    t0 = time.perf_counter()
    tl.start()
    time.sleep(0.02)  # compute
    with tl.phase("stall"):
        time.sleep(0.03)
        with tl.phase("optim"):
            time.sleep(0.02)
    with tl.phase("bubble"):
        time.sleep(0.01)
    out = tl.stop()
    wall = time.perf_counter() - t0
    assert set(out) == {f"{p}_s" for p in PHASES}
    assert out["compute_s"] >= 0.02 and out["stall_s"] >= 0.03 and out["optim_s"] >= 0.02
    assert out["bubble_s"] >= 0.01 and out["d2h_wait_s"] == 0.0
    assert 0.08 <= sum(out.values()) <= wall


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_flops_per_token_matches_a_hand_count_of_the_hf_model(tied: bool) -> None:
    config = transformers.LlamaConfig(**HF, tie_word_embeddings=tied, architectures=["LlamaForCausalLM"])
    hf = transformers.LlamaForCausalLM(config)
    total = sum(p.numel() for p in hf.parameters())  # a tied lm_head is counted once
    vocab, d = config.vocab_size, config.hidden_size
    n_matmul = total - vocab * d + (vocab * d if tied else 0)  # no embedding lookup; lm_head always
    seq = 32
    want = 6 * n_matmul + 12 * 4 * 4 * (d // 4) * seq  # 6N + 12·L·H·Q·T
    model = HFModel(config)
    n = sum(model.block_cost(i) for i in range(len(model.units)))
    assert flops_per_token(config, n, model.num_layers, seq) == want
    # split over two stages, the parts add up to the whole
    halves = [range(0, 3), range(3, len(model.units))]
    parts = [
        flops_per_token(config, sum(model.block_cost(i) for i in r), sum(1 for i in r if 0 < i <= 4), seq)
        for r in halves
    ]
    assert sum(parts) == want


def _rec(step_s, compute, bubble, flops, peak, h2d, busy):
    rec = dict.fromkeys((f"{p}_s" for p in PHASES), 0.0)
    rec.update(step_s=step_s, compute_s=compute, bubble_s=bubble, other_s=step_s - compute - bubble)
    rec.update(h2d_bytes=h2d, d2h_bytes=0, h2d_busy_s=busy, d2h_busy_s=0.0, optim_busy_s=0.5, flops=flops)
    rec.update(cpu_s=1.0)
    rec.update(peak_flops=peak, window_bytes=h2d // 10, num_resident=1, store_bytes=1000)
    return rec


def test_combine_stages_arithmetic() -> None:
    out = combine_stages(
        [_rec(2.0, 1.5, 0.4, 4e12, 1e12, 400, 0.2), _rec(1.8, 1.0, 0.8, 2e12, 2e12, 600, 0.8)]
    )
    assert out["stage1/compute_s"] == 1.0 and out["stage0/h2d_bytes"] == 400
    assert out["step_s"] == 2.0
    assert out["compute_s"] == pytest.approx(1.25) and out["bubble_s"] == pytest.approx(0.6)
    assert out["flops"] == 6e12 and out["tflops"] == pytest.approx(3.0)
    assert out["mfu"] == pytest.approx(6e12 / (2.0 * 3e12))
    assert out["h2d_gbps"] == pytest.approx(1000 / 1.0 / 1e9)
    assert out["window_bytes"] == 60 and out["num_resident"] == 2 and out["store_bytes"] == 1000


def test_peak_line_has_three_digits_and_mfu_above_100_percent_is_warned_once(caplog) -> None:
    """A CPU's measured peak is printed, not 0.0; an MFU above 100% (a matmul measured on a shared
    machine) is warned about once per run, naming the source and train.peak_flops."""
    cpu = "measured matmul (CPU)"
    assert peak_flops_line(4.567e10, cpu) == f"MFU against 0.0457 TFLOP/s per device: {cpu}"
    assert peak_flops_line(989.4e12, "datasheet") == "MFU against 989 TFLOP/s per device: datasheet"
    assert mfu_warning(1.0, cpu) is None and mfu_warning(0.3, cpu) is None
    warning = mfu_warning(1.5, cpu)
    assert "MFU 150% is above 100%" in warning and cpu in warning and "train.peak_flops" in warning
    steps = StepBreakdown(torch.device("cpu"), 1.0, 1e12, {"peak_flops_source": cpu})
    for mfu in (0.5, 2.0, 3.0):  # flops / (step_s × peak): the second and third are above 100%
        rec = {**_rec(1.0, 0.5, 0.1, mfu * 1e12, 1e12, 100, 0.2), "peak_flops_source": cpu}
        assert steps.gather(rec)["mfu"] == pytest.approx(mfu)
    warned = [r for r in caplog.records if "above 100%" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING" and "MFU 200%" in warned[0].getMessage()


def test_combine_two_replicas_keys_by_stage_and_aggregates_every_rank() -> None:
    # ranks 0, 1: replica 0's stages 0, 1; ranks 2, 3: replica 1's (rank = replica · 2 + stage)
    ranks = [
        _rec(2.0, 1.5, 0.4, 4e12, 1e12, 400, 0.2),
        _rec(1.8, 1.0, 0.8, 2e12, 2e12, 600, 0.8),
        _rec(2.5, 1.1, 1.0, 4e12, 1e12, 200, 0.4),  # replica 1 is the slow node
        _rec(1.9, 0.6, 1.2, 2e12, 2e12, 800, 0.6),
    ]
    out = combine_stages(ranks, num_stages=2)
    # per stage: replica 0's record under the stage index, no key for a rank ≥ num_stages
    assert {k.split("/")[0] for k in out if k.startswith("stage")} == {"stage0", "stage1"}
    assert out["stage0/step_s"] == 2.0 and out["stage1/compute_s"] == 1.0 and out["stage1/h2d_bytes"] == 600
    assert out["replica0/step_s"] == 2.0 and out["replica1/step_s"] == 2.5
    # step level: every rank of every replica
    assert out["step_s"] == 2.5
    assert out["compute_s"] == pytest.approx((1.5 + 1.0 + 1.1 + 0.6) / 4)
    assert out["bubble_s"] == pytest.approx((0.4 + 0.8 + 1.0 + 1.2) / 4)
    assert out["flops"] == 12e12 and out["tflops"] == pytest.approx(12e12 / 2.5 / 1e12)
    assert out["mfu"] == pytest.approx(12e12 / (2.5 * 6e12))
    assert out["h2d_gbps"] == pytest.approx(2000 / 2.0 / 1e9)
    assert out["window_bytes"] == 80 and out["num_resident"] == 4 and out["store_bytes"] == 1000
    # one replica: the keys are as before
    assert combine_stages(ranks[:2], num_stages=2) == combine_stages(ranks[:2])


def test_progress_line_shows_mfu_and_shares() -> None:
    rec = {"step": 3, "loss": 2.0, "step_s": 2.0, "mfu": 0.251, **{f"{p}_s": 0.4 for p in PHASES}}
    line = format_progress(rec, 10)
    assert "mfu 25.1%" in line and "cmp 20% stall 20% d2h 20% opt 20% bub 20%" in line
    assert "cmp" not in format_progress({"step": 3, "loss": 2.0}, 10)


# ----------------------------------------------------------------------------- a real 2-stage run

STEPS, M, B, T = 3, 4, 2, 32
COPY_DELAY_S, OPTIM_DELAY_S = 0.003, 0.1


def _unit_numels(hf: transformers.PreTrainedModel) -> dict[str, int]:
    """Elements each block binds, from the HF state dict (the tied head binds the embedding)."""
    out: dict[str, int] = {}
    for name, p in hf.state_dict().items():
        if name.startswith("model.layers."):
            key = "layers." + name.split(".")[2]
        elif name.startswith("model.embed_tokens"):
            key = "embed"
        else:
            key = "head"
        out[key] = out.get(key, 0) + p.numel()
    return out


def _load_sequence(names: list[str], stage: int, m: int) -> list[str]:
    """The units a 2-stage 1F1B stage loads in one step, in order (closed form of the schedule: stage
    0 runs F0 F1 B0 F2 B1 … B(m-1), stage 1 F0 B0 F1 B1 …): a forward the layers and the head, a
    backward the layers in reverse; the embedding never (its rows are gathered)."""
    fwd = [n for n in names if n != "embed"]
    bwd = [n for n in fwd if n != "head"][::-1]
    if stage == 1:
        return (fwd + bwd) * m
    order = fwd + fwd + bwd + (fwd + bwd) * (m - 2) + bwd if m >= 2 else fwd + bwd
    return order


def test_two_stage_breakdown_sums_to_step_time_and_counts_bytes(tmp_path, shm_dir, torchrun) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(b"breakdown"))
    inputs = torch.randint(0, HF["vocab_size"], (STEPS, M, B, T), generator=gen)
    labels = torch.randint(0, HF["vocab_size"], (STEPS, M, B, T), generator=gen)
    save_file({"inputs": inputs, "labels": labels}, str(tmp_path / "batch.safetensors"))
    (tmp_path / "out").mkdir()
    overrides = {
        "train.dtype": "float32",
        "train.seq_len": T,
        "train.micro_batch_size": B,
        "train.steps": STEPS,
        "data.vocab_size": HF["vocab_size"],
        "pipeline.microbatches": M,
        "stream.slots": 1,
        "stream.device_budget": 0,
        "optim.max_grad_norm": 1.0,
        "optim.threads": 1,
        "optim.warmup_steps": 1,
        "store.dir": str(shm_dir),
    }
    spec = {
        "arch": "LlamaForCausalLM",
        "hf": {**HF, "tie_word_embeddings": False},
        "overrides": overrides,
        "faults": {"copy_delay_s": COPY_DELAY_S, "optim_delay_s": OPTIM_DELAY_S},
        "model_dir": None,
        "batch_file": str(tmp_path / "batch.safetensors"),
        "out_dir": str(tmp_path / "out"),
        "run_id": "breakdown-test",
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    torchrun(2, WORKER, str(tmp_path / "spec.json"), timeout_s=150)
    steps = json.loads((tmp_path / "out" / "steps.json").read_text())
    units = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text())["units"] for r in (0, 1)]

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF, tie_word_embeddings=False))
    numel = _unit_numels(hf)
    heads, d = HF["num_attention_heads"], HF["hidden_size"]
    for i, step in enumerate(steps):
        bd = step["breakdown"]
        for s, names in enumerate(units):
            rec = {k.split("/", 1)[1]: v for k, v in bd.items() if k.startswith(f"stage{s}/")}
            parts = [rec[f"{p}_s"] for p in PHASES]
            assert min(parts) >= 0, rec
            # the acceptance check: the phases account for the step (same run, same clock)
            assert abs(sum(parts) - rec["step_s"]) <= 0.1 * rec["step_s"], (i, s, rec)
            # a layer streams in once per forward and once per backward of each micro-batch, the head
            # once (its gradients are taken in its forward), the embedding as the distinct ids' rows;
            # a use right after a use of the same block shares its load (1F1B's F→B and B→F turns)
            seq = _load_sequence(names, s, M)
            loaded = [n for k, n in enumerate(seq) if k == 0 or seq[k - 1] != n]
            rows = sum(len(torch.unique(inputs[i, mb])) for mb in range(M)) * HF["hidden_size"]
            rows = rows if "embed" in names else 0
            dense = [n for n in names if n != "embed"]
            assert rec["h2d_bytes"] == 4 * (sum(numel[n] for n in loaded) + rows)
            assert rec["d2h_bytes"] == 4 * (M * sum(numel[n] for n in dense) + rows)
            # host bytes of the gradient path: a dense block's first write (4 + 4 B/elem), then M − 1
            # adds (4 + 8); the embedding's zeroing (4 B/elem of V×D) and its rows' adds (4 + 8); the
            # step's AdamW pass, 40 B/elem plus 8 for the clip when it scales
            embed = 4 * numel["embed"] + 12 * rows if "embed" in names else 0
            assert rec["accum_host_bytes"] == sum(numel[n] for n in dense) * (8 + 12 * (M - 1)) + embed
            clipped = step["grad_norm"] + 1e-6 > 1.0  # optim.max_grad_norm = 1.0
            total = sum(numel[n] for n in names)
            assert rec["optim_host_bytes"] == total * (40 + 8 * clipped), (i, s, step["grad_norm"])
            assert rec["window_bytes"] == 4 * max(numel[n] for n in dense)  # one slot, no embedding
            # one slot, 3 ms per copy: every load that follows a release in a pass waits ≥ 3 ms
            waits = len(loaded) - 2 * M  # real loads, less at most one per pass that may be prefetched
            assert rec["stall_s"] >= 0.9 * waits * COPY_DELAY_S, (i, s, rec)
            n_matmul = sum(numel[n] for n in names if n != "embed")
            n_layers = sum(n.startswith("layers.") for n in names)
            per_token = 6 * n_matmul + 12 * n_layers * heads * (d // heads) * T
            assert rec["flops"] == per_token * M * B * T
            assert rec["mfu"] > 0 and rec["h2d_gbps"] > 0
        # stage 1 waits for stage 0's first activation; after step 0, stage 0's first forward
        # waits for its units' updates (100 ms each, in order), which is optimizer time
        assert bd["stage1/bubble_s"] > 0
        if i > 0:
            assert bd["stage0/optim_s"] >= OPTIM_DELAY_S, bd
        assert bd["mfu"] > 0 and bd["step_s"] == max(bd["stage0/step_s"], bd["stage1/step_s"])
    assert steps[0]["breakdown"]["store_bytes"] >= 18 * sum(numel.values())


def test_peak_flops_source_prefers_config_then_datasheet_then_measurement() -> None:
    """MFU's denominator (issue 13, item 6): train.peak_flops, else the datasheet of the profile
    naming the GPU (the selected one first, then every shipped one), else a measured matmul."""
    from nodetrain.run.breakdown import hardware_profiles, select_peak_flops

    profiles = hardware_profiles()
    by_name = {p.name: p for p in profiles}
    assert {"h200", "h100_sxm", "a100_80gb", "cpu"} <= set(by_name)
    cpu = by_name["cpu"]
    assert select_peak_flops(5e14, "NVIDIA H200", cpu, profiles) == (5e14, "train.peak_flops=5e+14")
    peak, source = select_peak_flops(0.0, "NVIDIA H200", cpu, profiles)  # hardware=cpu left as default
    assert peak == 989.4e12 and "datasheet of hardware=h200 " in source
    peak, source = select_peak_flops(0.0, "nvidia a100-sxm4-80gb", cpu, profiles)
    assert peak == 312e12 and "a100_80gb" in source
    peak, source = select_peak_flops(0.0, "NVIDIA H200", by_name["h200_1gpu"], profiles)
    assert "hardware=h200_1gpu" in source  # the selected profile wins when it names the GPU
    assert select_peak_flops(0.0, "NVIDIA H200 NVL", cpu, profiles)[0] is None  # not the SXM part
    peak, source = select_peak_flops(0.0, "NVIDIA B200", cpu, profiles)
    assert peak is None and "measured matmul" in source and "NVIDIA B200" in source
    assert select_peak_flops(0.0, None, cpu, profiles) == (None, "measured matmul (CPU)")
