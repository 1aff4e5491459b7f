"""Seeded sampling while prompts are prefilled in chunks, in one of our engines on CPU.

vLLM 0.32 samples a token after every prefill chunk, discards all but the last, and rewinds
a seeded request's generator with `set_offset`, which CPU generators lack: the engine dies
("CPU Generator does not use offset"), for plain decoding as for ours; speculative steps
leave prompts less of the token budget, so ours met it within a minute of the soak. Patch
cpu_seeded_prefill_chunks samples those discarded tokens without the request's generator.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from conftest import make_llm, shutdown, speculative
from vllm_clover_training.stdlib_corpus import heldout_prompts

PARAMS = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32)


@pytest.fixture(scope="module")
def outputs(demo_base):
    # Drafts of a fixed length, so the seed's stream is consumed the same way in both runs.
    spec = {**speculative("clover"), "draft_policy": "fixed"}
    llm = make_llm(demo_base, speculative_config=spec, max_num_batched_tokens=128)
    prompts = sorted(heldout_prompts(40), key=len)[-4:]  # 319-547 tokens: 3-5 chunks of <= 128
    alone = llm.generate(prompts[:1], PARAMS, use_tqdm=False)
    # Last in the queue, its prompt shares each step's budget with the others' chunks and
    # decodes, so it is cut into more and different chunks.
    crowd = llm.generate(prompts[1:] + prompts[:1], PARAMS, use_tqdm=False)
    shutdown(llm)
    return alone[0], crowd[-1]


def test_a_seeded_request_survives_chunked_prefill(outputs):
    alone, in_crowd = outputs
    assert len(alone.outputs[0].token_ids) == len(in_crowd.outputs[0].token_ids) == 32


def test_the_seed_gives_the_same_answer_however_the_prompt_was_chunked(outputs):
    alone, in_crowd = outputs
    assert alone.outputs[0].text == in_crowd.outputs[0].text
