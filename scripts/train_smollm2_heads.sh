#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct heads (K=4, 8k draft vocabulary) on the self-distilled chats
# of assets/smollm2-data, scored on its validation split: first the choices measured on this
# model (1 epoch each, kept in runs/), then the shipped Clover, CLP and Medusa heads and the
# EAGLE-1 draft (the peer: the authors' loss, soft targets, full vocabulary as vLLM's EAGLE scores).
# The base's hidden states are computed once (runs/smollm2-hidden, ~25 min) and shared.
# Resumable step by step: finished runs are kept, a killed run is resumed.
# `chat`: Clover and CLP candidates trained the same way on the user turns SmolLM2 wrote itself
# (self-instruct, scripts/distill_smollm2.sh) alone, into runs/smollm2-chat-heads: measured
# against the shipped heads before anything ships.
#   bash scripts/train_smollm2_heads.sh ablations|ship|chat
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BASE=runs/smollm2-135m-instruct
DATA=assets/smollm2-data
COMMON=(--base-model "$BASE" --data "$DATA/train-answers.jsonl" --eval-data "$DATA/validation-answers.jsonl"
        --num-heads 4 --max-len 512 --batch-size 8 --seed 0
        --hidden-cache runs/smollm2-hidden/train --compute-dtype bfloat16 --save-dtype bfloat16)
if [ "${1:-ship}" = chat ]; then  # the shipped recipe on the self-instructed chats alone
    COMMON=(--base-model "$BASE" --data "$DATA/chat-train-answers.jsonl" --eval-data "$DATA/chat-validation-answers.jsonl"
            --num-heads 4 --max-len 512 --batch-size 8 --seed 0
            --hidden-cache runs/smollm2-hidden/chat-train --compute-dtype bfloat16 --save-dtype bfloat16)
fi
VOCAB=(--draft-vocab-size 8192)
[ -f "$BASE/config.json" ] || make real-base

train() {  # train DEST METHOD [FLAGS...]
    local dest=$1 method=$2; shift 2
    [ -f "$dest/config.json" ] && return
    local resume=()
    [ -f "$dest.work/state.pt" ] && resume=(--resume)
    $PY -m vllm_clover_training.cli "$method" "${COMMON[@]}" --out "$dest" "${resume[@]}" "$@"
}

case "${1:-ship}" in
ablations)
    A=runs/smollm2-ablations
    train $A/clover-identity clover "${VOCAB[@]}" --augment-init identity
    train $A/clover-identity-soft clover "${VOCAB[@]}" --augment-init identity --soft-targets
    train $A/clover-identity-mlp clover "${VOCAB[@]}" --augment-init identity --regressive mlp
    ;;
ship)
    OUT=assets/smollm2-heads
    train $OUT/clover clover "${VOCAB[@]}" --augment-init identity --epochs 2
    train $OUT/clp clp "${VOCAB[@]}" --epochs 2
    train $OUT/medusa medusa "${VOCAB[@]}" --epochs 2
    train $OUT/eagle eagle --soft-targets --epochs 2
    ;;
chat)
    OUT=runs/smollm2-chat-heads
    train $OUT/clover clover "${VOCAB[@]}" --augment-init identity --epochs 2
    train $OUT/clp clp "${VOCAB[@]}" --epochs 2
    ;;
esac
