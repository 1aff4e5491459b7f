"""Shared fixtures: real vLLM engines on the bundled demo model, one per test module.

Engine start costs ~20 s on 2 cores, so engines are module-scoped and every test in a
module shares one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Overridable so a candidate model can be checked before it replaces the bundled one.
DEMO_BASE = Path(os.environ.get("VLLM_CLOVER_TEST_BASE", REPO / "assets" / "demo-base"))

# fp32 so vLLM and transformers can be compared token for token; eager and a small KV
# cache because this is a 2-core, no-GPU machine.
ENGINE_DEFAULTS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=1024,
    seed=0,
    kv_cache_memory_bytes=256 << 20,
)


@pytest.fixture(scope="session")
def demo_base() -> Path:
    if not (DEMO_BASE / "config.json").exists():
        pytest.fail(f"demo base model missing at {DEMO_BASE}; see assets/demo-base/README.md")
    return DEMO_BASE


def make_llm(model: Path, **overrides):
    from vllm import LLM

    return LLM(model=str(model), **{**ENGINE_DEFAULTS, **overrides})
