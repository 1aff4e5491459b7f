"""The heads checkpoint: one directory that the trainer writes and vLLM loads as it is.

    config.json        method, K, hyper-parameters, and the fingerprint of the base model
    model.safetensors  only the new weights (the base's LM head etc. are taken at load time)
    provenance.json    how it was made: commit, versions, command line, data hashes, metrics

config.json is read by vLLM's `MedusaConfig`, which renames every top-level key that
contains "num" and "heads" (or "layers") to num_heads (num_hidden_layers). So the
top level holds only what vLLM reads, and everything of ours sits under "vllm_clover".
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from vllm_clover.atomic import atomic_dir
from vllm_clover.draft_policy import CONFIDENCE_BINS
from vllm_clover.errors import CheckpointError
from vllm_clover.methods import BY_NAME, DraftHeads, DraftMethod, method_named

CONFIG, WEIGHTS, PROVENANCE = "config.json", "model.safetensors", "provenance.json"
CALIBRATION = "calibration.json"  # acceptance per draft position and confidence (eval --calibrate): the policy's prior


def _base_config(base_dir: Path) -> dict:
    path = Path(base_dir) / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"base model config not found: {path}") from None


@contextmanager
def readable_safetensors(path: Path):
    """safe_open(path), with one error naming the file when it is not a whole safetensors
    file (truncated, corrupt) rather than the library's, which names neither."""
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def _weight_files(base_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it (single file or sharded with an index)."""
    base_dir = Path(base_dir)
    index = base_dir / "model.safetensors.index.json"
    if index.exists():
        return {name: base_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
    single = base_dir / WEIGHTS
    if not single.exists():
        raise CheckpointError(f"no safetensors weights in base model directory {base_dir}")
    with readable_safetensors(single) as f:
        return {name: single for name in f.keys()}


def read_base_tensor(base_dir: Path, name: str) -> torch.Tensor:
    files = _weight_files(base_dir)
    if name not in files:
        raise CheckpointError(f"tensor {name!r} not found in base model {base_dir}")
    with readable_safetensors(files[name]) as f:
        return f.get_tensor(name)


def lm_head_name(base_dir: Path) -> str:
    """The base's output projection; with tied embeddings it is the input embedding."""
    tied = _base_config(base_dir).get("tie_word_embeddings", False)
    return "model.embed_tokens.weight" if tied else "lm_head.weight"


def base_fingerprint(base_dir: Path) -> dict:
    """What heads depend on. The LM-head hash is of the file's bytes, so it does not change
    with the dtype the base is later served in."""
    cfg = _base_config(base_dir)
    lm_head = read_base_tensor(base_dir, lm_head_name(base_dir))
    return {
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "lm_head_sha256": hashlib.sha256(lm_head.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
    }


def check_fingerprint(heads_dir: Path, expected: dict, base_dir: Path) -> None:
    found = base_fingerprint(base_dir)
    for field, want in expected.items():
        if found.get(field) != want:
            raise CheckpointError(
                f"heads in {heads_dir} were trained for another base model: {field} is {want!r} in "
                f"{heads_dir / CONFIG} but {found.get(field)!r} in {base_dir}"
            )


def save_heads(out_dir: Path, method: DraftMethod, heads: DraftHeads, base_dir: Path, provenance: dict,
               extra_files: dict[str, str] | None = None, dtype: torch.dtype | None = None) -> None:
    """Write the three files into `out_dir` atomically (a reader never sees a mix). With
    `dtype`, floating-point tensors are stored in it (e.g. bf16 to ship heads at half size;
    loading casts them to whatever dtype the model runs in)."""
    base = _base_config(base_dir)
    medusa_typed = {
        "model_type": "medusa",  # vLLM routes medusa-typed drafts to the registered architecture
        "architectures": [method.architecture],
        "hidden_size": base["hidden_size"],
        "vocab_size": base["vocab_size"],
        "num_heads": heads.num_heads,
        "n_predict": heads.num_heads,
        "num_hidden_layers": 1,
    }
    config = {
        **(medusa_typed if method.medusa_typed else {}),
        **heads.vllm_config(),
        "vllm_clover": {"method": method.name, "hyper": heads.checkpoint_hyper(),
                        "base": base_fingerprint(base_dir)},
    }
    tensors = heads.checkpoint_tensors()
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    with atomic_dir(Path(out_dir)) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / WEIGHTS)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)


def load_heads(heads_dir: Path, base_dir: Path | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, weights). With `base_dir`, refuse heads made for another base."""
    heads_dir = Path(heads_dir)
    try:
        config = json.loads((heads_dir / CONFIG).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no {CONFIG} in heads directory {heads_dir}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{heads_dir / CONFIG} is not valid JSON: {e}") from None
    ours = config.get("vllm_clover")
    if not isinstance(ours, dict) or ours.get("method") not in BY_NAME:
        raise CheckpointError(f"{heads_dir / CONFIG} has no vllm_clover.method (one of {', '.join(BY_NAME)}); "
                              "was it written by vllm-clover-train?")
    if not (heads_dir / WEIGHTS).exists():
        raise CheckpointError(f"no {WEIGHTS} in heads directory {heads_dir}")
    if base_dir is not None:
        check_fingerprint(heads_dir, ours["base"], base_dir)
    with readable_safetensors(heads_dir / WEIGHTS) as f:
        return config, {name: f.get_tensor(name) for name in f.keys()}


def read_calibration(heads_dir: Path, num_positions: int) -> dict | None:
    """calibration.json of a heads directory (draft_policy.calibration_counts), checked: None
    when the heads have none; one error naming the file and what is wrong otherwise."""
    path = Path(heads_dir) / CALIBRATION
    if not path.exists():
        return None
    try:
        calibration = json.loads(path.read_text())
        shapes = {key: np.asarray(calibration[key], dtype=np.float64).shape for key in ("tried", "accepted")}
        bins = calibration["confidence_bins"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is not a calibration table (confidence_bins, tried, accepted): "
                              f"{type(e).__name__}: {e}") from None
    expected = (num_positions, CONFIDENCE_BINS)
    if bins != CONFIDENCE_BINS or any(shape != expected for shape in shapes.values()):
        raise CheckpointError(f"{path}: expected tried and accepted of shape {expected} ({num_positions} draft "
                              f"positions x {CONFIDENCE_BINS} confidence bins), found {shapes} with "
                              f"confidence_bins {bins}")
    return calibration


def build_heads_module(heads_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> DraftHeads:
    """The vLLM-free heads module a checkpoint describes, with its weights loaded."""
    method = method_named(config["vllm_clover"]["method"], str(Path(heads_dir) / CONFIG))
    module = method.heads.from_checkpoint(config)
    check_tensors(heads_dir, tensors, checkpoint_shapes(module))
    module.load_checkpoint_tensors(tensors)
    return module


def checkpoint_shapes(heads: DraftHeads) -> dict[str, torch.Size]:
    return {name: t.shape for name, t in heads.checkpoint_tensors().items()}


def check_tensors(heads_dir: Path, found: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> None:
    """Every expected tensor present with its shape, and nothing else."""
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"tensor {name!r} missing from {heads_dir / WEIGHTS}")
        if tuple(found[name].shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {heads_dir / WEIGHTS} has shape "
                                  f"{tuple(found[name].shape)}, expected {tuple(shape)}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensors in {heads_dir / WEIGHTS}: {unexpected[:5]}")
