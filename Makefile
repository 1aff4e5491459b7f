# The two commands in the README: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo test demo-base demo-heads clean

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

clean:
	rm -rf .venv runs .pytest_cache
