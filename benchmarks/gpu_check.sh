#!/usr/bin/env bash
# Every GPU check of the toolkit in one run (under 8 minutes on one GPU), ending in one short table:
#   - the SDPA kernels and the written-out attention in bfloat16 at seq 1024 and 2048 (benchmarks/bench_sdpa.py)
#   - the 124M gpt2 shape training in bfloat16, without and with --compile: ms/iter, tokens/s, MFU
#   - sampling tokens/s with the KV cache, 124M, bfloat16
#   - 2-process DDP (when there are 2 GPUs) and a single-GPU DeepSpeed ZeRO-3 step
# Training reads random GPT-2-vocabulary tokens: the speed does not depend on the text, and nothing needs
# the network. --dry-run runs the same steps on the CPU at a tiny size (the tests run it).
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--out DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
OUT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT_DIR="$2"; shift ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
  SAMPLE="--device cpu --dtype float32 --new-tokens 8 --block-size 32"
  # the script's steps, not Inductor's C++ build: --compile runs eagerly (tests/test_model.py traces compile)
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1
else
  DEVICE=cuda; DTYPE=bfloat16; GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
  SDPA="--device cuda --dtypes bfloat16 --shapes 8x12x1024x64,4x12x2048x64"
  SHAPE="--preset gpt2 --block-size 1024 --batch-size 16"; ITERS=40; SKIP=10
  SAMPLE="--device cuda --dtype bfloat16 --preset gpt2 --new-tokens 500 --block-size 1024"
fi
# AdamW, as nanoGPT and llm.c, so the MFU compares the same work (Muon adds its Newton-Schulz matmuls)
COMMON="--data-dir $WORK/data --eval-interval 100000 --eval-iters 1 --log-interval 1 --dtype $DTYPE --device $DEVICE --optimizer adamw"
RESULTS="$OUT_DIR/gpu_check.tsv"
: > "$RESULTS"

result() {  # check, value, unit
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$RESULTS"
}

step_figures() {  # LOG NAME: the median ms/iter, tokens/s and MFU of the iterations after the first SKIP
  python - "$1" "$2" "$SKIP" "$RESULTS" <<'EOF'
import re, statistics, sys
log, name, skip, results = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rows = re.findall(r"^iter (\d+): loss \S+, lr \S+, ([\d.]+) ms, ([\d,]+) tokens/s(?:, mfu ([\d.]+)%)?", open(log).read(), re.M)
rows = [r for r in rows if int(r[0]) > skip]
with open(results, "a") as f:
    if not rows:
        f.write(f"{name}\tfailed\tsee {log}\n")
        sys.exit()
    ms = statistics.median(float(r[1]) for r in rows)
    tokens = statistics.median(float(r[2].replace(",", "")) for r in rows)
    mfu = [float(r[3]) for r in rows if r[3]]
    f.write(f"{name}\t{ms:.1f}\tms/iter\n{name}\t{tokens:,.0f}\ttokens/s\n")
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

echo "== training"
python train.py $COMMON $SHAPE --out-dir "$WORK/eager" --max-iters $ITERS 2>&1 | tee "$OUT_DIR/train_eager.log"
step_figures "$OUT_DIR/train_eager.log" "train gpt2 $DTYPE"
python train.py $COMMON $SHAPE --out-dir "$WORK/compiled" --max-iters $ITERS --compile 2>&1 \
  | tee "$OUT_DIR/train_compile.log"
step_figures "$OUT_DIR/train_compile.log" "train gpt2 $DTYPE --compile"

echo "== sampling"
python benchmarks/bench_sampling.py $SAMPLE --vocab-size 50257 --methods cache --repeats 3 | tee "$OUT_DIR/sampling.txt"
result "sampling with KV cache" "$(grep -oP '^\s+generate\(use_cache=True\)\s+\K[\d,]+(?= tokens/s)' "$OUT_DIR/sampling.txt")" \
  "tokens/s"

echo "== DDP"
if [ "$GPUS" -ge 2 ]; then
  torchrun --standalone --nproc_per_node 2 train_ddp.py $COMMON $SHAPE --out-dir "$WORK/ddp" --max-iters $ITERS 2>&1 \
    | tee "$OUT_DIR/ddp.log"
  step_figures "$OUT_DIR/ddp.log" "DDP 2 GPUs"
else
  result "DDP 2 GPUs" "skipped" "(fewer than 2 GPUs)"
fi

echo "== DeepSpeed ZeRO-3"
if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  python - "$WORK/zero3.json" <<'EOF'
import json, sys
config = json.load(open("ds_config.json"))
for key in ("offload_optimizer", "offload_param"):  # on the GPU: no offload, so no CPU Adam to build
    config["zero_optimization"].pop(key, None)
config["optimizer"]["params"]["torch_adam"] = True
json.dump(config, open(sys.argv[1], "w"))
EOF
  deepspeed --num_gpus 1 train_ds.py --deepspeed --deepspeed_config "$WORK/zero3.json" $COMMON $SHAPE \
    --out-dir "$WORK/ds" --max-iters $ITERS 2>&1 | tee "$OUT_DIR/zero3.log"
  step_figures "$OUT_DIR/zero3.log" "DeepSpeed ZeRO-3 1 GPU"
else
  result "DeepSpeed ZeRO-3 1 GPU" "skipped" "(deepspeed is not installed)"
fi

echo
echo "== gpu_check results ($(cat "$OUT_DIR/environment.txt"))"
column -t -s $'\t' "$RESULTS"
