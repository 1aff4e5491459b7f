#!/usr/bin/env bash
# SmolLM2-135M-Instruct answers the chat instruction set (self-distillation, greedy, vLLM):
# assets/smollm2-data/{validation,train}.jsonl -> assets/smollm2-data/{validation,train}-answers.jsonl.
# Resumable: rerun after an interruption and finished chunks are kept (OUT.partial).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DATA=assets/smollm2-data
$PY -m vllm_clover_training.cli import-gguf --out runs/smollm2-135m-instruct > /dev/null
[ -f $DATA/train.jsonl ] || $PY -m vllm_clover_training.instructions --out-dir $DATA
for split in validation train; do
    [ -f $DATA/$split-answers.jsonl ] && continue
    $PY -m vllm_clover_training.cli distill --base-model runs/smollm2-135m-instruct \
        --data $DATA/$split.jsonl --out $DATA/$split-answers.jsonl --distill-new-tokens 320
done
