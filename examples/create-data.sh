#!/usr/bin/env bash
# The source design's creat-data.sh: Megatron's preprocess_data.py command line, flags as written, run by
# tokenizer.py. Inputs (fetch them where there is internet):
#   oscar-1GB.jsonl.xz  https://huggingface.co/bigscience/misc-test-data/resolve/main/stas/oscar-1GB.jsonl.xz
#   gpt2-vocab.json, gpt2-merges.txt  (GPT-2's BPE files)
# Output: ${OUTPUT_PREFIX}_text_document.bin/.idx (Megatron's mmap format), what --data-path takes.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
INPUT=${INPUT:-oscar-1GB.jsonl}
VOCAB=${VOCAB:-gpt2-vocab.json}
MERGES=${MERGES:-gpt2-merges.txt}
OUTPUT_PREFIX=${OUTPUT_PREFIX:-my-gpt2}
WORKERS=${WORKERS:-8}

python "$ROOT/tokenizer.py" \
    --input "$INPUT" \
    --output-prefix "$OUTPUT_PREFIX" \
    --vocab "$VOCAB" \
    --dataset-impl mmap \
    --tokenizer-type GPT2BPETokenizer \
    --merge-file "$MERGES" \
    --append-eod \
    --workers "$WORKERS"
