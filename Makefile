# The two commands in the README: `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo test demo-base clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m benchmarks.demo

test: setup
	$(PY) -m pytest

# Retrains the bundled base model from scratch (about 75 minutes on 2 cores); resumable.
demo-base: setup
	$(PY) -m vllm_clover_training.demo_base --out assets/demo-base --work-dir runs/demo-base

clean:
	rm -rf .venv runs .pytest_cache
