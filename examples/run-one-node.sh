#!/usr/bin/env bash
# The source design's run-one-node.sh: one machine, N_GPUS processes started by the deepspeed launcher
# (the source started one copy of its script per GPU with `mpirun -np 4`; mpi-run-16B.sh shows that form).
# TP_SIZE x PP_SIZE devices hold one model (not both above 1; pipelines need ZeRO 0/1: DS_CONFIG=ds_config_zero1.json),
# the rest are data parallel; within a node tensor parallel is the faster of the two.
# Every value below can be set from the environment; extra flags are passed on to train_ds.py.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL_NAME=${MODEL_NAME:-gpt2-350m}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/$MODEL_NAME}
DATA_PATH=${DATA_PATH:-my-gpt2_text_document}
TENSORBOARD_PATH=${TENSORBOARD_PATH:-$CHECKPOINT_PATH/tensorboard}
CODECARBON_PATH=${CODECARBON_PATH:-}  # a folder: energy and CO2 of the run (pip install codecarbon)
DS_CONFIG=${DS_CONFIG:-$ROOT/ds_config.json}
MASTER_PORT=${MASTER_PORT:-29500}

N_GPUS=${N_GPUS:-4}
TP_SIZE=${TP_SIZE:-1}
PP_SIZE=${PP_SIZE:-1}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-64}
NLAYERS=${NLAYERS:-24}
NHIDDEN=${NHIDDEN:-1024}
NHEADS=${NHEADS:-16}
SEQ_LEN=${SEQ_LEN:-1024}
TRAIN_SAMPLES=${TRAIN_SAMPLES:-640000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}

deepspeed --num_gpus "$N_GPUS" --master_port "$MASTER_PORT" "$ROOT/train_ds.py" \
    --deepspeed --deepspeed_config "$DS_CONFIG" \
    --arch gpt2 --num-layers "$NLAYERS" --hidden-size "$NHIDDEN" --num-attention-heads "$NHEADS" --seq-length "$SEQ_LEN" \
    --tp-size "$TP_SIZE" --pipeline-stages "$PP_SIZE" \
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" \
    --train-samples "$TRAIN_SAMPLES" --lr 1e-4 --min-lr 1e-5 --lr-warmup-samples $((TRAIN_SAMPLES / 100)) \
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" --save-interval "$SAVE_INTERVAL" \
    --data-path "$DATA_PATH" --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" \
    --tensorboard-dir "$TENSORBOARD_PATH" ${CODECARBON_PATH:+--codecarbon-dir "$CODECARBON_PATH"} \
    "$@"
