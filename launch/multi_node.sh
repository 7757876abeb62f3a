#!/usr/bin/env bash
# Several nodes by hand: each node runs one replica of the pipeline (one stage per GPU) and the
# replicas share the global batch (data parallel; see nodetrain/engine/replicas.py). Run it on every node
# with the same NNODES, MASTER_ADDR and RUN_ID, and that node's NODE_RANK:
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 RUN_ID=llama-a launch/multi_node.sh 8 model=llama3_8b ...
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 RUN_ID=llama-a launch/multi_node.sh 8 model=llama3_8b ...
# The first argument is the stages per node (processes per node); the rest are Hydra overrides.
# RUN_ID names the run directory runs/<RUN_ID> on every node (put runs/ on a shared filesystem to
# see every rank's log in one place); MASTER_PORT defaults to 29500.
set -euo pipefail
usage="usage: NNODES=K NODE_RANK=i MASTER_ADDR=host RUN_ID=name $0 NPROC_PER_NODE [overrides ...]"
nproc="${1:?$usage}"
shift
: "${NNODES:?$usage}" "${NODE_RANK:?$usage}" "${MASTER_ADDR:?$usage}" "${RUN_ID:?$usage (the same on every node)}"
export NODETRAIN_RUN_ID="$RUN_ID"
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$nproc" \
    --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
    -m nodetrain.train "$@"
