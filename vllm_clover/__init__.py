"""vllm-clover: Clover and CLP speculative decoding as a vLLM 0.32 plugin.

vLLM imports `register` through the `vllm.general_plugins` entry point in every process
it starts (API server, engine core, workers, the model-registry probe), so it must be
cheap and idempotent, and it is where the version pin is enforced: the draft
architectures are registered and the patches (patches.py) applied only after it.
"""

from __future__ import annotations

from vllm_clover.version import SUPPORTED_VLLM, check_vllm_version

__all__ = ["register", "check_vllm_version", "SUPPORTED_VLLM"]

_registered = False


def register() -> None:
    """Entry point for `vllm.general_plugins`. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm import ModelRegistry

    from vllm_clover.patches import apply_all

    # Lazy "module:Class" strings: vLLM imports the class only when it builds a draft.
    for arch in ("CloverDraftModel", "ClpDraftModel"):
        ModelRegistry.register_model(arch, f"vllm_clover.vllm_models:{arch}")
    apply_all()
    _registered = True
