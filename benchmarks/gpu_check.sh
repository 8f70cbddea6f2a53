#!/usr/bin/env bash
# Every GPU check of the toolkit in one run (about 5 minutes on one GPU), ending in one short table:
#   - the SDPA kernels and the written-out attention in bfloat16 at seq 1024 and 2048 (benchmarks/bench_sdpa.py)
#   - the loss paths of one 124M micro-batch: chunked, full logits padded and unpadded (benchmarks/bench_loss.py)
#   - the 124M gpt2 shape training in bfloat16 (no biases, as nanoGPT's default), without and with --compile:
#     ms/iter, tokens/s, MFU; with NANOGPT_DIR=a checkout of karpathy/nanoGPT, its train.py on the same shape
#     and data, compiled, right after ours
#   - the quick start, `python train.py` with no flags: wall seconds and its val loss
#   - sampling tokens/s with the KV cache, 124M, bfloat16, eager and with test.py --compile's CUDA-graph step,
#     each with its MBU against the GPU's measured read bandwidth; the same at batch 1, 4, 16 and 64
#     (benchmarks/bench_decode.py --device cuda)
#   - 2-process DDP (when there are 2 GPUs), FSDP2 on one GPU with activation checkpointing (train_ddp.py
#     --fsdp) and a single-GPU DeepSpeed ZeRO-3 step; each training run's peak GPU memory
#   - with NANOGPT_DIR and SHAKESPEARE=Tiny Shakespeare's input.txt also the time-to-quality race against
#     nanoGPT's GPU recipe (benchmarks/speedrun.py --recipe gpu: about 5 more minutes)
# Training reads random GPT-2-vocabulary tokens: the speed does not depend on the text, and nothing needs
# the network. --dry-run runs the same steps on the CPU at a tiny size (the tests run it).
#
#   NANOGPT_DIR=../nanoGPT bash benchmarks/gpu_check.sh [--dry-run] [--out DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DRY=0
OUT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT_DIR="$2"; shift ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (use --dry-run, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
OUT_DIR=${OUT_DIR:-$WORK}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

if [ $DRY = 1 ]; then
  DEVICE=cpu; DTYPE=float32; GPUS=0
  SDPA="--device cpu --dtypes float32 --shapes 1x4x512x32 --warmup 1 --repeats 2"  # every kernel; inputs over 64 KiB, so their memory shows
  SHAPE="--n-layer 1 --n-head 2 --n-embd 32 --block-size 32 --batch-size 2"; ITERS=6; SKIP=2
  NANO_SHAPE="--n_layer=1 --n_head=2 --n_embd=32 --block_size=32 --batch_size=2"
  LOSS="--device cpu --n-layer 1 --n-head 2 --n-embd 32 --block-size 32 --batch-size 2 --repeats 2"
  SAMPLE="--device cpu --dtype float32 --new-tokens 8 --block-size 32"  # (--compile's step: eager)
  QUICK="--n-layer 1 --n-head 2 --n-embd 32 --max-iters 4 --eval-iters 2"
  # the script's steps, not Inductor's C++ build: --compile runs eagerly (tests/test_model.py traces compile)
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1
else
  DEVICE=cuda; DTYPE=bfloat16; GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
  SDPA="--device cuda --dtypes bfloat16 --shapes 8x12x1024x64,4x12x2048x64"
  SHAPE="--preset gpt2 --block-size 1024 --batch-size 16"; ITERS=40; SKIP=10
  NANO_SHAPE="--n_layer=12 --n_head=12 --n_embd=768 --block_size=1024 --batch_size=16"
  LOSS="--device cuda --dtype bfloat16 --preset gpt2 --block-size 1024 --batch-size 16"
  SAMPLE="--device cuda --dtype bfloat16 --preset gpt2 --new-tokens 500 --block-size 1024"
  QUICK=""
fi
# AdamW, as nanoGPT and llm.c, so the MFU compares the same work (Muon adds its Newton-Schulz matmuls)
COMMON="--data-dir $WORK/data --eval-interval 100000 --eval-iters 1 --log-interval 1 --dtype $DTYPE --device $DEVICE \
  --optimizer adamw --no-bias"
RESULTS="$OUT_DIR/gpu_check.tsv"
: > "$RESULTS"

result() {  # check, value, unit
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$RESULTS"
}

step_figures() {  # LOG NAME: the median ms/iter, tokens/s and MFU of the iterations after the first SKIP
  python - "$1" "$2" "$SKIP" "$RESULTS" <<'EOF'
import re, statistics, sys
log, name, skip, results = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
text = open(log).read()
ours = re.findall(r"^iter (\d+): loss \S+, lr \S+, ([\d.]+) ms, ([\d,]+) tokens/s(?:, mfu ([\d.]+)%)?", text, re.M)
nanogpt = re.findall(r"^iter (\d+): loss \S+, time ([\d.]+)ms", text, re.M)  # its MFU assumes an A100: not kept
rows = [r for r in ours or nanogpt if int(r[0]) > skip]
with open(results, "a") as f:
    if not rows:
        f.write(f"{name}\tfailed\tsee {log}\n")
        sys.exit()
    f.write(f"{name}\t{statistics.median(float(r[1]) for r in rows):.1f}\tms/iter\n")
    peak = re.search(r"peak memory ([\d.]+) GiB", text)  # train.py's last line, on a GPU
    f.write(f"{name}\t{peak[1]}\tGiB peak\n" if peak else "")
    if ours:
        mfu = [float(r[3]) for r in rows if r[3]]
        f.write(f"{name}\t{statistics.median(float(r[2].replace(',', '')) for r in rows):,.0f}\ttokens/s\n")
        f.write(f"{name}\t{statistics.median(mfu):.1f}\t% MFU\n" if mfu else f"{name}\tn/a\t% MFU (peak unknown)\n")
EOF
}

echo "== environment"
python -c "import torch, sys; sys.path.insert(0, '.'); from toolkit.device import describe, resolve_device; \
print('torch', torch.__version__, '|', describe(resolve_device('$DEVICE')))" | tee "$OUT_DIR/environment.txt"

echo "== attention kernels"
python benchmarks/bench_sdpa.py $SDPA --json "$OUT_DIR/sdpa.jsonl" | tee "$OUT_DIR/sdpa.txt"
python - "$OUT_DIR/sdpa.jsonl" "$RESULTS" <<'EOF'
import json, sys
with open(sys.argv[2], "a") as f:
    for r in map(json.loads, open(sys.argv[1])):
        name = f"sdpa {r['kernel']} {'x'.join(map(str, r['shape']))} {r['dtype']}"
        f.write(f"{name}\t{r['ms']:.2f}\tms fwd+bwd\n" if r["supported"] else f"{name}\tunsupported\t\n")
EOF

echo "== data: random GPT-2-vocabulary tokens"
python -c "import sys, numpy as np; sys.path.insert(0, '.'); from toolkit.writers import write_nanogpt; \
from toolkit.gpt2_vocab import GPT2_FACTS; ids = np.random.default_rng(0).integers(0, 50257, 2_000_000, dtype=np.uint16); \
write_nanogpt('$WORK/data', ids[:1_900_000], ids[1_900_000:], dict(GPT2_FACTS))"

echo "== loss paths (one micro-batch, forward and backward)"
python benchmarks/bench_loss.py $LOSS | tee "$OUT_DIR/loss_paths.txt"
python - "$OUT_DIR/loss_paths.txt" "$RESULTS" <<'EOF'
import re, sys
with open(sys.argv[2], "a") as f:
    for path, ms in re.findall(r"^(chunked|full-padded|full-unpadded)\s+([\d.]+)", open(sys.argv[1]).read(), re.M):
        f.write(f"loss path {path}\t{ms}\tms fwd+bwd\n")
EOF

echo "== training"
python train.py $COMMON $SHAPE --out-dir "$WORK/eager" --max-iters $ITERS --no-compile 2>&1 | tee "$OUT_DIR/train_eager.log"
step_figures "$OUT_DIR/train_eager.log" "train gpt2 $DTYPE"
python train.py $COMMON $SHAPE --out-dir "$WORK/compiled" --max-iters $ITERS --compile 2>&1 \
  | tee "$OUT_DIR/train_compile.log"
step_figures "$OUT_DIR/train_compile.log" "train gpt2 $DTYPE --compile"
result "first step with --compile" "$(grep -oP '^first step \K[\d.]+(?= s)' "$OUT_DIR/train_compile.log")" "s"

if [ -n "${NANOGPT_DIR:-}" ]; then
  echo "== nanoGPT, the same shape and data, compiled ($NANOGPT_DIR)"
  NANO=$(cd "$NANOGPT_DIR" && pwd)
  mkdir -p "$WORK/nanogpt/data/random"
  ln -s "$WORK/data/train.bin" "$WORK/data/val.bin" "$WORK/nanogpt/data/random/"
  ln -s "$NANO/configurator.py" "$WORK/nanogpt/"
  NANO_COMPILE=$([ $DRY = 1 ] && echo False || echo True)
  (cd "$WORK/nanogpt" && python "$NANO/train.py" $NANO_SHAPE --dataset=random --device=$DEVICE --dtype=$DTYPE \
    --compile=$NANO_COMPILE --max_iters=$ITERS --eval_interval=100000 --eval_iters=1 --log_interval=1 \
    --gradient_accumulation_steps=1 --always_save_checkpoint=False --dropout=0.0 --bias=False) 2>&1 \
    | tee "$OUT_DIR/nanogpt.log"
  step_figures "$OUT_DIR/nanogpt.log" "nanoGPT gpt2 $DTYPE --compile"
else
  result "nanoGPT side by side" "skipped" "(set NANOGPT_DIR)"
fi

echo "== the quick start: python train.py with no flags"
mkdir -p "$WORK/quick"
START=$(date +%s.%N)
(cd "$WORK/quick" && python "$ROOT/train.py" $QUICK) 2>&1 | tee "$OUT_DIR/quick_start.log"
result "quick start wall" "$(python -c "print(f'{$(date +%s.%N) - $START:.1f}')")" "s"
result "quick start val loss" "$(grep -oP '^step \d+: .*val loss \K[\d.]+' "$OUT_DIR/quick_start.log" | tail -1)" ""

echo "== sampling"
python benchmarks/bench_sampling.py $SAMPLE --vocab-size 50257 --methods cache,compiled --repeats 3 \
  | tee "$OUT_DIR/sampling.txt"
for method in "generate(use_cache=True)" "generate, compiled step"; do
  line=$(grep -F "  $method " "$OUT_DIR/sampling.txt")
  name="sampling with KV cache"; [ "$method" = "generate(use_cache=True)" ] || name="sampling, compiled step"
  result "$name" "$(grep -oP '\s\K[\d,]+(?= tokens/s)' <<< "$line")" "tokens/s"
  result "$name MBU" "$(grep -oP 'MBU \K\d+(?=%)' <<< "$line")" "%"
done

echo "== decoding sweep: batch 1, 4, 16, 64, eager and compiled (a CUDA graph), bfloat16"
if [ $DRY = 1 ]; then  # (tests/test_benchmarks.py runs bench_decode.py on the CPU)
  result "decode sweep" "skipped" "(on a GPU only)"
else
  python benchmarks/bench_decode.py --device cuda --rounds 1 | tee "$OUT_DIR/decode.txt"
  grep -P '^\| ours' "$OUT_DIR/decode.txt" | while IFS='|' read -r _ name batch _ rate mbu _; do
    result "decode, $(xargs <<< "$name") batch $(xargs <<< "$batch")" "$(xargs <<< "$rate")" \
      "tokens/s, MBU $(xargs <<< "$mbu")"
  done
fi

echo "== DDP"
if [ "$GPUS" -ge 2 ]; then
  torchrun --standalone --nproc_per_node 2 train_ddp.py $COMMON $SHAPE --out-dir "$WORK/ddp" --max-iters $ITERS 2>&1 \
    | tee "$OUT_DIR/ddp.log"
  step_figures "$OUT_DIR/ddp.log" "DDP 2 GPUs"
else
  result "DDP 2 GPUs" "skipped" "(fewer than 2 GPUs)"
fi

echo "== FSDP2, one process, with activation checkpointing"
torchrun --standalone --nproc_per_node 1 train_ddp.py --fsdp --activation-checkpointing $COMMON $SHAPE \
  --out-dir "$WORK/fsdp" --max-iters $ITERS 2>&1 | tee "$OUT_DIR/fsdp.log"
step_figures "$OUT_DIR/fsdp.log" "FSDP2 1 GPU --activation-checkpointing"

echo "== DeepSpeed ZeRO-3"
if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  python - "$WORK/zero3.json" "$DTYPE" <<'EOF'
import json, sys
config = json.load(open("ds_config.json"))
for key in ("offload_optimizer", "offload_param"):  # on the GPU: no offload, so no CPU Adam to build
    config["zero_optimization"].pop(key, None)
config["optimizer"]["params"]["torch_adam"] = True
config["bf16"] = {"enabled": sys.argv[2] == "bfloat16"}  # the precision of --dtype
json.dump(config, open(sys.argv[1], "w"))
EOF
  deepspeed --num_gpus 1 train_ds.py --deepspeed --deepspeed_config "$WORK/zero3.json" $COMMON $SHAPE \
    --out-dir "$WORK/ds" --max-iters $ITERS 2>&1 | tee "$OUT_DIR/zero3.log"
  step_figures "$OUT_DIR/zero3.log" "DeepSpeed ZeRO-3 1 GPU"
else
  result "DeepSpeed ZeRO-3 1 GPU" "skipped" "(deepspeed is not installed)"
fi

if [ -n "${NANOGPT_DIR:-}" ] && [ -n "${SHAKESPEARE:-}" ]; then
  echo "== time to quality on Tiny Shakespeare against nanoGPT's GPU recipe"
  python benchmarks/speedrun.py --recipe gpu --nanogpt-dir "$NANOGPT_DIR" --text "$SHAKESPEARE" --rounds 1 \
    --json "$OUT_DIR/speedrun.json" | tee "$OUT_DIR/speedrun.txt"
  python - "$OUT_DIR/speedrun.json" "$RESULTS" <<'EOF'
import json, statistics, sys
with open(sys.argv[2], "a") as f:
    for name, runs in json.load(open(sys.argv[1])).items():
        f.write(f"speedrun {name}\t{statistics.median(r['seconds'] for r in runs):.1f}\twall s\n")
        f.write(f"speedrun {name}\t{statistics.median(r['whole_val'] for r in runs):.4f}\twhole-val loss\n")
EOF
else
  result "time to quality" "skipped" "(set NANOGPT_DIR and SHAKESPEARE)"
fi

echo
echo "== gpu_check results ($(cat "$OUT_DIR/environment.txt"))"
python - "$RESULTS" <<'EOF'
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
width = max(len(r[0]) for r in rows)
for name, value, unit in rows:
    print(f"{name:{width}}  {value:>12}  {unit}")
EOF
