"""Host memory of a node: 4 ranks training a 349M-parameter Llama share one host store.

    python bench/host_memory.py                     # ~3-5 minutes on 2 cores, 6.3 GB in /dev/shm
    python bench/host_memory.py --state lean        # optim.state=lean: 7.5 B/param, 2.6 GB in /dev/shm

Four torchrun ranks (gloo, CPU) run two training steps of the real engine; each then reads its
proportional set size (``Pss`` of ``/proc/self/smaps_rollup``: a shared page counts 1/k in each of
the k processes mapping it, so the sum over ranks counts the host store once). Printed side by
side: the sum of the ranks' PSS, the host store's bytes, their ratio, and the issue's target
``sum PSS ≤ 1.15 × store + 1.5 GB`` (DESIGN invariant 1: one copy per node, not one per rank),
together with the planner's prediction for the same run.
"""

from __future__ import annotations

import argparse

from memory_common import GB, err, measure, plan

NPROC = 4
OVERRIDES = [
    "model=llama_10m",
    "model.hf.hidden_size=1024",
    "model.hf.num_hidden_layers=24",
    "model.hf.num_attention_heads=16",
    "model.hf.num_key_value_heads=8",
    "model.hf.intermediate_size=2816",
    "data.vocab_size=32000",
    "train.seq_len=64",
    "train.micro_batch_size=1",
    "pipeline.microbatches=4",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", default="full", choices=("full", "lean"), help="optim.state")
    overrides = [*OVERRIDES, f"optim.state={ap.parse_args().state}"]
    predicted = plan(NPROC, overrides)
    ranks = measure(NPROC, overrides, pin_malloc=False)  # glibc defaults, as in training
    store = ranks[0]["store_bytes"]
    pss = sum(r["pss_bytes"] for r in ranks)
    shmem = sum(r["pss_shmem_bytes"] for r in ranks)
    rss = sum(r["rss_bytes"] for r in ranks)
    target = 1.15 * store + 1.5 * GB
    n = predicted.shape.num_params
    print(f"model: {n / 1e6:,.1f}M parameters, {NPROC} ranks, optim.state={predicted.cfg.optim.state}")
    for r in ranks:
        pss_r, shm_r = r["pss_bytes"] / GB, r["pss_shmem_bytes"] / GB
        print(
            f"  rank {r['rank']}: PSS {pss_r:6.3f} GB (of which host store {shm_r:.3f}),"
            f" RSS {r['rss_bytes'] / GB:6.3f} GB, window {r['window_bytes'] / 1e6:,.1f} MB"
        )
    print(f"host store:               {store / GB:8.3f} GB = {store / n:.2f} bytes/parameter")
    print(f"sum of ranks' PSS:        {pss / GB:8.3f} GB  (host-store pages in it: {shmem / GB:.3f} GB)")
    print(f"sum of ranks' RSS:        {rss / GB:8.3f} GB  (a store page touched by k ranks counts k times)")
    print(f"PSS / store:              {pss / store:8.3f}")
    print(f"per-rank overhead:        {(pss - store) / NPROC / GB:8.3f} GB  (PSS beyond the store, per rank)")
    verdict = "met" if pss <= target else "MISSED"
    print(f"target 1.15 × store + 1.5 GB = {target / GB:.3f} GB: sum PSS {pss / GB:.3f} GB -> {verdict}")
    steady = predicted.store_bytes + NPROC * predicted.cfg.plan.rank_overhead_gb * GB
    steady += sum(st.window_bytes for st in predicted.stages)
    print(
        f"planner: store {predicted.store_bytes / GB:.3f} GB ({err(predicted.store_bytes, store)}), "
        f"store + {NPROC} × {predicted.cfg.plan.rank_overhead_gb} GB + windows = {steady / GB:.3f} GB "
        f"({err(steady, pss)} vs sum PSS), peak with activations {predicted.host_need_bytes / GB:.3f} GB"
    )


if __name__ == "__main__":
    main()
