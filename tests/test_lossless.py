"""Speculative decoding with our heads changes nothing but speed, in real vLLM engines.

One engine per method, all with the same settings: prompts longer than
`max_num_batched_tokens` (chunked prefill), prefix caching on, and a KV cache that
holds ~35 typical requests but not 48 long ones growing by 256 tokens (preemption, then
recompute). Greedy outputs must equal the same engine's without speculation, token for
token, for every prompt: all 200 held-out prompts submitted at once and one request at a
time, prompts sharing a long cached prefix, and the preempted long requests; and with the
sampling features that take their own paths through vLLM's samplers (logprobs, penalties,
structured outputs), in steps with and without drafts.
"""

from __future__ import annotations

import re

import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from benchmarks.run import HEADS_METHODS, drafting_since, read_drafting
from conftest import SERVED_LOSSLESS, counter, make_llm, shutdown, speculative
from vllm_clover.spec_metrics import counters_since, first_draft_acceptance, mean_acceptance_length
from vllm_clover.spec_metrics import spec_decode_counters as spec_counters
from vllm_clover_training.stdlib_corpus import heldout_prompts

NUM_PROMPTS = 200
NEW_TOKENS = 32
SERIAL_TOKENS = 16     # one request at a time is the slow part; shorter outputs keep CI short
ENGINE = dict(
    disable_log_stats=False,
    enable_prefix_caching=True,
    max_num_seqs=48,
    max_num_batched_tokens=256,        # longest prompts are ~550 tokens: prefilled in chunks
    kv_cache_memory_bytes=80 << 20,    # ~100-125 blocks of 128 tokens: ~35 running requests
)
PREEMPTED = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SERIAL = SamplingParams(temperature=0, max_tokens=SERIAL_TOKENS, ignore_eos=True)
# A batch held at one size, decoding alone long after its prompts were prefilled: where drafts
# do not pay there, the goodput policy sleeps through most steps (GoodputPolicy.asleep).
STEADY_REQUESTS, STEADY = 24, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
FEATURE_PROMPTS = 24
LOGPROBS = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
PENALISED = SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.3, presence_penalty=0.5,
                           ignore_eos=True)
THREE_ASSIGNMENTS = r"(    [a-z_]{1,12} = [0-9]{1,3}\n){3}"
STRUCTURED = SamplingParams(temperature=0, max_tokens=80,  # room for the longest match
                            structured_outputs=StructuredOutputsParams(regex=THREE_ASSIGNMENTS))
# Temperature test: the tokens sampled after the first one went through rejection sampling.
HOT, COLD, NUM_SAMPLES = 0.8, 0.6, 1500


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompts(NUM_PROMPTS)


