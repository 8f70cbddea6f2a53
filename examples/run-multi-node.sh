#!/usr/bin/env bash
# Several machines through the deepspeed launcher and a hostfile (`host slots=N`, one line per machine).
# With passwordless ssh and pdsh, run it on the first machine only. Without ssh, run it on every machine with
# NODE_RANK = its line in the hostfile (0, 1, ...) and MASTER_ADDR = an address of machine 0 that all reach.
# Model, batch and paths as in run-one-node.sh (every value from the environment; extra flags go to train_ds.py).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HOSTFILE=${HOSTFILE:-$ROOT/hostfile.txt}
MASTER_ADDR=${MASTER_ADDR:-$(hostname -I | cut -d' ' -f1)}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_RANK=${NODE_RANK:-}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2-1.5b}  # on a filesystem all machines share
DATA_PATH=${DATA_PATH:-my-gpt2_text_document}
DS_CONFIG=${DS_CONFIG:-$ROOT/ds_config.json}
TP_SIZE=${TP_SIZE:-1}
PP_SIZE=${PP_SIZE:-1}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-256}
MODEL=${MODEL:---preset gpt2-xl}
SEQ_LEN=${SEQ_LEN:-1024}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-2560000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}

LAUNCH=(--hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
if [ -n "$NODE_RANK" ]; then
    LAUNCH+=(--no_ssh --node_rank "$NODE_RANK")
fi
# shellcheck disable=SC2086  # MODEL is a list of words
deepspeed "${LAUNCH[@]}" "$ROOT/train_ds.py" --deepspeed --deepspeed_config "$DS_CONFIG" \
    --arch gpt2 $MODEL --seq-length "$SEQ_LEN" --tp-size "$TP_SIZE" --pipeline-stages "$PP_SIZE" \
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" \
    --train-samples "$TRAIN_SAMPLES" --save-interval "$SAVE_INTERVAL" \
    --data-path "$DATA_PATH" --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
    "$@"
