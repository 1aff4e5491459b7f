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

    from vllm_clover.methods import TABLE
    from vllm_clover.patches import apply_all

    # A lazy "module:Class" string: vLLM imports the class only when it builds a draft. One
    # class serves every method of ours; it reads which one from the heads' config.json.
    for method in TABLE:
        if method.served_by_plugin:
            ModelRegistry.register_model(method.architecture, "vllm_clover.vllm_models:HeadsDraftModel")
    apply_all()
    _registered = True
