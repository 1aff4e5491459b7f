#!/usr/bin/env bash
# Reproduce assets/demo-heads/: self-distilled data from the demo base, then the EAGLE-1 draft,
# Clover, CLP and Medusa heads (K=4) and the Clover ablations, each scored on the held-out split.
# CLP's tau is chosen on a validation slice of the training split, never on the held-out modules.
# Resumable step by step: finished outputs are kept, a killed training run is resumed.
#   bash scripts/train_demo_heads.sh [all|eagle]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TRAIN="$PY -m vllm_clover_training.cli"
BASE=assets/demo-base
WORK=runs/demo-heads
OUT=assets/demo-heads
NUM_TRAIN=${NUM_TRAIN:-2000}
NUM_VALID=${NUM_VALID:-200}
NUM_HELDOUT=${NUM_HELDOUT:-300}
COMMON=(--base-model "$BASE" --num-heads 4 --max-len 512 --batch-size 8 --seed 0)
mkdir -p "$WORK" "$OUT"

distill() {  # distill SPLIT NUM_PROMPTS OUT: the base's own greedy continuations of the split's
    # definition prompts, i.e. what the heads will be verified against.
    [ -f "$3" ] && return
    $PY -m vllm_clover_training.stdlib_corpus --split "$1" --num-prompts "$2" --out "$3.prompts"
    $TRAIN distill --base-model "$BASE" --data "$3.prompts" --out "$3" \
        --distill-prompt-tokens 384 --distill-new-tokens 128
}
distill train $((NUM_TRAIN + NUM_VALID)) "$WORK/train-all.jsonl"
distill heldout "$NUM_HELDOUT" "$WORK/heldout.jsonl"
head -n "$NUM_TRAIN" "$WORK/train-all.jsonl" > "$WORK/train.jsonl"
tail -n +"$((NUM_TRAIN + 1))" "$WORK/train-all.jsonl" > "$WORK/valid.jsonl"

train() {  # train NAME DEST METHOD [FLAGS...]
    local name=$1 dest=$2 method=$3; shift 3
    if [ ! -f "$dest/eval-heldout.json" ]; then
        local resume=()
        [ -f "$dest.work/state.pt" ] && resume=(--resume)
        [ -f "$dest/config.json" ] || $TRAIN "$method" "${COMMON[@]}" --data "$WORK/train.jsonl" \
            --eval-data "$WORK/valid.jsonl" --out "$dest" "${resume[@]}" "$@"
        $TRAIN eval --heads "$dest" --base-model "$BASE" --data "$WORK/heldout.jsonl" \
            --out "$dest/eval-heldout.json" --max-len 512
    fi
    echo "$name: $(cat "$dest/eval-heldout.json" | $PY -c 'import json,sys; print([h["top5"] for h in json.load(sys.stdin)["per_head"]])')"
}

train eagle "$OUT/eagle" eagle --soft-targets  # the peer, served by vLLM's own EAGLE
[ "${1:-all}" = eagle ] && exit 0  # `train_demo_heads.sh eagle`: the data and the EAGLE draft only
train clover "$OUT/clover" clover
train clp "$OUT/clp" clp
train medusa "$OUT/medusa" medusa
# Figure 7a ablations: evaluated, not shipped (their weights stay in runs/).
train clover-no-augmenting "$WORK/ablations/no-augmenting-block" clover --no-augmenting-block
train clover-mlp-regressive "$WORK/ablations/mlp-regressive" clover --regressive mlp
train clover-no-regressive "$WORK/ablations/no-regressive" clover --regressive none
mkdir -p "$OUT/ablations"
for a in no-augmenting-block mlp-regressive no-regressive; do
    cp "$WORK/ablations/$a/eval-heldout.json" "$OUT/ablations/$a.json"
done
