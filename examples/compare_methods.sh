#!/usr/bin/env bash
# Compare plain decoding, vLLM's ngram and Medusa, Clover and CLP on the same prompts, then plot.
#   examples/compare_methods.sh [OUT_DIR] [NUM_PROMPTS] [MAX_TOKENS] [BATCH_SIZES] [more benchmarks.run flags]
# e.g. add --enforce-eager to skip torch.compile (engines start ~2x faster, run slower).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/compare}
python -m benchmarks.run --methods vanilla,ngram,medusa,clover,clp \
    --batch-sizes "${4:-1,8}" --prompts heldout --num-prompts "${2:-16}" --max-tokens "${3:-64}" \
    --out "$OUT/results.json" "${@:5}"
python -m benchmarks.plot "$OUT/results.json" --out "$OUT"
