#!/usr/bin/env bash
# Clover (goodput policy and fixed K) against the EAGLE-1 draft trained on the same data and
# served by vLLM's own EAGLE (issue: the peer to beat), with plain decoding: K = 4, batch 1 and 4,
# every engine loaded at once, interleaved rounds. Run with nothing else on the machine:
#   scripts/benchmark_peer.sh demo      # demo base, compiled engines, held-out prompts
#   scripts/benchmark_peer.sh smollm2   # SmolLM2-135M-Instruct, eager engines, Spec-Bench
# Writes benchmarks/results/peer.json (demo) or benchmarks/results/smollm2/peer.json, their plots,
# and the README section TARGET-peer.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TARGET=${1:?demo or smollm2}
case "$TARGET" in demo) RESULTS=benchmarks/results/peer.json ;; *) RESULTS=benchmarks/results/$TARGET/peer.json ;; esac
COMMON=(--methods vanilla,clover,clover-fixed,eagle --batch-sizes 1,4 --rounds 2 --out "$RESULTS")
case "$TARGET" in
demo)
    $PY -m benchmarks.run "${COMMON[@]}" --max-tokens 64 --prompts heldout --num-prompts 16,32
    ;;
smollm2)
    [ -f runs/smollm2-135m-instruct/config.json ] || make real-base
    $PY -m benchmarks.run "${COMMON[@]}" --base-model runs/smollm2-135m-instruct --heads-dir assets/smollm2-heads \
        --max-tokens 96 --num-prompts 18,24 --prompts ../shared/data/spec_bench_questions.jsonl \
        --max-model-len 2048 --kv-cache-mb 1536 --enforce-eager
    ;;
*)
    echo "usage: $0 demo|smollm2" >&2
    exit 2
    ;;
esac
$PY -m benchmarks.plot "$RESULTS"
$PY -m benchmarks.report "$RESULTS" --readme README.md --section "$TARGET-peer"
