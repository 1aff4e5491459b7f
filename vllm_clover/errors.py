"""The errors vllm-clover raises on purpose. Each names the file, field or setting at fault.

They derive from `VllmCloverError`, so a caller can tell our refusals from crashes, and
from the built-in type the standard library would use (ValueError for bad input,
RuntimeError for an environment that does not fit).
"""

from __future__ import annotations


class VllmCloverError(Exception):
    """Base of every error vllm-clover raises on purpose."""


class CheckpointError(VllmCloverError, ValueError):
    """A heads directory that cannot be used: missing, malformed, or for another base."""


class SpecConfigError(VllmCloverError, ValueError):
    """A speculative_config (or the environment it runs in) that our methods cannot serve."""


class UnsupportedVllmVersion(VllmCloverError, RuntimeError):
    """vLLM outside the one minor release the plugin is written against."""


class VllmInternalsChanged(VllmCloverError, RuntimeError):
    """A vLLM member the plugin wraps or reads is missing or has another signature."""
