"""Training data for the heads: records in three shapes, tokenised and packed.

    {"text": "..."}                                           plain text
    {"messages": [{"role": "user", "content": "..."}, ...]}   chat (OpenAI style)
    {"conversations": [{"from": "human", "value": "..."}]}    ShareGPT

A file holds one record per line (JSON Lines) or one JSON array of records (how ShareGPT's
own `ShareGPT_V3_unfiltered_cleaned_split.json` comes). A Hugging Face dataset works too
(read with `datasets`): a `save_to_disk` directory, a dataset repo's directory of Parquet
(or JSON, CSV) files as `datasets.load_dataset` reads it, or one Parquet file; `split`
picks one of its splits, and `field` names the column holding each record's text,
messages or ShareGPT conversations when the rows are not records already. A record that is
none of these stops the run with the file, the line (or array index, or split and row) and
what was wrong. Nothing is skipped silently.
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


def iter_records(path: Path, split: str | None = None, field: str | None = None):
    """("where", object) for every record of a data file or dataset: "file:line" for JSON
    Lines, "file[index]" for a JSON array, "dataset[split][row]" for a Hugging Face dataset;
    one DataError naming the place if a record is not a JSON object. With `field`, each
    record is that column's value, as the record its type makes it (module docstring)."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".parquet":
        records = _dataset_records(path, split)
    elif not path.is_file():
        raise DataError(f"data file not found: {path}")
    else:
        with open(path, encoding="utf-8") as f:
            starts_an_array = f.read(4096).lstrip().startswith("[")
        records = _array_records(path) if starts_an_array else _line_records(path)
    for where, obj in records:
        yield where, obj if field is None else _field_record(obj, field, where)


def _field_record(obj: dict, field: str, where: str) -> dict:
    if field not in obj:
        raise DataError(f"{where}: no field {field!r} (--data-field); it has {sorted(obj)[:8]}")
    value = obj[field]
    if isinstance(value, str):
        return {"text": value}
    sharegpt = isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "from" in value[0]
    return {"conversations": value} if sharegpt else {"messages": value}


def _dataset_records(path: Path, split: str | None):
    """Rows of a Hugging Face dataset as ("dataset[split][row]", row)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a Hugging Face dataset needs the `datasets` package "
                        "(pip install 'vllm-clover[train]')") from None
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))  # written by save_to_disk
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        else:
            loaded = datasets.load_dataset("parquet", data_files=str(path))
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise DataError(f"{path}: not a readable Hugging Face dataset: {e}") from None
    name = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split is None and len(loaded) > 1:
            raise DataError(f"{path} holds the splits {sorted(loaded)}: choose one with --data-split")
        split = split or next(iter(loaded))
        if split not in loaded:
            raise DataError(f"{path} has no split {split!r}; it has {sorted(loaded)}")
        loaded, name = loaded[split], f"{path}[{split}]"
    for index, row in enumerate(loaded):
        yield f"{name}[{index}]", row


def _array_records(path: Path):
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    for index, obj in enumerate(records):
        where = f"{path}[{index}]"
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, found {type(obj).__name__}")
        yield where, obj


def _line_records(path: Path):
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


def parse_record(obj: dict, where: str) -> Record:
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


def read_records(path: Path, split: str | None = None, field: str | None = None) -> list[Record]:
    records = [parse_record(obj, where) for where, obj in iter_records(path, split, field)]
    if not records:
        raise DataError(f"{path}: no records")
    return records


def data_sha256(path: Path) -> str:
    """Of a file's bytes; of a dataset directory, of every file's name and bytes."""
    path = Path(path)
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for file in sorted(f for f in path.rglob("*") if f.is_file()):
        digest.update(f"{file.relative_to(path)}\0{data_sha256(file)}\0".encode())
    return digest.hexdigest()


def _render_chat(messages, tokenizer, add_generation_prompt: bool) -> list[int]:
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                                 add_generation_prompt=add_generation_prompt)
        return list(rendered["input_ids"])
    return _transcript(messages, tokenizer, add_generation_prompt).ids


@dataclass(frozen=True)
class Tokens:
    """A tokenised record, and which of its tokens the heads are trained and scored on."""

    ids: list[int]
    loss_mask: list[int]   # 1: a label to learn (all of a text; a chat's assistant answers)


def _transcript(messages, tokenizer, add_generation_prompt: bool) -> Tokens:
    """A base model without a chat template: a plain transcript it can continue. Pieces are
    encoded one by one, so an answer's tokens are the same wherever it stands."""
    ids, mask = list(tokenizer("").input_ids), []  # the tokenizer's own prefix (BOS), if any
    mask += [0] * len(ids)
    for m in messages:
        head = tokenizer(f"{m['role']}: ", add_special_tokens=False).input_ids
        body = tokenizer(f"{m['content']}\n", add_special_tokens=False).input_ids
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    if add_generation_prompt:
        ids += tokenizer("assistant: ", add_special_tokens=False).input_ids
    return Tokens(ids, mask + [0] * (len(ids) - len(mask)))


