"""Clover's augmenting block reads the right paged KV cache in a real engine.

Lossless outputs cannot show this (vLLM verifies every draft, so wrong drafts only cost
speed). Here each augmented state h_0 the engine drafted from is recorded in the worker
and compared with the vLLM-free CloverHeads.augmented over the request's whole token
history, computed from scratch with transformers. The engine prefills in 64-token chunks,
is preempted (its KV freed and recomputed), and serves repeated prompts from the prefix
cache, so all three paths must write and read the block's KV exactly where the base's is;
and steps whose heads draft nothing (the goodput policy's choice under load) still write it
(through vLLM's own norm and rotary kernels, checked against the layer's modules).
The longest request runs into max_model_len while the others go on: vLLM would skip the
draft step of the whole batch there, and the block would miss that step's KV.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm import SamplingParams

from conftest import DEMO_HEADS, counter, make_llm, shutdown, speculative
from vllm_clover.checkpoint import build_heads_module, load_heads
from vllm_clover.vllm_models import DeferredKvWrites
from vllm_clover_training.base import load_base
from vllm_clover_training.stdlib_corpus import heldout_prompts

K, MAX_MODEL_LEN = 4, 640  # the longest prompt (547 tokens) reaches it; the rest stay below
ENGINE = dict(disable_log_stats=False, enable_prefix_caching=True, max_num_seqs=16, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=64, kv_cache_memory_bytes=12 << 20)  # 16 blocks: preempts
WRITE_DEFERRED_AT = 256  # tokens (the engine's 1024 would take longer spells without drafts to reach)
PARAMS = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)


def start_recording(worker):
    """Runs in the worker: keep (request id, position, h_0) of every drafted row. Every third
    step, and for spells of 40 steps, the heads are told to draft nothing, so the block puts
    that step's KV off without computing any h_0 (written with the next drafting step's, or
    once WRITE_DEFERRED_AT tokens have piled up), and later drafts must still read it."""
    import vllm_clover.proposer as proposer
    import vllm_clover.vllm_models as vllm_models

    vllm_models.DEFERRED_KV_TOKENS = WRITE_DEFERRED_AT

    runner, records, deferred_at_writes = worker.model_runner, [], []
    model = runner.drafter.model
    worker.clover_records, worker.deferred_at_writes = records, deferred_at_writes
    draft_batch, start_states, draft_depth = proposer.draft_batch, model.start_states, model.heads.draft_depth
    write_deferred_kv = model.write_deferred_kv

    def recording_draft_batch(sampled, *args, **kwargs):
        batch, rows = draft_batch(sampled, *args, **kwargs)
        req_ids = [runner.input_batch.req_ids[row] for row in rows]
        records.append({"req_ids": req_ids, "positions": batch.positions[batch.last_index].tolist(),
                        "budgets": batch.budgets})
        return batch, rows

    def skipping_draft_depth(budgets, policy=None):
        return 0 if len(records) % 3 == 0 or len(records) % 150 >= 110 else draft_depth(budgets, policy)

    def counting_write_deferred_kv():
        deferred_at_writes.append(model.deferred_kv.tokens)
        write_deferred_kv()

    def recording_start_states(attention, hidden_states, rows=None):
        out = start_states(attention, hidden_states, rows)
        records[-1]["h0"] = out.clone()
        return out

    proposer.draft_batch, model.start_states, model.heads.draft_depth, model.write_deferred_kv = (
        recording_draft_batch, recording_start_states, skipping_draft_depth, counting_write_deferred_kv)


def compare_kv_write_paths(worker):
    """Runs in the worker: the KV-only write's k and v through vLLM's kernels against the
    layer's own modules (what the attending pass writes), on a step's worth of states."""
    block = worker.model_runner.drafter.model.augment
    hidden_states = torch.randn(37, block.norm.weight.shape[0])
    positions = torch.randint(0, MAX_MODEL_LEN, (37,))
    _, k, v = block.rotated_qkv(positions, hidden_states)
    fast_k, fast_v = block.rotated_kv_with_kernels(positions, hidden_states)
    return {"kernels_fit": block.kernels_fit(hidden_states),
            "max_difference": max(float((fast_k - k).abs().max()), float((fast_v - v).abs().max()))}


@pytest.fixture(scope="module")
def recorded(demo_base):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with functions
        spec = {**speculative("clover", K), "draft_policy": "fixed"}  # drafts every step not skipped above
        llm = make_llm(demo_base, speculative_config=spec, **ENGINE)
        llm.collective_rpc(start_recording)
        prompts = sorted(heldout_prompts(40), key=len)[-12:]  # the longest: many chunks
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        repeated = llm.generate(prompts[-2:], PARAMS, use_tqdm=False)  # the last to finish: still cached
        stats = {"preemptions": counter(llm, "vllm:num_preemptions"),
                 "prefix_cache_hits": counter(llm, "vllm:prefix_cache_hits"),
                 "kv_write_paths": llm.collective_rpc(compare_kv_write_paths)[0],
                 "deferred_at_writes": llm.collective_rpc(lambda worker: worker.deferred_at_writes)[0]}
        records = llm.collective_rpc(lambda worker: worker.clover_records)[0]
        shutdown(llm)
    sequences = {o.request_id: o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outputs + repeated}
    return records, sequences, stats


def test_the_engine_chunked_preempted_and_hit_the_cache(recorded):
    _, _, stats = recorded
    assert stats["preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0


def test_deferred_writes_keep_only_the_latest_write_to_each_slot():
    """A slot that changed hands between two deferred steps (a finished request's block
    reused) gets the later step's KV, and is written once."""
    deferred = DeferredKvWrites()
    deferred.add(torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([0, 1, 2]), torch.tensor([10, 11, 12, 99]))
    deferred.add(torch.tensor([[4.0], [5.0]]), torch.tensor([7, 8]), torch.tensor([11, 13]))
    assert deferred.tokens == 5
    hidden_states, positions, slots = deferred.take()
    written = {slot: (h, p) for slot, h, p in zip(slots.tolist(), hidden_states[:, 0].tolist(), positions.tolist())}
    assert len(slots) == 4 and written == {10: (1.0, 0), 11: (4.0, 7), 12: (3.0, 2), 13: (5.0, 8)}
    assert deferred.take() is None and deferred.tokens == 0