@pytest.fixture(scope="module")
def shared_prefix_prompts(prompts):
    """24 prompts that share one ~400-token prefix (3 full KV blocks) and differ at the end."""
    prefix = max(prompts, key=len)
    return [prefix + f"\n\ndef variant_{i}(" for i in range(24)]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_all(llm, prompts, shared_prefix_prompts) -> dict:
    before = spec_counters(llm)
    concurrent = llm.generate(prompts, GREEDY, use_tqdm=False)
    after = spec_counters(llm)
    serial = [llm.generate([p], SERIAL, use_tqdm=False)[0] for p in prompts]
    llm.generate(shared_prefix_prompts[:1], GREEDY, use_tqdm=False)   # fills the cache with the prefix
    prefixed = llm.generate(shared_prefix_prompts, GREEDY, use_tqdm=False)
    preemptions = counter(llm, "vllm:num_preemptions")
    long_requests = llm.generate(sorted(prompts, key=len)[-48:], PREEMPTED, use_tqdm=False)
    preemptions = counter(llm, "vllm:num_preemptions") - preemptions
    first = "def main():\n    "
    features = prompts[:FEATURE_PROMPTS]
    logprobs = llm.generate(features, LOGPROBS, use_tqdm=False)
    penalised = llm.generate(features, PENALISED, use_tqdm=False)
    structured = llm.generate(features, STRUCTURED, use_tqdm=False)
    seeded = [SamplingParams(temperature=HOT, max_tokens=3, seed=i) for i in range(NUM_SAMPLES)]
    samples = llm.generate([first] * NUM_SAMPLES, seeded, use_tqdm=False)
    drafting = llm.collective_rpc(read_drafting)[0]
    steady = llm.generate(prompts[:STEADY_REQUESTS], STEADY, use_tqdm=False)
    return {
        "steady": token_ids(steady),
        "drafting_while_steady": drafting_since(drafting, llm.collective_rpc(read_drafting)[0]),
        "concurrent": token_ids(concurrent),
        "serial": token_ids(serial),
        "prefixed": token_ids(prefixed),
        "preempted": token_ids(long_requests),
        "samples": token_ids(samples),
        "logprobs": token_ids(logprobs),
        "top_logprobs": [[{t: p.logprob for t, p in step.items()} for step in o.outputs[0].logprobs]
                         for o in logprobs],
        "penalised": token_ids(penalised),
        "structured": [o.outputs[0].text for o in structured],
        "spec": counters_since(before, after),
        "preemptions": preemptions,
        "longest_prompt": max(len(o.prompt_token_ids) for o in concurrent),
        "prefix_cache_hits": counter(llm, "vllm:prefix_cache_hits"),
        "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }


@pytest.fixture(scope="module", autouse=True)
def rpc_with_functions():
    """collective_rpc(read_drafting) sends a function to the workers: vLLM takes one only with this set."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


@pytest.fixture(scope="module")
def plain(demo_base, prompts, shared_prefix_prompts):
    llm = make_llm(demo_base, **ENGINE)
    result = run_all(llm, prompts, shared_prefix_prompts)
    cold = [SamplingParams(temperature=COLD, max_tokens=3, seed=i) for i in range(NUM_SAMPLES)]
    result["cold_samples"] = token_ids(llm.generate(["def main():\n    "] * NUM_SAMPLES, cold, use_tqdm=False))
    shutdown(llm)
    return result


@pytest.fixture(scope="module", params=SERVED_LOSSLESS)  # every table entry, as served
def speculated(request, demo_base, prompts, shared_prefix_prompts, plain):
    llm = make_llm(demo_base, speculative_config=speculative(request.param), **ENGINE)
    result = run_all(llm, prompts, shared_prefix_prompts)
    shutdown(llm)
    return request.param, result


def mismatched(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def test_the_engine_settings_exercise_the_hard_cases(plain, speculated):
    _, result = speculated
    for run in (plain, result):
        assert run["preemptions"] > 0
        assert run["prefix_cache_hits"] > 0
        assert run["longest_prompt"] > ENGINE["max_num_batched_tokens"]
    # Room for >= 32 median requests (~3 blocks each) running at once.
    assert min(plain["num_blocks"], result["num_blocks"]) >= 32 * 3


def test_concurrent_greedy_outputs_equal_plain_decoding(plain, speculated):
    method, result = speculated
    assert result["spec"]["draft_tokens"] > 0, f"{method} drafted nothing"
    assert mismatched(result["concurrent"], plain["concurrent"]) == []


def test_a_steady_batch_the_policy_sleeps_through_equals_plain_decoding(plain, speculated):
    """24 requests decoding alone for ~150 steps at one batch size, where drafts do not pay on
    the demo base: our methods' policy sleeps through many steps (CLP's through fewer, its
    confident rows still drafting now and then; Clover's augmenting block still keeps every
    step's KV), and the outputs stay exact."""
    method, result = speculated
    assert mismatched(result["steady"], plain["steady"]) == []
    if method in ("clover", "clp"):
        assert result["drafting_while_steady"]["steps_slept_fraction"] > 0.1, result["drafting_while_steady"]


def test_one_request_at_a_time_equals_plain_decoding(plain, speculated):
    _, result = speculated
    assert mismatched(result["serial"], plain["serial"]) == []


def test_shared_prefix_from_the_prefix_cache_equals_plain_decoding(plain, speculated):
    _, result = speculated
    assert mismatched(result["prefixed"], plain["prefixed"]) == []


def test_preempted_long_requests_equal_plain_decoding(plain, speculated):
    _, result = speculated
    assert mismatched(result["preempted"], plain["preempted"]) == []


def test_logprobs_equal_plain_decoding(plain, speculated):
    _, result = speculated
    assert mismatched(result["logprobs"], plain["logprobs"]) == []
    for ours, theirs in zip(result["top_logprobs"], plain["top_logprobs"], strict=True):
        for step, plain_step in zip(ours, theirs, strict=True):
            assert step.keys() == plain_step.keys()
            assert [step[t] for t in step] == pytest.approx([plain_step[t] for t in step], abs=1e-5)


def test_penalties_and_structured_outputs_equal_plain_decoding(plain, speculated):
    _, result = speculated
    assert mismatched(result["penalised"], plain["penalised"]) == []
    assert result["structured"] == plain["structured"]
    assert all(re.fullmatch(THREE_ASSIGNMENTS, text) for text in plain["structured"])  # it was enforced


# First-draft acceptance floors on these prompts: Clover's is accepted more often than not; the
# EAGLE draft trained on the same recipe must beat an untrained one by far (a freshly initialised
# draft of the demo base served by vLLM's EAGLE: 2 of 494 first drafts accepted, 0.4%).
ACCEPTANCE_FLOORS = {"clover": 0.5, "eagle": 0.25}


def test_trained_first_drafts_clear_their_acceptance_floor(speculated):
    method, result = speculated
    if method not in ACCEPTANCE_FLOORS:
        pytest.skip(f"no acceptance floor for {method}")
    spec = result["spec"]
    assert first_draft_acceptance(spec) > ACCEPTANCE_FLOORS[method], spec
    assert sum(spec["accepted_per_pos"]) == spec["accepted"]


def chi_square_p_value(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of homogeneity; categories expected < 5 times are pooled."""
    tokens = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(t), b.count(t)] for t in tokens], dtype=torch.float64)
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    rare = expected.min(1).values < 5
    if rare.any():
        counts = torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)])
        expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_sampling_at_temperature_keeps_the_distribution(request, plain, speculated):
    """Tokens 2 and 3 of each sample were verified drafts or recovered tokens: their
    distribution must match plain sampling. The same test must tell temperature 0.8 from
    0.6, or it could not catch a biased sampler either."""
    method, result = speculated
    if not HEADS_METHODS[method][0].served_by_plugin:  # vLLM's own proposer: our CPU fix is scoped to ours
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "vLLM 0.32 CPU bug: the expand_kernel fallback leaves per-token temperatures "
            "uninitialised (patches.py: cpu_expand_float_params)")))
    for position in (1, 2):
        ours = [s[position] for s in result["samples"]]
        theirs = [s[position] for s in plain["samples"]]
        assert chi_square_p_value(ours, theirs) > 1e-3
    colder = [s[1] for s in plain["cold_samples"]]
    assert chi_square_p_value([s[1] for s in plain["samples"]], colder) < 1e-3


@pytest.fixture(scope="module")
def trusted(demo_base, prompts, plain):
    """CLP's paper mode: the predicted span is accepted without verification."""
    llm = make_llm(demo_base, speculative_config=speculative("clp-trust"), **ENGINE)
    before = spec_counters(llm)
    outputs = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    spec = counters_since(before, spec_counters(llm))
    shutdown(llm)
    return outputs, spec


def test_trust_mode_accepts_every_draft_and_reports_it(plain, trusted, record_property):
    outputs, spec = trusted
    assert spec["draft_tokens"] > 0
    assert spec["accepted"] == spec["draft_tokens"]   # nothing was verified away
    assert [len(o) for o in outputs] == [NEW_TOKENS] * NUM_PROMPTS
    equal = sum(a == b for a, b in zip(outputs, plain["concurrent"], strict=True)) / NUM_PROMPTS
    record_property("clp_trust_outputs_equal_to_plain", equal)
    record_property("clp_trust_mean_acceptance_length", mean_acceptance_length(spec))
