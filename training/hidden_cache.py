"""The frozen base's hidden states for every training window, computed once and memory-mapped.

On a real target the base's forward is most of a training step (SmolLM2-135M: ~630 tokens/s
forward on 2 cores, the heads several times faster), and every epoch and every method reads
the same states: EAGLE trainers call this "offline" training (SpecForge). Stored in bf16
(0.7 GB for 600k tokens at hidden 576), keyed by the base's fingerprint and the windows'
token ids, filled in chunks that survive an interrupted run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from vllm_clover.atomic import atomic_write_text
from vllm_clover_training.base import FrozenBase
from vllm_clover_training.data import Windows


def hidden_state_cache(base: FrozenBase, base_fingerprint: dict, windows: Windows, path: Path,
                       batch_size: int) -> torch.Tensor:
    """[N, T, H] bf16, backed by PATH.bin (PATH.json holds its key and how far it is filled).
    Reused when base and windows match; rebuilt when either changed."""
    n, length = windows.ids.shape
    shape = (n, length, base.config.hidden_size)
    key = {"base": base_fingerprint, "base_dtype": str(base.lm_head_weight.dtype), "shape": list(shape),
           "dtype": "bfloat16",
           "windows_sha256": hashlib.sha256(windows.ids.numpy().tobytes()).hexdigest()}
    meta_path, data_path = Path(f"{path}.json"), Path(f"{path}.bin")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta is None or meta["key"] != key or not data_path.exists():
        data_path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"key": key, "done": 0}
        np.memmap(data_path, dtype=np.uint16, mode="w+", shape=shape).flush()  # bf16 bits as uint16
        atomic_write_text(meta_path, json.dumps(meta))
    stored = np.memmap(data_path, dtype=np.uint16, mode="r+", shape=shape)
    for start in tqdm(range(meta["done"], n, batch_size), desc="base hidden states", disable=meta["done"] >= n):
        h = base.hidden_states(windows.ids[start : start + batch_size]).to(torch.bfloat16)
        stored[start : start + len(h)] = h.view(torch.uint16).numpy()
        stored.flush()
        meta["done"] = start + len(h)
        atomic_write_text(meta_path, json.dumps(meta))
    # Copy-on-write: torch wants a writable array; the file is never written through it.
    return torch.from_numpy(np.memmap(data_path, dtype=np.uint16, mode="c", shape=shape)).view(torch.bfloat16)
