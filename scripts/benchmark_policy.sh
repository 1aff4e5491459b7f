#!/usr/bin/env bash
# Draft-length policies side by side (issue: speculation that never costs): vanilla, and
# Clover and CLP with the goodput policy (default) and the fixed one, batch 1 to 64 (and 128 on
# the demo base), every engine loaded at once and measured in interleaved rounds; a second
# plain engine, loaded last, shows how far two identical engines differ. Run with
# nothing else on the machine:
#   scripts/benchmark_policy.sh demo      # demo base, compiled engines, held-out prompts
#   scripts/benchmark_policy.sh smollm2   # SmolLM2-135M-Instruct, eager engines, Spec-Bench
# Writes benchmarks/results/policy/TARGET.json (and the plots next to it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=${1:?demo or smollm2}
OUT=benchmarks/results/policy
mkdir -p "$OUT"
COMMON=(--methods vanilla,clover,clover-fixed,clp,clp-fixed,vanilla-2 --max-tokens 64 --out "$OUT/$TARGET.json")
case "$TARGET" in
demo)
    $PY -m benchmarks.run "${COMMON[@]}" --batch-sizes 1,4,16,64,128 --prompts heldout --num-prompts 16,32,64,128,256 \
        --rounds 3
    ;;
smollm2)
    [ -f runs/smollm2-135m-instruct/config.json ] || make real-base
    $PY -m benchmarks.run "${COMMON[@]}" --base-model runs/smollm2-135m-instruct --heads-dir assets/smollm2-heads \
        --batch-sizes 1,4,16,64 --prompts ../shared/data/spec_bench_questions.jsonl --num-prompts 8,16,32,64 --rounds 2 \
        --max-model-len 2048 --kv-cache-mb 1536 --enforce-eager
    ;;
*)
    echo "usage: $0 demo|smollm2" >&2
    exit 2
    ;;
esac
$PY -m benchmarks.plot "$OUT/$TARGET.json"
