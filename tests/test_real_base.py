"""The real target, SmolLM2-135M-Instruct: imported from its GGUF, it is the same model in
vLLM and in transformers, the heads shipped for it serve exactly its answers, and bad GGUF
files get one clear error and leave nothing behind."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.run import speculative_config
from conftest import REPO, SERVED_LOSSLESS, make_llm, shutdown
from vllm_clover.spec_metrics import spec_decode_counters
from vllm_clover_training.data import chat_prompt_ids
from vllm_clover_training.import_gguf import GgufError, import_gguf, packaged_gguf, sha256_file

CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Give three tips for staying focused while studying.",
]
NEW_TOKENS = 24
SMOLLM2_HEADS = REPO / "assets" / "smollm2-heads"


def test_the_import_is_a_complete_deterministic_model_directory(real_base):
    provenance = json.loads((real_base / "provenance.json").read_text())
    assert provenance["gguf_sha256"] == sha256_file(packaged_gguf())
    assert provenance["model_safetensors_sha256"] == sha256_file(real_base / "model.safetensors")
    assert provenance["parameters"] == 134_515_008
    config = json.loads((real_base / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)


@pytest.fixture(scope="module")
def chat_prompts(real_base) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_base)
    assert tokenizer.chat_template  # the GGUF's template came along
    return [chat_prompt_ids(tokenizer, c) for c in CHATS]


def greedy_answers(real_base, prompts: list[list[int]], **engine) -> tuple[list[list[int]], dict | None]:
    """(vLLM's greedy answers, its spec-decode counters) for token-id prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(real_base, disable_log_stats=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    counters = spec_decode_counters(llm)
    shutdown(llm)
    return [list(o.outputs[0].token_ids) for o in outputs], counters


@pytest.fixture(scope="module")
def vanilla_answers(real_base, chat_prompts) -> list[list[int]]:
    return greedy_answers(real_base, chat_prompts)[0]


def test_vllm_and_transformers_give_the_same_greedy_chat_answers(real_base, chat_prompts, vanilla_answers):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(real_base, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in chat_prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(out[0, len(ids):].tolist())
    assert vanilla_answers == expected
    assert "Paris" in AutoTokenizer.from_pretrained(real_base).decode(vanilla_answers[0])  # it knows things


@pytest.mark.parametrize("method", SERVED_LOSSLESS)
def test_shipped_heads_serve_exactly_the_bases_answers(method, real_base, chat_prompts, vanilla_answers):
    """The committed SmolLM2 heads in vLLM: plain decoding's tokens, and drafts that get accepted."""
    answers, counters = greedy_answers(real_base, chat_prompts,
                                       speculative_config=speculative_config(method, SMOLLM2_HEADS, 4))
    assert answers == vanilla_answers
    assert counters["accepted"] > 0, counters


@pytest.mark.parametrize("damage,message", [
    (lambda data: b"PK\x03\x04" + data[4:2000], "is not a GGUF file: it starts with b'PK"),
    (lambda data: data[: 1 << 20], "is not a complete GGUF file"),
])
def test_a_bad_gguf_gets_one_error_and_leaves_nothing(tmp_path, damage, message):
    with open(packaged_gguf(), "rb") as f:
        head = f.read(1 << 21)
    bad = tmp_path / "model.gguf"
    bad.write_bytes(damage(head))
    out = tmp_path / "out"
    with pytest.raises(GgufError, match=message):
        import_gguf(bad, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_chat_records_render_through_the_chat_template_and_learn_only_answers(real_base):
    from transformers import AutoTokenizer

    from vllm_clover_training.data import Record, prompt_ids, tokenize

    tokenizer = AutoTokenizer.from_pretrained(real_base)
    chat = Record("x.jsonl:1", messages=({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}))
    tokens = tokenize(chat, tokenizer)
    assert all(isinstance(t, int) for t in tokens.ids)
    text = tokenizer.decode(tokens.ids)
    assert "<|im_start|>user\nHi<|im_end|>" in text and "<|im_start|>assistant\nHello!<|im_end|>" in text
    # The loss covers the answer and the end-of-turn token the model generates, nothing else.
    learned = [t for t, m in zip(tokens.ids, tokens.loss_mask, strict=True) if m]
    assert tokenizer.decode(learned) == "Hello!<|im_end|>"
    assert tokenizer.decode(prompt_ids(chat, tokenizer, 64)).endswith("<|im_start|>assistant\n")
