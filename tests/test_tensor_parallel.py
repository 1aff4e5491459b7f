"""tensor_parallel_size=2 on the CPU build (multiprocessing executor, one core per rank):
Clover's augmenting block is sharded like the base's layers, the goodput policy's depth is
rank 0's on every rank, and outputs stay exact (Clover and CLP)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from vllm import SamplingParams

from benchmarks.run import speculative_config
from conftest import DEMO_HEADS, make_llm, shutdown
from vllm_clover.draft_policy import AcceptanceModel
from vllm_clover.spec_metrics import first_draft_acceptance
from vllm_clover.spec_metrics import spec_decode_counters as spec_counters
from vllm_clover_training.stdlib_corpus import heldout_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def augmenting_heads(worker):
    """Runs in each worker (LLM.collective_rpc): (query heads, KV heads) of the draft's
    augmenting attention on this rank."""
    attention = worker.model_runner.drafter.model.augment.layer.self_attn
    return attention.num_heads, attention.num_kv_heads


@pytest.fixture(scope="module")
def tp_env():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")         # a rank per core
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # collective_rpc with a function
        yield


# A hand-made calibration table (every bin measured: accepted 3 in 10), to see it reach every rank.
CALIBRATION = {"confidence_bins": 10, "tried": [[100] * 10] * 4, "accepted": [[30] * 10] * 4}


@pytest.fixture(scope="module")
def calibrated_heads(tmp_path_factory):
    """The demo heads, each with CALIBRATION."""
    root = tmp_path_factory.mktemp("heads")
    for method in ("clover", "clp"):
        shutil.copytree(DEMO_HEADS / method, root / method)
        (root / method / "calibration.json").write_text(json.dumps(CALIBRATION))
    return root


@pytest.fixture(scope="module")
def runs(demo_base, tp_env, calibrated_heads):
    prompts = heldout_prompts(32)
    results = {}
    specs = {method: speculative_config(method, calibrated_heads, 4) for method in ("clover", "clp")}
    for name, spec in (("plain", None), ("clover", specs["clover"]), ("clp", specs["clp"])):
        llm = make_llm(demo_base, tensor_parallel_size=2, speculative_config=spec, disable_log_stats=False)
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        results[name] = {"outputs": outputs, "spec": spec_counters(llm),
                         "heads_per_rank": llm.collective_rpc(augmenting_heads) if name == "clover" else None,
                         "policy_per_rank": llm.collective_rpc(draft_policy) if spec else None}
        shutdown(llm)
    return results


@pytest.mark.parametrize("method", ["clover", "clp"])
def test_drafting_under_tp2_equals_plain_tp2(runs, method):
    assert runs[method]["outputs"] == runs["plain"]["outputs"]
    spec = runs[method]["spec"]
    # Heads on wrongly sharded weights accept next to nothing; right ones ~0.3-0.5 here, by
    # which rows the policy lets draft, which follows the machine's timing (CLP 0.29 on a slow one).
    assert spec["accepted"] > 0 and first_draft_acceptance(spec) > 0.2


def draft_policy(worker) -> tuple[str, str, list]:
    model = worker.model_runner.drafter.model
    return model.draft_policy, type(model.policy).__name__, model.policy.acceptance.prior.tolist()


@pytest.mark.parametrize("method", ["clover", "clp"])
def test_every_rank_runs_the_goodput_policy_on_rank_0s_decisions(runs, method):
    """Ranks timing their own steps could choose different depths and deadlock in the heads'
    collectives; each keeps its policy but takes rank 0's depth (draft_policy.SharedDecisions).
    The runs above finishing is the other half of this test."""
    assert [policy[:2] for policy in runs[method]["policy_per_rank"]] == [("goodput", "SharedDecisions")] * 2


@pytest.mark.parametrize("method", ["clover", "clp"])
def test_every_rank_starts_from_the_heads_calibration(runs, method):
    expected = AcceptanceModel(4, CALIBRATION).prior
    assert np.allclose(expected, 0.3) and not np.array_equal(expected, AcceptanceModel(4).prior)
    assert all(np.array_equal(policy[2], expected) for policy in runs[method]["policy_per_rank"])


def test_augmenting_block_is_sharded_across_ranks(runs):
    # The demo base has 4 query heads and 2 KV heads: each of the 2 ranks holds half.
    assert runs["clover"]["heads_per_rank"] == [(2, 1), (2, 1)]
