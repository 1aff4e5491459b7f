"""Clover in a compiled engine (vLLM's torch.compile, as `vllm serve` runs without
--enforce-eager): the augmenting block compiles at start-up along with the target, never
while serving a request, and greedy outputs equal plain decoding's in the same mode.
(The other engine tests run eager: they start in half the time.)"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from conftest import make_llm, shutdown, speculative
from vllm_clover.spec_metrics import first_draft_acceptance, spec_decode_counters
from vllm_clover_training.stdlib_corpus import heldout_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def graphs_compiled(worker) -> int:
    """Runs in the worker: graphs torch.compile (Dynamo) has captured in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def block_is_compiled(worker) -> bool:
    return not worker.model_runner.drafter.model.augment.do_not_compile


@pytest.fixture(scope="module")
def runs(demo_base):
    prompts = heldout_prompts(24)
    results = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with functions
        for name, spec in (("plain", None), ("clover", speculative("clover"))):
            llm = make_llm(demo_base, speculative_config=spec, enforce_eager=False, disable_log_stats=False)
            at_start = llm.collective_rpc(graphs_compiled)[0]
            outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            results[name] = {"outputs": outputs, "graphs_at_start": at_start,
                             "graphs_while_serving": llm.collective_rpc(graphs_compiled)[0] - at_start,
                             "block_compiled": llm.collective_rpc(block_is_compiled)[0] if spec else None,
                             "spec": spec_decode_counters(llm)}
            shutdown(llm)
    return results


def test_compiled_clover_equals_compiled_plain_decoding(runs):
    assert runs["clover"]["outputs"] == runs["plain"]["outputs"]
    assert first_draft_acceptance(runs["clover"]["spec"]) > 0.5


def test_the_augmenting_block_compiles_at_start_up(runs):
    clover = runs["clover"]
    assert clover["block_compiled"]
    assert clover["graphs_at_start"] > runs["plain"]["graphs_at_start"]  # the target's graphs and the block's
    assert clover["graphs_while_serving"] == 0
