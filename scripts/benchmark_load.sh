#!/usr/bin/env bash
# Draft-length policies under a load that ramps up and down (issue: speculation that never
# costs): `vllm serve` with vanilla, Clover (goodput policy) and Clover with the fixed rule,
# one server after the other, the same open-loop arrivals and prompts. Run with nothing
# else on the machine:
#   scripts/benchmark_load.sh demo      # demo base, compiled, held-out prompts
#   scripts/benchmark_load.sh smollm2   # SmolLM2-135M-Instruct, eager, Spec-Bench
# Writes benchmarks/results/policy/TARGET-load.json (server logs next to it, not committed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=${1:?demo or smollm2}
OUT=benchmarks/results/policy
mkdir -p "$OUT"
COMMON=(--methods vanilla,clover,clover-fixed --max-tokens 64 --out "$OUT/$TARGET-load.json")
case "$TARGET" in
demo)
    $PY -m benchmarks.load "${COMMON[@]}" --rates 2,8,24,48,24,8,2 --phase-seconds 15
    ;;
smollm2)
    [ -f runs/smollm2-135m-instruct/config.json ] || make real-base
    $PY -m benchmarks.load "${COMMON[@]}" --base-model runs/smollm2-135m-instruct --heads-dir assets/smollm2-heads \
        --prompts ../shared/data/spec_bench_questions.jsonl --num-prompts 80 --rates 0.2,0.5,1,2,1,0.5,0.2 \
        --phase-seconds 30 --max-model-len 2048 --kv-cache-mb 1536 --enforce-eager
    ;;
*)
    echo "usage: $0 demo|smollm2" >&2
    exit 2
    ;;
esac
