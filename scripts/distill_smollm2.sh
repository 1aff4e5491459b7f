#!/usr/bin/env bash
# SmolLM2-135M-Instruct answers its training chats (self-distillation, greedy, vLLM):
#   the templated instruction set      assets/smollm2-data/{validation,train}.jsonl
#   user turns it writes itself        assets/smollm2-data/chat-{validation,train}.jsonl (self-instruct)
# -> the same names with -answers.jsonl. Resumable: rerun after an interruption and finished
# chunks are kept (OUT.partial).
# The engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): on this 2-core machine
# generation is then 1.8x faster (477 against 262 tokens/s sampling 256 turns), since the
# engine core no longer waits on a worker pinned to one core.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DATA=assets/smollm2-data
BASE=runs/smollm2-135m-instruct
export VLLM_ENABLE_V1_MULTIPROCESSING=0
$PY -m vllm_clover_training.cli import-gguf --out $BASE > /dev/null
[ -f $DATA/train.jsonl ] || $PY -m vllm_clover_training.instructions --out-dir $DATA
[ -f $DATA/chat-train.jsonl ] || $PY -m vllm_clover_training.cli self-instruct --base-model $BASE \
    --out-dir $DATA --count 3200 --validation 200 --seed 0
for split in validation train chat-validation chat-train; do
    [ -f $DATA/$split-answers.jsonl ] && continue
    $PY -m vllm_clover_training.cli distill --base-model $BASE \
        --data $DATA/$split.jsonl --out $DATA/$split-answers.jsonl --distill-new-tokens 320
done
