"""The bundled base model loads in vLLM and in transformers, and both decode it alike."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from conftest import make_llm
from vllm_clover_training.stdlib_corpus import heldout_prompts

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm(demo_base):
    engine = make_llm(demo_base)
    yield engine
    del engine


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompts(4)


def test_generates_requested_length(llm):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(["def main():\n", "class Point:\n"], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [NEW_TOKENS, NEW_TOKENS]
    assert all(o.outputs[0].text.strip() for o in outputs)


def test_greedy_matches_transformers(llm, demo_base, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_base)
    model = AutoModelForCausalLM.from_pretrained(demo_base, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    vllm_outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, vllm_outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            hf = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                min_new_tokens=NEW_TOKENS)
        assert list(out.outputs[0].token_ids) == hf[0, ids.shape[1]:].tolist(), prompt[-200:]
