"""Self-distillation data: the base model's own greedy continuations, generated with vLLM.

Heads trained on what the base itself writes learn the distribution they will be
verified against (Medusa-2 and EAGLE do the same).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_clover.atomic import atomic_write_text


def generate_continuations(base_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> list[list[int]]:
    """prompt + greedy continuation (up to `new_tokens`, stopping at EOS) for every prompt."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_len = json.loads((Path(base_dir) / "config.json").read_text())["max_position_embeddings"]
    prompts = [p[-(max_len - new_tokens):] for p in prompts]
    llm = LLM(model=str(base_dir), dtype=dtype, seed=0, max_model_len=max_len,
              kv_cache_memory_bytes=512 << 20)
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=True)
    del llm
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]


def distill_jsonl(base_dir: Path, data: list[Path], out: Path, prompt_tokens: int, new_tokens: int,
                  dtype: str) -> dict:
    """Write {"text": prompt + greedy continuation} per record of `data` to `out`."""
    from transformers import AutoTokenizer

    from vllm_clover_training import data as data_mod

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    records = [r for path in data for r in data_mod.read_jsonl(path)]
    prompts = [data_mod.prompt_ids(r, tokenizer, prompt_tokens) for r in records]
    sequences = generate_continuations(base_dir, prompts, new_tokens, dtype)
    atomic_write_text(out, "".join(json.dumps({"text": tokenizer.decode(s, skip_special_tokens=True)}) + "\n"
                                   for s in sequences))
    return {"records": len(sequences), "tokens": sum(map(len, sequences)), "out": str(out)}
