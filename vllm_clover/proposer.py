"""The runner side of our proposers: one engine step's inputs -> draft tokens per request.

Called from the patched `GPUModelRunner.propose_draft_token_ids` (patches.py) after the
runner's CPU bookkeeping, when vLLM's rejection sampler has settled this step's tokens.
The runner hands over everything the target computed; this module picks out what the
draft model needs (`DraftBatch`), runs it with attention metadata for its own KV layers,
and returns `list[list[int]]`, one list per request in batch order. vLLM's scheduler
takes lists of any length up to K, so draft lengths may differ per request (CLP) and
empty lists mean "no drafts" (requests still in prefill, or CLP predicting none).

Known gap: vLLM skips the whole draft step when some request in the batch is within K
tokens of max_model_len (`GPUModelRunner._input_fits_in_drafter`). Clover's augmenting
block then does not write its KV for that step's tokens, so later drafts of the other
requests read stale entries there: fewer accepted drafts, never different output.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from vllm.forward_context import set_forward_context

from vllm_clover.vllm_models import DraftBatch, DraftModel

# Set on vLLM's RejectionSampler of a runner whose drafts are trusted (patches.py).
TRUST_DRAFTS_ATTR = "vllm_clover_trust_drafts"


@torch.inference_mode()
def propose(runner, model: DraftModel, scheduler_output, sampled_token_ids: list[list[int]],
            hidden_states: torch.Tensor, spec_decode_metadata, common_attn_metadata,
            slot_mappings) -> list[list[int]]:
    model.bind_target(runner.get_model())
    if model.options.trust_drafts:
        setattr(runner.rejection_sampler, TRUST_DRAFTS_ATTR, True)
    budget = scheduler_output.num_spec_tokens_to_schedule
    batch, rows = draft_batch(runner, sampled_token_ids, hidden_states, spec_decode_metadata,
                              common_attn_metadata, budget)
    with draft_attention(runner, model.kv_layer_names, common_attn_metadata, slot_mappings):
        drafts = model.propose(batch)
    per_request: list[list[int]] = [[] for _ in sampled_token_ids]
    for row, tokens in zip(rows, drafts):
        per_request[row] = tokens
    return per_request


def draft_batch(runner, sampled_token_ids: list[list[int]], hidden_states: torch.Tensor,
                spec_decode_metadata, common_attn_metadata, budget: int) -> tuple[DraftBatch, list[int]]:
    """(the DraftBatch, the batch row of each of its requests).

    Request r's tokens occupy hidden_states[qsl[r]:qsl[r+1]]: the new tokens, then its
    d_r drafts. Of the sampled tokens, the last one came from the hidden state at the
    last *accepted* position, qsl[r+1] - 1 - d_r + (len(sampled_r) - 1).
    """
    num_tokens = common_attn_metadata.num_actual_tokens
    qsl = common_attn_metadata.query_start_loc_cpu[: len(sampled_token_ids) + 1].tolist()
    num_drafts = (spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None
                  else [0] * len(sampled_token_ids))
    rows, last_index, next_token = [], [], []
    for row, sampled in enumerate(sampled_token_ids):
        if not sampled:  # a prefill chunk that is not the last, or a discarded request
            continue
        rows.append(row)
        last_index.append(qsl[row + 1] - 1 - num_drafts[row] + len(sampled) - 1)
        next_token.append(sampled[-1])
    device = hidden_states.device
    batch = DraftBatch(
        hidden_states=hidden_states[:num_tokens],
        positions=runner._get_positions(num_tokens),
        last_index=torch.tensor(last_index, dtype=torch.long, device=device),
        next_token=torch.tensor(next_token, dtype=torch.long, device=device),
        max_len=[budget] * len(rows),
    )
    return batch, rows


def draft_attention(runner, layer_names: tuple[str, ...], common_attn_metadata, slot_mappings):
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
