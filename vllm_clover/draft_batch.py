"""One engine step's target outputs, cut down to what a draft model needs (vLLM-free).

The runner hook (proposer.py) reads vLLM's step metadata into plain lists and tensors and
calls `draft_batch`; tests build the same inputs by hand (tests/test_draft_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class DraftBatch:
    """What a draft model sees in one engine step.

    hidden_states / positions cover every token the target just ran (prefill chunks,
    decodes and rejected drafts alike); the other fields cover only the rows that get
    drafts, i.e. requests that sampled a token this step. Their row indices and tokens
    become tensors only when the heads read them: most steps under load draft nothing.
    """

    hidden_states: torch.Tensor   # [N, H] the target's last hidden states (after its final norm)
    positions: torch.Tensor       # [N]
    last_rows: list[int]          # [R] row of hidden_states at each request's last accepted token
    next_tokens: list[int]        # [R] the token the target just produced for it
    budgets: list[int]            # [R] most draft tokens each request may get; proposers may return fewer

    @cached_property
    def last_index(self) -> torch.Tensor:
        return torch.tensor(self.last_rows, dtype=torch.long, device=self.hidden_states.device)

    @cached_property
    def next_token(self) -> torch.Tensor:
        return torch.tensor(self.next_tokens, dtype=torch.long, device=self.hidden_states.device)


def draft_batch(sampled_token_ids: list[list[int]], query_start_loc: list[int], num_draft_tokens: list[int] | None,
                hidden_states: torch.Tensor, positions: torch.Tensor, budget: int,
                max_model_len: int, longest_sequence: int) -> tuple[DraftBatch, list[int]]:
    """(the DraftBatch, the batch row of each of its requests).

    Request r's scheduled tokens occupy rows query_start_loc[r] .. query_start_loc[r+1]-1
    of hidden_states: its new tokens, then the d_r drafts verified this step. vLLM sampled
    len(sampled_r) tokens for it: the accepted drafts plus one from the target. That last
    one came from the hidden state at the last *accepted* position,

        query_start_loc[r+1] - 1 - d_r + (len(sampled_r) - 1),

    which is where its drafts continue from. A request that sampled nothing (a prefill
    chunk that is not its last, or a request vLLM discarded) gets no drafts.

    Near max_model_len a request's budget shrinks to what vLLM's scheduler can still place
    (`room_for_drafts`), so every request keeps drafting and the draft model keeps writing
    its KV for every step, up to the last position. `longest_sequence`: the most tokens any
    request has after this step's (vLLM's max_seq_len); while even that one has room for
    the full budget, no request's position needs reading.
    """
    num_drafts = num_draft_tokens if num_draft_tokens is not None else [0] * len(sampled_token_ids)
    rows, last_rows, next_tokens = [], [], []
    for row, sampled in enumerate(sampled_token_ids):
        if not sampled:
            continue
        rows.append(row)
        last_rows.append(query_start_loc[row + 1] - 1 - num_drafts[row] + len(sampled) - 1)
        next_tokens.append(sampled[-1])
    batch = DraftBatch(hidden_states=hidden_states, positions=positions, last_rows=last_rows,
                       next_tokens=next_tokens, budgets=[budget] * len(rows))
    if room_for_drafts(longest_sequence - 1, max_model_len) < budget and rows:
        batch.budgets = [min(budget, room_for_drafts(p, max_model_len)) for p in positions[batch.last_index].tolist()]
    return batch, rows


def room_for_drafts(last_position: int, max_model_len: int) -> int:
    """Drafts vLLM 0.32's scheduler can still schedule after the token at `last_position`:
    the next step runs the sampled token and its drafts from position last_position + 1 and
    must leave one position for the token it samples (Scheduler.schedule caps new tokens at
    max_model_len - computed - 1), so 1 + drafts <= max_model_len - (last_position + 1) - 1."""
    return max(max_model_len - last_position - 3, 0)
