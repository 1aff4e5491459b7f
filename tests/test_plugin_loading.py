"""vLLM finds the plugin through its entry point, and the plugin guards its vLLM version."""

from __future__ import annotations

import subprocess
import sys

import pytest
import vllm

import vllm_clover
from vllm_clover.version import UnsupportedVllmVersion, check_vllm_version


def test_vllm_loads_plugin_through_entry_point():
    # A fresh interpreter: vLLM loads general plugins once per process.
    code = (
        "import vllm_clover\n"
        "assert not vllm_clover._registered\n"
        "from vllm.plugins import load_general_plugins, load_plugins_by_group\n"
        "assert 'clover' in load_plugins_by_group('vllm.general_plugins')\n"
        "load_general_plugins()\n"
        "assert vllm_clover._registered\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_is_idempotent():
    vllm_clover.register()
    vllm_clover.register()
    assert vllm_clover._registered


@pytest.mark.parametrize("found", ["0.32.0", "0.32.7", "0.32.0+cpu", "0.32.1rc1"])
def test_supported_versions_pass(found):
    check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.31.2", "0.33.0", "1.32.0", "0.3.2", "0.320.0"])
def test_other_versions_refused_naming_both(found):
    with pytest.raises(UnsupportedVllmVersion) as err:
        check_vllm_version(found)
    assert f"vLLM {found} is installed" in str(err.value)
    assert "0.32.x" in str(err.value)


def test_register_refuses_wrong_installed_vllm(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    monkeypatch.setattr(vllm_clover, "_registered", False)
    with pytest.raises(UnsupportedVllmVersion, match=r"vLLM 0\.33\.1 is installed"):
        vllm_clover.register()
    assert not vllm_clover._registered