def test_kv_writes_were_put_off_and_written_in_both_ways(recorded):
    _, _, stats = recorded
    deferred = [tokens for tokens in stats["deferred_at_writes"] if tokens]
    assert len(deferred) > 30  # written before a drafting step attended
    assert max(deferred) >= WRITE_DEFERRED_AT  # written once that many had piled up


def test_the_kv_only_write_computes_what_the_layer_does(recorded):
    _, _, stats = recorded
    assert stats["kv_write_paths"]["kernels_fit"]  # the steps above wrote KV through the kernels
    assert stats["kv_write_paths"]["max_difference"] < 1e-4


def test_steps_near_max_model_len_still_draft_for_the_others(recorded):
    records, sequences, _ = recorded
    assert max(len(tokens) for tokens in sequences.values()) == MAX_MODEL_LEN  # one ran into the limit
    # Steps vLLM would skip for the whole batch (a request within K tokens of the limit).
    near_the_end = [r for r in records if len(r["req_ids"]) > 1 and max(r["positions"]) + 1 + K > MAX_MODEL_LEN]
    assert any("h0" in r for r in near_the_end)
    assert all(p + 1 + n <= MAX_MODEL_LEN - 1 for r in records for p, n in zip(r["positions"], r["budgets"]))


def test_augmented_states_equal_a_from_scratch_reference(recorded, demo_base):
    records, sequences, _ = recorded
    config, tensors = load_heads(DEMO_HEADS / "clover", demo_base)
    heads = build_heads_module(Path(DEMO_HEADS / "clover"), config, tensors).eval()
    base, _ = load_base(demo_base, "float32")
    reference = {}
    for req_id, tokens in sequences.items():
        ids = torch.tensor([tokens])
        with torch.no_grad():
            reference[req_id] = heads.augmented(base.hidden_states(ids), torch.arange(len(tokens))[None])[0]
    checked, worst = 0, 0.0
    assert sum(bool(r["req_ids"]) and "h0" not in r for r in records) > 50  # steps that only wrote KV
    for record in (r for r in records if "h0" in r):
        for req_id, position, h0 in zip(record["req_ids"], record["positions"], record["h0"]):
            # The engine appends "-<8 random chars>" to the id LLM.generate reports.
            states = reference[req_id.rsplit("-", 1)[0]]
            if position >= len(states):  # drafted past max_tokens in the last step: output was cut
                continue
            expected = states[position]
            worst = max(worst, float((h0 - expected).abs().max()))
            checked += 1
    assert checked > 500
    assert worst < 2e-3, f"max |h0 - reference| = {worst} over {checked} drafted rows"
