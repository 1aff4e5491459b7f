"""Training data for the heads: JSONL in three shapes, tokenised and packed.

    {"text": "..."}                                           plain text
    {"messages": [{"role": "user", "content": "..."}, ...]}   chat (OpenAI style)
    {"conversations": [{"from": "human", "value": "..."}]}    ShareGPT

A line that is none of these stops the run with the file, the line number and what
was wrong. Nothing is skipped silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_clover.errors import VllmCloverError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
CHAT_ROLES = {"system", "user", "assistant"}


class DataError(VllmCloverError, ValueError):
    """Training, evaluation or benchmark data that cannot be read; names file and line."""


@dataclass(frozen=True)
class Record:
    source: str                     # "file.jsonl:12", for error messages
    text: str | None = None
    messages: tuple[dict, ...] | None = None


def iter_jsonl(path: Path):
    """("file:line", object) for every non-blank line; one DataError naming the line if a
    line is not a JSON object."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, found {type(obj).__name__}")
            yield where, obj


def _record(obj: dict, where: str) -> Record:
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise DataError(f"{where}: field 'text' must be a non-empty string")
        return Record(where, text=obj["text"])
    if "messages" in obj:
        return Record(where, messages=_chat_messages(obj["messages"], where))
    if "conversations" in obj:
        return Record(where, messages=_sharegpt_messages(obj["conversations"], where))
    raise DataError(f"{where}: expected a 'text', 'messages' or 'conversations' field, found "
                    f"{sorted(obj)[:5]}")


def _chat_messages(messages, where: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] must be {{'role': one of {sorted(CHAT_ROLES)}, "
                            f"'content': string}}, found {str(m)[:80]}")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def _sharegpt_messages(turns, where: str) -> tuple[dict, ...]:
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field 'conversations' must be a non-empty list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("from") not in SHAREGPT_ROLES or not isinstance(t.get("value"), str):
            raise DataError(f"{where}: conversations[{i}] must be {{'from': one of {sorted(SHAREGPT_ROLES)}, "
                            f"'value': string}}, found {str(t)[:80]}")
        out.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    return tuple(out)


def read_jsonl(path: Path) -> list[Record]:
    records = [_record(obj, where) for where, obj in iter_jsonl(path)]
    if not records:
        raise DataError(f"{path}: no records")
    return records


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _render_chat(messages, tokenizer, add_generation_prompt: bool) -> list[int]:
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                                 add_generation_prompt=add_generation_prompt)
        return list(rendered["input_ids"])
    # A base model without a template: a plain transcript it can continue.
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    if add_generation_prompt:
        text += "assistant: "
    return tokenizer(text).input_ids


def chat_prompt_ids(tokenizer, user_message: str) -> list[int]:
    """One user turn rendered for generation (the chat template, or a plain transcript)."""
    return _render_chat([{"role": "user", "content": user_message}], tokenizer, add_generation_prompt=True)


def tokenize(record: Record, tokenizer) -> list[int]:
    if record.text is not None:
        return tokenizer(record.text).input_ids
    return _render_chat(record.messages, tokenizer, add_generation_prompt=False)


def prompt_ids(record: Record, tokenizer, prompt_tokens: int) -> list[int]:
    """What self-distillation continues: a text's first `prompt_tokens` tokens, or a chat up
    to (not including) its last assistant turn, with the generation prompt."""
    if record.text is not None:
        return tokenizer(record.text).input_ids[:prompt_tokens]
    messages = list(record.messages)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise DataError(f"{record.source}: a chat needs a non-assistant turn to prompt with")
    return _render_chat(messages, tokenizer, add_generation_prompt=True)


def pack(sequences: list[list[int]], max_len: int, eos_id: int) -> torch.Tensor:
    """Concatenate with EOS between sequences and cut into [N, max_len] windows (the tail
    shorter than one window is dropped)."""
    stream = [t for seq in sequences for t in (*seq, eos_id)]
    n = len(stream) // max_len
    if n == 0:
        raise DataError(f"the data has {len(stream)} tokens, fewer than one window of --max-len {max_len}")
    return torch.tensor(stream[: n * max_len], dtype=torch.long).view(n, max_len)


def packed_files(paths: list[Path], tokenizer, max_len: int) -> torch.Tensor:
    """Every record of every file, tokenised as is and packed into windows."""
    return pack([tokenize(r, tokenizer) for p in paths for r in read_jsonl(p)], max_len, tokenizer.eos_token_id)
