"""The runner side of our proposers: one engine step's inputs -> draft tokens per request.

Called from the runner hook (patches.py, `draft_with_clover_heads`) after the runner's
CPU bookkeeping, when vLLM's rejection sampler has settled this step's tokens. The
runner hands over everything the target computed; this module picks out what the draft
model needs (draft_batch.py), runs it with attention metadata for its own KV layers,
and returns `list[list[int]]`, one list per request in batch order. vLLM's scheduler
takes lists of any length up to K, so draft lengths may differ per request (CLP) and
empty lists mean "no drafts" (requests still in prefill, or CLP predicting none).

Every runner member read here is listed in patches.RUNNER_MEMBERS and checked when the
patches are applied.

vLLM skips the whole draft step when some request in the batch is within K tokens of
max_model_len (`GPUModelRunner._input_fits_in_drafter`), because its own drafters write KV
at the draft positions. Ours write KV only for the step's scheduled tokens, which the
scheduler keeps inside max_model_len, so for our models the step always runs (patch
`draft_near_max_model_len`) and that request's drafts are cut to the room it has left
(draft_batch.room_for_drafts): Clover's augmenting block never misses a step's KV.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

import torch
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_clover.draft_batch import draft_batch
from vllm_clover.draft_policy import GoodputPolicy
from vllm_clover.vllm_models import HeadsDraftModel

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: the one with a handler


@torch.inference_mode()
def propose(runner: GPUModelRunner, model: HeadsDraftModel, scheduler_output: SchedulerOutput,
            sampled_token_ids: list[list[int]], hidden_states: torch.Tensor,
            spec_decode_metadata: SpecDecodeMetadata | None, common_attn_metadata: CommonAttentionMetadata,
            slot_mappings: dict[str, torch.Tensor] | None) -> list[list[int]]:
    model.bind_target(runner.get_model())
    num_tokens = common_attn_metadata.num_actual_tokens
    num_draft_tokens = spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None else None
    req_ids = runner.input_batch.req_ids
    attending = partial(draft_attention, runner, model.kv_layer_names, common_attn_metadata, slot_mappings)
    if model.policy is not None:
        if model.policy.asleep(len(sampled_token_ids)):
            model.keep_step_kv(hidden_states[:num_tokens], runner._get_positions(num_tokens), attending,
                               kv_slots(model.kv_layer_names, slot_mappings), attend=False)
            model.stats.record_skipped(len(sampled_token_ids))
            log_drafting(model)
            return [[] for _ in sampled_token_ids]
        report_step(model.policy, req_ids, sampled_token_ids, num_draft_tokens, num_tokens)
    batch, rows = draft_batch(
        sampled_token_ids,
        query_start_loc=common_attn_metadata.query_start_loc_cpu[: len(sampled_token_ids) + 1].tolist(),
        num_draft_tokens=num_draft_tokens,
        hidden_states=hidden_states[:num_tokens],
        positions=runner._get_positions(num_tokens),
        budget=scheduler_output.num_spec_tokens_to_schedule,
        max_model_len=runner.max_model_len,
        longest_sequence=common_attn_metadata.max_seq_len,
    )
    drafts = model.propose(batch, attending, kv_slots(model.kv_layer_names, slot_mappings))
    if model.policy is not None:
        model.policy.end_step([req_ids[row] for row in rows])
    log_drafting(model)
    per_request: list[list[int]] = [[] for _ in sampled_token_ids]
    for row, tokens in zip(rows, drafts):
        per_request[row] = tokens
    return per_request


def report_step(policy: GoodputPolicy, req_ids: list[str | None], sampled_token_ids: list[list[int]],
                num_draft_tokens: list[int] | None, num_tokens: int) -> None:
    """What the goodput policy learns from the step that just ran: how many tokens it ran for
    which requests, and per request how many drafts vLLM verified and accepted (all but the
    last sampled token are accepted drafts; a request still prefilling samples nothing)."""
    req_ids = req_ids[: len(sampled_token_ids)]
    verified = dict(zip(req_ids, num_draft_tokens or []))
    accepted = {req_id: len(sampled) - 1 for req_id, sampled in zip(req_ids, sampled_token_ids) if sampled}
    policy.observe_step(num_tokens, req_ids, verified, accepted)


LOG_INTERVAL_SECONDS = 30.0


def log_drafting(model: HeadsDraftModel) -> None:
    """Every LOG_INTERVAL_SECONDS, the drafting since the last line: mean draft tokens per
    request and step, and the share of steps that drafted nothing."""
    now = time.monotonic()
    last = model.stats_logged
    if last is None:
        model.stats_logged = (now, model.stats.as_dict())
        return
    if now - last[0] < LOG_INTERVAL_SECONDS:
        return
    current = model.stats.as_dict()
    steps, rows = current["steps"] - last[1]["steps"], current["rows"] - last[1]["rows"]
    if steps:
        logger.info("vllm-clover %s (draft_policy %s): %.2f draft tokens per request and step, "
                    "no drafts in %.0f%% of %d steps", model.method.name, model.draft_policy,
                    (current["drafted"] - last[1]["drafted"]) / max(rows, 1),
                    100 * (current["steps_without_drafts"] - last[1]["steps_without_drafts"]) / steps, steps)
    model.stats_logged = (now, current)


def kv_slots(layer_names: tuple[str, ...], slot_mappings: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
    """This step's KV slots in the draft model's attention layer (None without one)."""
    if not layer_names:
        return None
    if not isinstance(slot_mappings, dict) or layer_names[0] not in slot_mappings:
        raise RuntimeError(f"vllm-clover: draft attention layer {layer_names[0]} has no slot mapping in this runner")
    return slot_mappings[layer_names[0]]


def draft_attention(runner: GPUModelRunner, layer_names: tuple[str, ...],
                    common_attn_metadata: CommonAttentionMetadata,
                    slot_mappings: dict[str, torch.Tensor] | None) -> AbstractContextManager:
    """A forward context in which the draft model's own attention layers read and write
    their paged KV at this step's slots (the target's slots: same blocks, own tensors)."""
    if not layer_names:
        return nullcontext()
    metadata = {}
    for group in (g for groups in runner.attn_groups for g in groups):
        ours = [name for name in group.layer_names if name in layer_names]
        if ours:
            built = group.build_metadata(common_attn_metadata)
            metadata.update(dict.fromkeys(ours, built))
    missing = set(layer_names) - set(metadata)
    if missing or not isinstance(slot_mappings, dict):
        raise RuntimeError(f"vllm-clover: draft attention layers {sorted(missing or layer_names)} have no "
                           "KV cache group or slot mapping in this runner")
    return set_forward_context(metadata, runner.vllm_config, num_tokens=common_attn_metadata.num_actual_tokens,
                               slot_mapping={name: slot_mappings[name] for name in layer_names})
