"""User turns written by the chat model itself (Magpie, arXiv 2406.08464), for self-distillation.

The instruction set of `instructions` is what this machine can template: code, maths and the
Python reference. Heads trained on the answers to it draft well for those tasks and poorly for
general chat (SmolLM2's Clover heads: first draft accepted at ~48% teacher-forced on that set's
validation split, ~20-23% served on Spec-Bench). An aligned chat model, given its chat template
up to the start of a user turn and nothing more, samples a user turn from what it was tuned
on: questions, requests and role-play as people ask them. Its own greedy answers to those
(`vllm-clover-train distill`) are then the traffic a chat deployment sees, in its own words.

Kept: turns the model ended itself (not cut at the token limit), of a sane length, each once
(case and spacing aside), sharing no `instructions.SHINGLE`-word run with an evaluation prompt
(`keep_turns`).

    vllm-clover-train self-instruct --base-model BASE --out-dir DIR --count N [--validation M] [--seed S]
    -> DIR/chat-train.jsonl, DIR/chat-validation.jsonl ({"task": "chat", "messages": [{"role": "user", ...}]}),
       DIR/chat-report.json
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_clover.atomic import atomic_write_text
from vllm_clover.errors import VllmCloverError
from vllm_clover.hub import local_dir
from vllm_clover_training.distill import open_engine
from vllm_clover_training.instructions import decontaminate, eval_prompts

# Magpie samples at temperature 1 with nucleus 1; a nucleus a little under 1 keeps the
# diversity and drops the long tail of tokens that turn a 135M model's turns into noise.
TEMPERATURE = 1.0
TOP_P = 0.99
MAX_TURN_TOKENS = 160
MIN_CHARS, MAX_CHARS = 16, 1500
ROUND = 512                # turns sampled per generate() call, at most
MAX_SAMPLES_PER_TURN = 4   # give up after sampling this many times the turns asked for
SENTINEL = "\x00user-turn\x00"


class SelfInstructError(VllmCloverError):
    pass


def user_turn_prefix(tokenizer) -> str:
    """The chat template rendered up to where a user turn's text begins (its default system
    prompt included), e.g. SmolLM2's '<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n'."""
    if not getattr(tokenizer, "chat_template", None):
        raise SelfInstructError(f"the base model's tokenizer ({tokenizer.name_or_path}) has no chat template: "
                                "self-instruct needs a chat model")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in rendered:
        raise SelfInstructError(f"the chat template of {tokenizer.name_or_path} does not render a user turn's "
                                f"text verbatim; found {rendered!r}")
    return rendered[: rendered.index(SENTINEL)]


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def keep_turns(samples: list[tuple[str, bool]], seen: set[str], evaluation: list[str]) -> tuple[list[str], int]:
    """The sampled turns worth answering, in order, and how many were dropped as contaminated:
    (text, ended by the model itself) -> those that ended, are MIN_CHARS..MAX_CHARS long, were
    not seen before (`seen` grows) and share no SHINGLE-word run with an `evaluation` prompt."""
    fresh = []
    for text, ended in samples:
        text = text.strip()
        key = normalized(text)
        if ended and MIN_CHARS <= len(text) <= MAX_CHARS and key not in seen:
            seen.add(key)
            fresh.append({"prompt": text})
    clean, contaminated = decontaminate(fresh, evaluation)
    return [item["prompt"] for item in clean], contaminated


def sample_turns(base_dir: Path, count: int, seed: int, dtype: str, evaluation: list[str]) -> tuple[list[str], dict]:
    """`count` user turns that `keep_turns` kept, and how many were sampled and how many of
    them dropped as contaminated."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    prefix = user_turn_prefix(AutoTokenizer.from_pretrained(base_dir))
    llm, _ = open_engine(base_dir, dtype, seed)
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=MAX_TURN_TOKENS)
    seen: set[str] = set()
    turns: list[str] = []
    sampled = contaminated = 0
    while len(turns) < count and sampled < MAX_SAMPLES_PER_TURN * count:
        wanted = min(ROUND, 2 * (count - len(turns)))  # most samples are kept: a few turns take one small round
        outputs = llm.generate([prefix] * wanted, params, use_tqdm=False)
        sampled += wanted
        kept, dropped = keep_turns([(o.outputs[0].text, o.outputs[0].finish_reason == "stop") for o in outputs],
                                   seen, evaluation)
        turns += kept
        contaminated += dropped
    del llm
    if len(turns) < count:
        raise SelfInstructError(f"{base_dir}: only {len(turns)} usable user turns in {sampled} samples, "
                                f"{count} asked for")
    return turns[:count], {"sampled": sampled, "kept": count, "dropped_as_contaminated": contaminated}


def self_instruct(base_model: str, base_revision: str | None, out_dir: Path, count: int, validation: int,
                  seed: int, dtype: str, shared_data: Path) -> dict:
    """Write `count` user turns: the first `validation` to DIR/chat-validation.jsonl, the rest to
    DIR/chat-train.jsonl, and what was sampled and dropped to DIR/chat-report.json."""
    if not 0 <= validation < count:
        raise SelfInstructError(f"--validation must be in 0..{count - 1} (--count {count}), got {validation}")
    evaluation = eval_prompts(shared_data)  # read before the engine starts: a missing file fails fast
    turns, report = sample_turns(local_dir(base_model, "base model", base_revision), count, seed, dtype,
                                  evaluation)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {"validation": turns[:validation], "train": turns[validation:]}
    for split, rows in splits.items():
        atomic_write_text(out_dir / f"chat-{split}.jsonl", "".join(
            json.dumps({"task": "chat", "messages": [{"role": "user", "content": t}]}) + "\n" for t in rows))
    report = {"seed": seed, "temperature": TEMPERATURE, "top_p": TOP_P, "max_turn_tokens": MAX_TURN_TOKENS,
              **report, **{split: len(rows) for split, rows in splits.items()}}
    atomic_write_text(out_dir / "chat-report.json", json.dumps(report, indent=2) + "\n")
    return report
