#!/usr/bin/env bash
# One node, one pipeline stage per GPU (or per CPU process when there is no GPU).
#   launch/single_node.sh 8 model=llama3_8b train.seq_len=4096 train.micro_batch_size=1 pipeline.microbatches=16
# The first argument is the number of stages (processes); the rest are Hydra overrides.
set -euo pipefail
nproc="${1:-2}"
shift || true
exec torchrun --standalone --nproc_per_node "$nproc" -m nodetrain.train "$@"
