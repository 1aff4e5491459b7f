#!/usr/bin/env bash
# Draft-length policies side by side (issue: speculation that never costs): vanilla, and
# Clover and CLP with the goodput policy (default) and the fixed one, batch 1 / 4 / 16 / 64,
# in rounds (the demo base 9, three per loading of the engines; SmolLM2 4, two per loading),
# engines loaded anew (in rotated order) and warmed at every batch size; a second plain engine
# shows how far two identical engines differ. Run with nothing else on the machine (SmolLM2
# ~86 min, the demo base ~30):
#   scripts/benchmark_policy.sh demo [OUT.json]      # demo base, compiled engines, held-out prompts
#   scripts/benchmark_policy.sh smollm2 [OUT.json]   # SmolLM2-135M-Instruct, eager engines, Spec-Bench
# Writes OUT.json (default benchmarks/results/policy/TARGET.json) and the plots next to it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=${1:?demo or smollm2}
OUT=benchmarks/results/policy
mkdir -p "$OUT"
RESULTS=${2:-$OUT/$TARGET.json}
COMMON=(--methods vanilla,clover,clover-fixed,clp,clp-fixed,vanilla-2 --fresh-engines --profile --max-tokens 64
        --out "$RESULTS" --batch-sizes 1,4,16,64)
case "$TARGET" in
demo)
    $PY -m benchmarks.run "${COMMON[@]}" --rounds 9 --rounds-per-load 3 --prompts heldout --num-prompts 16,32,64,128
    ;;
smollm2)
    [ -f runs/smollm2-135m-instruct/config.json ] || make real-base
    $PY -m benchmarks.run "${COMMON[@]}" --rounds 4 --rounds-per-load 2 --base-model runs/smollm2-135m-instruct --heads-dir assets/smollm2-heads \
        --prompts ../shared/data/spec_bench_questions.jsonl --num-prompts 8,16,32,64 \
        --max-model-len 2048 --kv-cache-mb 1536 --enforce-eager
    ;;
*)
    echo "usage: $0 demo|smollm2" >&2
    exit 2
    ;;
esac
$PY -m benchmarks.plot "$RESULTS"
