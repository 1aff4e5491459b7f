"""Heads and base models given as Hugging Face Hub ids, resolved the way vLLM resolves its own.

Everywhere a heads or base directory is accepted (speculative_config, the training CLI, the
benchmarks), a repo id works too: `local_dir("org/clover-heads")` is the directory of its
snapshot in the Hub cache, fetched first when it is not there. As in vLLM's weight loader,
that is `huggingface_hub.snapshot_download` with the revision asked for, the cache
(`HF_HUB_CACHE`, or vLLM's `--download-dir`), `HF_HUB_OFFLINE` read at call time (offline:
only the cache, never the network), and the token from the environment (`HF_TOKEN`).

A path that exists is always used as it is, so local directories work exactly as before.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_clover.errors import CheckpointError

# What a heads or base directory holds that we or vLLM read: configs, tokenizer files and
# safetensors weights; not the other weight formats a model repo may also carry.
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.md")


def is_hub_id(model: str | os.PathLike) -> bool:
    """True for a string that is no existing path but has the form of a repo id
    ("name" or "org/name"); paths like "/x/y" or "a/b/c" never are."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(model, str) or os.path.exists(model):
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def local_dir(model: str | os.PathLike, what: str, revision: str | None = None,
              cache_dir: str | None = None, files: tuple[str, ...] = MODEL_FILES) -> Path:
    """The local directory of `model`: itself when it is a path (existing or not: the caller's
    own checks then name what is missing), else the Hub snapshot of that repo id, holding at
    least its `files` (patterns)."""
    if not is_hub_id(model):
        return Path(model)
    import huggingface_hub
    from huggingface_hub import constants, errors

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(huggingface_hub.snapshot_download(
            model, revision=revision, cache_dir=cache_dir, allow_patterns=list(files),
            local_files_only=offline))
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{what} {model!r}: the Hugging Face Hub repo has no revision {revision!r}") from None
    except errors.RepositoryNotFoundError:  # also a gated repo without access
        raise CheckpointError(f"{what} {model!r} is neither a local directory nor a Hugging Face Hub repo "
                              "this token can read (private or gated repos need HF_TOKEN)") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        where = cache_dir or constants.HF_HUB_CACHE
        reason = ("HF_HUB_OFFLINE is set and it is not in the Hub cache" if offline else
                  "it is not in the Hub cache and the Hub could not be reached")
        raise CheckpointError(f"{what} {model!r} is not a local directory, and as a Hugging Face Hub id "
                              f"{reason} ({where}, revision {revision or 'main'})") from None
    except errors.HfHubHTTPError as e:
        raise CheckpointError(f"{what} {model!r}: fetching it from the Hugging Face Hub failed: {e}") from None


def snapshot_revision(directory: Path) -> str | None:
    """The commit a Hub-cache snapshot directory holds (its name), None for other directories."""
    return directory.name if directory.parent.name == "snapshots" else None
