#!/usr/bin/env bash
# Train Clover heads on a JSONL file for a frozen base model, then score them per head.
#   examples/train_clover_heads.sh [DATA.jsonl] [OUT_DIR] [NUM_PROMPTS]
# DATA lines: {"text": ...}, {"messages": [...]} or {"conversations": [...]}. Without DATA, prompts
# from the bundled corpus' training split are written first.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-runs/example/train.jsonl}
OUT=${2:-runs/example/clover}
NUM_PROMPTS=${3:-200}

if [ ! -f "$DATA" ]; then
    mkdir -p "$(dirname "$DATA")"
    python -m vllm_clover_training.stdlib_corpus --split train --num-prompts "$NUM_PROMPTS" --out "$DATA"
fi

# --self-distill: train on the base's own greedy continuations of the data (generated with
# vLLM, cached in OUT.work/), which is what verification will compare the drafts against.
vllm-clover-train clover --base-model assets/demo-base --data "$DATA" --out "$OUT" \
    --num-heads 4 --max-len 256 --self-distill --distill-prompt-tokens 128 --distill-new-tokens 64

# Per-head top-1 / top-5 on the same kind of data (use held-out data for a real number).
vllm-clover-train eval --heads "$OUT" --base-model assets/demo-base --data "$DATA" --out "$OUT/eval.json" --max-len 256
cat "$OUT/eval.json"
