"""Sampling requests that killed a vLLM 0.32 CPU engine in the soak, served by ours.

1. Seeded sampling while prompts are prefilled in chunks: vLLM samples a token after every
   chunk, discards all but the last, and rewinds a seeded request's generator with
   `set_offset`, which CPU generators lack ("CPU Generator does not use offset"), for plain
   decoding as for ours; speculative steps leave prompts less of the token budget, so ours
   met it within a minute. Patch cpu_seeded_prefill_chunks.
2. top_k without top_p in a step where no request has drafts (the first step after a
   prompt, or the goodput policy drafting nothing): vLLM still runs its rejection sampler,
   over zero draft positions, and on CPU `k.max()` of an empty tensor raises. Patches
   plain_inputs_without_drafts and plain_sampling_without_drafts prepare and sample such
   steps as plain decoding does; patch
   cpu_top_k_without_drafts covers those still verified (a request under a thinking budget,
   tests/test_spec_config.py).
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from conftest import make_llm, shutdown, speculative
from vllm_clover_training.stdlib_corpus import heldout_prompts

SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32)
TOP_K_ONLY = SamplingParams(temperature=0.8, top_k=20, max_tokens=16)


@pytest.fixture(scope="module")
def outputs(demo_base):
    # Drafts of a fixed length, so the seed's stream is consumed the same way in both runs.
    spec = {**speculative("clover"), "draft_policy": "fixed"}
    llm = make_llm(demo_base, speculative_config=spec, max_num_batched_tokens=128)
    prompts = sorted(heldout_prompts(40), key=len)[-4:]  # 319-547 tokens: 3-5 chunks of <= 128
    top_k_only = llm.generate(prompts[:2], TOP_K_ONLY, use_tqdm=False)
    alone = llm.generate(prompts[:1], SEEDED, use_tqdm=False)
    # Last in the queue, its prompt shares each step's budget with the others' chunks and
    # decodes, so it is cut into more and different chunks.
    crowd = llm.generate(prompts[1:] + prompts[:1], SEEDED, use_tqdm=False)
    shutdown(llm)
    return {"top_k_only": top_k_only, "alone": alone[0], "in_crowd": crowd[-1]}


def test_top_k_without_top_p_survives_steps_without_drafts(outputs):
    assert [len(o.outputs[0].token_ids) for o in outputs["top_k_only"]] == [16, 16]


def test_a_seeded_request_survives_chunked_prefill(outputs):
    assert len(outputs["alone"].outputs[0].token_ids) == len(outputs["in_crowd"].outputs[0].token_ids) == 32


def test_the_seed_gives_the_same_answer_however_the_prompt_was_chunked(outputs):
    assert outputs["alone"].outputs[0].text == outputs["in_crowd"].outputs[0].text
