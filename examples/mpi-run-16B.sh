#!/usr/bin/env bash
# The source design's mpi-run-16B.sh + single-16B.sh: the 16B GPT-2 (--preset gpt2-16b: 40 layers, width 5760,
# 48 heads) on NODES machines x GPUS_PER_NODE devices, one process per device started by mpirun (DeepSpeed finds
# ranks and the master through mpi4py). The source ran tensor parallel 4 x pipeline 8; DeepSpeed's AutoTP does
# not compose with its pipeline engine, so this runs TP_SIZE-way AutoTP with ZeRO-3 (or PP_SIZE stages with
# ZeRO-1). See what a layout needs first:
#   python train_ds.py --estimate-memory --preset gpt2-16b --seq-length 1024 --tp-size 4 --pipeline-stages 8 \
#       --num-nodes 32 --num-gpus 4 --deepspeed_config ds_config_zero1.json
# HOSTFILE lists the machines in OpenMPI's form (`host slots=4`); every value can be set from the environment
# and extra flags go to train_ds.py.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
NODES=${NODES:-32}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
HOSTFILE=${HOSTFILE:-$ROOT/hostfile.txt}
MPIRUN_ARGS=${MPIRUN_ARGS:-}
export MASTER_PORT=${MASTER_PORT:-29500}

MODEL_NAME=${MODEL_NAME:-gpt2-16b}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/$MODEL_NAME}
DATA_PATH=${DATA_PATH:-my-gpt2_text_document}
TENSORBOARD_PATH=${TENSORBOARD_PATH:-$CHECKPOINT_PATH/tensorboard}
CODECARBON_PATH=${CODECARBON_PATH:-}  # a folder: energy and CO2 of the run (pip install codecarbon)
DS_CONFIG=${DS_CONFIG:-$ROOT/ds_config.json}
TP_SIZE=${TP_SIZE:-4}
PP_SIZE=${PP_SIZE:-1}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-512}
MODEL=${MODEL:---preset gpt2-16b}
SEQ_LEN=${SEQ_LEN:-1024}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-5120000}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
EVAL_INTERVAL=${EVAL_INTERVAL:-500}
EVAL_ITERS=${EVAL_ITERS:-10}

# shellcheck disable=SC2086  # MPIRUN_ARGS and MODEL are lists of words
mpirun -np $((NODES * GPUS_PER_NODE)) --hostfile "$HOSTFILE" -x MASTER_PORT -x PATH -x LD_LIBRARY_PATH $MPIRUN_ARGS \
    python "$ROOT/train_ds.py" --deepspeed --deepspeed_config "$DS_CONFIG" \
    --arch gpt2 $MODEL --seq-length "$SEQ_LEN" --tp-size "$TP_SIZE" --pipeline-stages "$PP_SIZE" \
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" \
    --train-samples "$TRAIN_SAMPLES" --lr 1e-4 --min-lr 1e-5 --lr-warmup-samples $((TRAIN_SAMPLES / 100)) \
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" --save-interval "$SAVE_INTERVAL" \
    --data-path "$DATA_PATH" --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
    --tensorboard-dir "$TENSORBOARD_PATH" ${CODECARBON_PATH:+--codecarbon-dir "$CODECARBON_PATH"} \
    "$@"
