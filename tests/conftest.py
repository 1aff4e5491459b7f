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


DEMO_HEADS = REPO / "assets" / "demo-heads"


def speculative(method: str, k: int = 4) -> dict:
    """The speculative_config a user writes for the bundled heads ("clp-trust" uses the CLP heads)."""
    heads = DEMO_HEADS / method.removesuffix("-trust")
    return {"method": method, "model": str(heads), "num_speculative_tokens": k}


def shutdown(llm) -> None:
    """Stop the engine's processes now rather than whenever the garbage collector runs."""
    llm.llm_engine.engine_core.shutdown()


def spec_counters(llm, num_positions: int = 4) -> dict | None:
    """vLLM's spec-decode counters as LLM.get_metrics() reports them (needs
    disable_log_stats=False); None for an engine without speculative decoding."""
    found = {m.name: m for m in llm.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in found:
        return None
    per_pos = found.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return {
        "drafts": found["vllm:spec_decode_num_drafts"].value,
        "draft_tokens": found["vllm:spec_decode_num_draft_tokens"].value,
        "accepted": found["vllm:spec_decode_num_accepted_tokens"].value,
        "accepted_per_pos": list(per_pos.values) if per_pos else [0] * num_positions,
    }


def counters_since(before: dict | None, after: dict | None) -> dict | None:
    if after is None:
        return None
    return {k: [a - b for a, b in zip(v, before[k])] if isinstance(v, list) else v - before[k]
            for k, v in after.items()}


def counter(llm, name: str) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == name)
