#!/usr/bin/env bash
# GPU check for a lent machine with one GPU (sized for an H200: 141 GB HBM, 16 cores, 128 GiB RAM).
#
#   bench/gpu_check.sh RESULTS_DIR             # on the GPU machine, from anywhere; < 8 minutes
#   bench/gpu_check.sh RESULTS_DIR --dry-run   # on a CPU: same steps, gpu tests skip, tiny model
#
# 1. `pytest -m gpu` (tests/test_gpu.py: CUDA parity in fp32, side-stream copies, CUDA timeline),
#    ≤ 150 s, log and JUnit XML into RESULTS_DIR;
# 2. bench/copy_bandwidth.py: H2D (host store, cudaHostRegister-ed) and D2H (pinned staging) GB/s
#    next to pageable copies, and Window.offload's GB/s, ≤ 60 s, into RESULTS_DIR/copy_bandwidth.json;
# 3. bench/gpu_train.py: Llama-3.2-3B (the largest shipped shape whose ~59 GB host store fits the
#    default /dev/shm of a 128 GiB node) trained with torchrun --nproc_per_node 1, every unit
#    streamed, then with automatic residency if time is left; TFLOP/s, MFU, H2D/D2H GB/s, stall %
#    and the breakdown as JSON into RESULTS_DIR (summary.json, streamed.json, auto_residency.json);
# 4. RESULTS_DIR/check.json: exit codes, durations, GPU name, torch version.
# Exit status: non-zero if any step failed (all always run). PYTHON overrides the interpreter.
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
py=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

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

store_dir=""
extra=()
if [[ "$dry_run" == "--dry-run" ]]; then
    store_dir=$(mktemp -d /dev/shm/nt-gpucheck-XXXXXX)
    extra=(--dry-run --store-dir "$store_dir")
fi
timeout 60 "$py" bench/copy_bandwidth.py --out "$out" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$out/copy_bandwidth.log"
copy_rc=${PIPESTATUS[0]}
t1b=$(date +%s)

left=$((450 - (t1b - t0)))
timeout $((left + 20)) "$py" bench/gpu_train.py --out "$out" --budget-s "$left" ${extra[@]+"${extra[@]}"} 2>&1 \
    | tee "$out/gpu_train.log"
train_rc=${PIPESTATUS[0]}
[[ -n "$store_dir" ]] && rm -rf "$store_dir"
t2=$(date +%s)

cat >"$out/check.json" <<EOF
{"dry_run": $([[ "$dry_run" == "--dry-run" ]] && echo true || echo false),
 "gpu_tests_rc": $tests_rc, "gpu_tests_s": $((t1 - t0)),
 "train_rc": $train_rc, "train_s": $((t2 - t1b)),
 "copy_rc": $copy_rc, "copy_s": $((t1b - t1)), "total_s": $((t2 - t0))}
EOF
cat "$out/check.json"
[[ $tests_rc -eq 0 && $copy_rc -eq 0 && $train_rc -eq 0 ]]
