#!/usr/bin/env bash
# The SmolLM2-135M-Instruct benchmarks of the README (run with nothing else on the machine):
#   validation: served acceptance on prompts like the training data, to set against the heads'
#               teacher-forced evals (eval.json's greedy_acceptance);
#   spec-bench: Spec-Bench's six tasks round robin, batch 1 / 4 / 16 / 64, every method side by side.
# (Clover against the EAGLE-1 peer: scripts/benchmark_peer.sh.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BASE=runs/smollm2-135m-instruct
OUT=benchmarks/results/smollm2
COMMON=(--base-model "$BASE" --heads-dir assets/smollm2-heads --max-tokens 96 --max-model-len 2048
        --kv-cache-mb 4096 --enforce-eager)
[ -f "$BASE/config.json" ] || make real-base
mkdir -p "$OUT"

case "${1:-spec-bench}" in
validation)
    $PY -m benchmarks.run "${COMMON[@]}" --methods medusa,clover,clp --batch-sizes 1 --num-prompts 8 \
        --prompts assets/smollm2-data/validation.jsonl --out "$OUT/validation.json"
    ;;
spec-bench)
    $PY -m benchmarks.run "${COMMON[@]}" --methods vanilla,ngram,medusa,clover,clp --batch-sizes 1,4,16,64 \
        --num-prompts 18,24,48,128 --prompts ../shared/data/spec_bench_questions.jsonl --out "$OUT/results.json"
    $PY -m benchmarks.plot "$OUT/results.json" --out "$OUT"
    $PY -m benchmarks.report "$OUT/results.json" --readme README.md --section smollm2-results
    ;;
esac