def _chat_tokens(record: Record, tokenizer) -> Tokens:
    """The chat through its template, with the loss on each assistant answer up to and
    including the end-of-turn token the model itself generates (not what the template adds
    after it)."""
    messages = list(record.messages)
    if not tokenizer.chat_template:
        return _transcript(messages, tokenizer, add_generation_prompt=False)
    ids = _render_chat(messages, tokenizer, add_generation_prompt=False)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render_chat(messages[:i], tokenizer, add_generation_prompt=True))
        through_answer = _render_chat(messages[: i + 1], tokenizer, add_generation_prompt=False)
        end = len(through_answer)
        if ids[:end] != through_answer:
            raise DataError(f"{record.source}: the chat template renders turn {i} differently inside the "
                            "whole chat; cannot tell which tokens are the answer")
        span = ids[start:end]
        stop = span.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in span else len(span)
        mask[start : start + stop] = [1] * stop
    return Tokens(ids, mask)


def chat_prompt_ids(tokenizer, user_message: str) -> list[int]:
    """One user turn rendered for generation (the chat template, or a plain transcript)."""
    return _render_chat([{"role": "user", "content": user_message}], tokenizer, add_generation_prompt=True)


def tokenize(record: Record, tokenizer) -> Tokens:
    if record.text is not None:
        ids = tokenizer(record.text).input_ids
        return Tokens(ids, [1] * len(ids))
    return _chat_tokens(record, tokenizer)


def prompt_turns(record: Record) -> list[dict]:
    """A chat without its trailing assistant turns: what the model is asked to answer."""
    messages = list(record.messages)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages


def prompt_ids(record: Record, tokenizer, prompt_tokens: int) -> list[int]:
    """What self-distillation continues: a text's first `prompt_tokens` tokens, or a chat up
    to (not including) its last assistant turn, with the generation prompt."""
    if record.text is not None:
        return tokenizer(record.text).input_ids[:prompt_tokens]
    messages = prompt_turns(record)
    if not messages:
        raise DataError(f"{record.source}: a chat needs a non-assistant turn to prompt with")
    return _render_chat(messages, tokenizer, add_generation_prompt=True)


@dataclass(frozen=True)
class Windows:
    """Packed training windows: token ids and loss mask, both [N, max_len]."""

    ids: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index) -> Windows:
        return Windows(self.ids[index], self.loss_mask[index])


def pack(sequences: list[Tokens], max_len: int, eos_id: int) -> Windows:
    """Concatenate with EOS between sequences and cut into [N, max_len] windows (the tail
    shorter than one window is dropped). The separator is learned after a text (the model
    ends it) but not after a chat (the answer already ended with its own end token)."""
    ids, mask = [], []
    for seq in sequences:
        ids += [*seq.ids, eos_id]
        mask += [*seq.loss_mask, seq.loss_mask[-1] if seq.loss_mask else 1]
    n = len(ids) // max_len
    if n == 0:
        raise DataError(f"the data has {len(ids)} tokens, fewer than one window of --max-len {max_len}")
    as_windows = lambda xs: torch.tensor(xs[: n * max_len], dtype=torch.long).view(n, max_len)  # noqa: E731
    return Windows(as_windows(ids), as_windows(mask))


def packed_files(paths: list[Path], tokenizer, max_len: int, split: str | None = None,
                 field: str | None = None) -> Windows:
    """Every record of every file (or dataset), tokenised as is and packed into windows."""
    records = [r for p in paths for r in read_records(p, split, field)]
    return pack([tokenize(r, tokenizer) for r in records], max_len, tokenizer.eos_token_id)
