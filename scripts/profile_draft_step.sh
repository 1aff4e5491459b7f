#!/usr/bin/env bash
# Where a draft step's time goes (issue: a draft step that costs what its arithmetic costs).
# Run with nothing else on the machine:
#   scripts/profile_draft_step.sh demo LABEL      # demo base, compiled engines (as the README's sweep)
#   scripts/profile_draft_step.sh smollm2 LABEL   # SmolLM2-135M-Instruct, eager engines, Spec-Bench
# Every method's engine is loaded at once and measured in interleaved rounds (benchmarks.run
# --rounds), batch 1 and 16, with --profile; writes benchmarks/results/profile/TARGET-LABEL.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=${1:?demo or smollm2}
LABEL=${2:?a label for the results file, e.g. before or after}
OUT=benchmarks/results/profile
mkdir -p "$OUT"
COMMON=(--methods vanilla,medusa,clover,clp --batch-sizes 1,16 --max-tokens 64 --rounds 3 --profile
        --out "$OUT/$TARGET-$LABEL.json")
case "$TARGET" in
demo)
    $PY -m benchmarks.run "${COMMON[@]}" --prompts heldout --num-prompts 16,48
    ;;
smollm2)
    [ -f runs/smollm2-135m-instruct/config.json ] || make real-base
    $PY -m benchmarks.run "${COMMON[@]}" --base-model runs/smollm2-135m-instruct --heads-dir assets/smollm2-heads \
        --prompts ../shared/data/spec_bench_questions.jsonl --num-prompts 8,32 --max-model-len 2048 \
        --kv-cache-mb 1536 --enforce-eager
    ;;
*)
    echo "usage: $0 demo|smollm2 LABEL" >&2
    exit 2
    ;;
esac
