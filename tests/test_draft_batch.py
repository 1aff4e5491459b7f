"""The runner hook's index arithmetic and the heads' draft budgets, without an engine.

In the manner of vLLM's tests/v1/spec_decode/test_ngram.py: hand-built step inputs (what
vLLM's runner hands the hook after rejection sampling) and the exact rows expected.
"""

from __future__ import annotations

import torch

from vllm_clover.clp import ClpHeads
from vllm_clover.draft_batch import draft_batch, room_for_drafts
from vllm_clover.layers import DenseLmHead

H = 8


def step(query_lens: list[int], sampled: list[list[int]], num_draft_tokens: list[int] | None, budget: int = 4,
         max_model_len: int = 1024):
    """draft_batch over a step whose requests scheduled `query_lens` tokens each; hidden state
    row i holds the value i, so an index can be read back from the states it selects."""
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    total = query_start_loc[-1]
    hidden = torch.arange(total, dtype=torch.float32)[:, None].expand(total, H)
    positions = torch.arange(100, 100 + total)
    longest = int(positions.max()) + 1 if total else 0  # vLLM's max_seq_len: positions run from 0
    return draft_batch(sampled, query_start_loc, num_draft_tokens, hidden, positions, budget, max_model_len, longest)


def test_decodes_without_drafts_continue_from_their_only_token():
    batch, rows = step([1, 1, 1], [[11], [12], [13]], None)
    assert rows == [0, 1, 2]
    assert batch.last_index.tolist() == [0, 1, 2]
    assert batch.next_token.tolist() == [11, 12, 13]
    assert batch.budgets == [4, 4, 4]


def test_prefill_chunks_draft_only_after_their_last_chunk():
    # Request 0: a 5-token chunk of a longer prompt (nothing sampled). Request 1: the last
    # 4-token chunk of its prompt (its first output token sampled at its last row, 8).
    batch, rows = step([5, 4], [[], [21]], [0, 0])
    assert rows == [1]
    assert batch.last_index.tolist() == [8]
    assert batch.next_token.tolist() == [21]
    # Every scheduled token stays in the batch: an augmenting block writes KV for all of them.
    assert batch.hidden_states.shape == (9, H)
    assert batch.positions.tolist() == list(range(100, 109))


def test_drafts_continue_from_the_last_accepted_position():
    # Each request verified 3 drafts (1 new token + 3 drafts = 4 rows, starting at 0, 4, 8, 12).
    # Sampled = accepted drafts + the target's own token: 1 (all rejected) .. 4 (all accepted).
    sampled = [[30], [40, 41], [50, 51, 52], [60, 61, 62, 63]]
    batch, rows = step([4, 4, 4, 4], sampled, [3, 3, 3, 3])
    assert rows == [0, 1, 2, 3]
    assert batch.last_index.tolist() == [0, 5, 10, 15]
    assert batch.next_token.tolist() == [30, 41, 52, 63]


def test_mixed_step_with_draft_lengths_that_differ_and_a_discarded_request():
    # Row 0: decode with 2 drafts, 1 accepted. Row 1: discarded (e.g. aborted) -> no drafts.
    # Row 2: no drafts last step (CLP predicted 0), one new token. Row 3: 4 drafts, none accepted.
    sampled = [[70, 71], [], [80], [90]]
    batch, rows = step([3, 2, 1, 5], sampled, [2, 1, 0, 4], budget=3)
    assert rows == [0, 2, 3]
    # qsl = [0, 3, 5, 6, 11]: row 0 -> 3-1-2+1 = 1; row 2 -> 6-1-0+0 = 5; row 3 -> 11-1-4+0 = 6.
    assert batch.last_index.tolist() == [1, 5, 6]
    assert batch.next_token.tolist() == [71, 80, 90]
    assert batch.hidden_states[batch.last_index, 0].tolist() == [1.0, 5.0, 6.0]
    assert batch.budgets == [3, 3, 3]


def test_near_max_model_len_budgets_shrink_to_what_the_scheduler_can_place():
    # Positions 100..103, one decode each. With max_model_len 106 the request at position p
    # may still schedule its next token at p + 1 and drafts up to position 104 (105 is left
    # for the token that step samples): 3, 2, 1, 0 drafts.
    batch, rows = step([1, 1, 1, 1], [[1], [2], [3], [4]], None, budget=4, max_model_len=106)
    assert rows == [0, 1, 2, 3]
    assert batch.budgets == [3, 2, 1, 0]
    assert room_for_drafts(104, 106) == 0 and room_for_drafts(100, 1024) > 4


def test_a_step_where_nobody_sampled_has_no_rows():
    batch, rows = step([6], [[]], None)
    assert rows == [] and batch.budgets == []
    assert batch.last_index.shape == (0,)


def test_clp_drafts_its_predicted_length_capped_by_the_budget():
    torch.manual_seed(0)
    heads = ClpHeads(num_heads=3, hidden_size=H, tau=0.5)
    with torch.no_grad():
        heads.length.weight.zero_()
        heads.length.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # P(L* = 3) ~ 1
    h = torch.randn(1, H).expand(3, H)  # one state, three budgets
    lm_head = DenseLmHead(torch.randn(11, H))
    drafts = heads.propose(h, torch.tensor([1, 2, 3]), lm_head, budgets=[3, 1, 0])
    assert [len(d) for d in drafts] == [3, 1, 0]
    assert drafts[1] == drafts[0][:1]  # the same guesses, cut to each budget
