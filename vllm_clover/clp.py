"""CLP: collocation-length prediction (shared/papers/clp.txt), in plain PyTorch.

"Backbone as architect": the base model always produces the next token itself. K MLP
heads on the base's hidden state h_t guess the tokens after it (head i -> x_{t+1+i}, as
in clover.py), through the base's own LM head. A single linear layer on h_t predicts the
collocation length L in 0..K: how many of those guesses in a row are right. At serving
time a threshold tau turns its distribution into a per-request draft length:

    L = max { l : P(L* >= l) >= tau }        (P(L* >= 0) = 1, so L >= 0)

Lower tau drafts more. tau is chosen on validation data and stored in the checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from vllm_clover.draft_policy import GoodputPolicy
from vllm_clover.layers import (
    DraftVocabulary,
    LmHead,
    ResidualBlock,
    StateDictCheckpoint,
    check_num_heads,
    head_labels,
    numel,
)


class ClpHeads(StateDictCheckpoint, DraftVocabulary, nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, tau: float = 0.5, draft_vocab_size: int | None = None):
        super().__init__()
        check_num_heads(num_heads)
        self.num_heads = num_heads
        self.tau = tau
        self.mlps = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        self.length = nn.Linear(hidden_size, num_heads + 1)
        self.init_draft_vocab(draft_vocab_size)

    # ---- the method-table interface (methods.DraftHeads) ----

    @classmethod
    def from_base(cls, base, num_heads: int, hyper: dict, draft_vocab: torch.Tensor | None = None) -> ClpHeads:
        heads = cls(num_heads, base.config.hidden_size, draft_vocab_size=None if draft_vocab is None
                    else len(draft_vocab), **hyper)
        if draft_vocab is not None:
            heads.set_draft_vocab(draft_vocab)
        return heads

    @classmethod
    def from_checkpoint(cls, config: dict) -> ClpHeads:
        hyper = config["vllm_clover"]["hyper"]
        return cls(hyper["num_heads"], config["hidden_size"], tau=hyper["tau"],
                   draft_vocab_size=hyper.get("draft_vocab_size"))

    def checkpoint_hyper(self) -> dict:
        size = None if self.draft_vocab is None else len(self.draft_vocab)
        return {"num_heads": self.num_heads, "tau": self.tau, "draft_vocab_size": size}

    def parameters_read_per_step(self, hidden_size: int, vocab_size: int) -> int:
        """Weights a step drafting all K heads reads: the length predictor, each head's MLP and
        one LM-head scoring per head (a shorter predicted length reads less)."""
        return numel(self) + self.num_heads * self.scored_rows(vocab_size) * hidden_size

    def forward(self, h_base: torch.Tensor, input_ids: torch.Tensor, lm_head_weight: torch.Tensor,
                embed_weight: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(per head, logits [B, T-1-i, V or N] through the base's LM head; length logits [B, T, K+1])."""
        T, out_weight = h_base.shape[1], self.output_weight(lm_head_weight)
        logits = [mlp(h_base[:, : T - 1 - i]) @ out_weight.T for i, mlp in enumerate(self.mlps, start=1)]
        return logits, self.length(h_base)

    def draft_confidence(self, logits: list[torch.Tensor], length_logits: torch.Tensor,
                         positions: int) -> torch.Tensor:
        """Each draft's confidence as the goodput policy reads it when serving, at the first
        `positions` positions: [B, positions, K]."""
        return torch.from_numpy(conditional_lengths(length_logits[:, :positions].float().cpu().numpy()))

    @torch.no_grad()
    def draft_lengths(self, h: torch.Tensor, tau: float | None = None) -> torch.Tensor:
        """h [N, H] -> draft length per row in 0..K."""
        return lengths_at_threshold(self.length(h).softmax(-1), self.tau if tau is None else tau)

    @torch.no_grad()
    def draft(self, h: torch.Tensor, lm_head: LmHead, num_tokens: int | None = None) -> torch.Tensor:
        """h [R, H] -> [R, num_tokens] guesses for x_{t+2}.. from the first heads (truncate
        each row to its draft length). `lm_head`: `output_head(the base's LM head)`."""
        mlps = self.mlps[: self.num_heads if num_tokens is None else num_tokens]
        return torch.stack([lm_head.greedy(mlp(h)) for mlp in mlps], dim=-1)

    def draft_depth(self, budgets: list[int], policy: GoodputPolicy | None = None) -> int:
        """The largest budget: CLP's lengths come from its predictor on h, in `propose`."""
        return max(budgets, default=0)

    @torch.no_grad()
    def propose(self, h: torch.Tensor, next_token: torch.Tensor, lm_head: LmHead, budgets: list[int],
                policy: GoodputPolicy | None = None) -> list[list[int]]:
        """Each row drafts its predicted length, capped by its budget (the base produced
        next_token itself; CLP's heads guess only from h). Without a policy the length is the
        threshold rule; a policy weighs the predicted chance of each length against the cost."""
        if policy is None:
            lengths = [min(n, budget) for n, budget in zip(self.draft_lengths(h).tolist(), budgets)]
        else:
            conditional = conditional_lengths(self.length(h).float().cpu().numpy())
            lengths = policy.lengths(conditional, budgets, heads_to_run=True)
        if max(lengths) == 0:
            return [[] for _ in lengths]
        drafts = self.draft(h, lm_head, max(lengths))
        return [row[:n] for row, n in zip(drafts.tolist(), lengths)]


def conditional_lengths(length_logits: np.ndarray) -> np.ndarray:
    """Length logits [..., K+1] -> [..., K]: P(L* >= j | L* >= j-1), what the goodput policy
    reads as draft j's confidence.

    In numpy, on the logits as the heads' one copy to the host: served every step for every
    row, where nine small torch ops cost more than the length head itself. A ratio of tail
    sums needs no normalising, only the largest logit subtracted (the largest term is 1)."""
    weights = np.exp(length_logits - length_logits.max(-1, keepdims=True))
    at_least = np.cumsum(weights[..., ::-1], -1)[..., ::-1]  # P(L* >= l), unnormalised
    return np.minimum(at_least[..., 1:] / np.maximum(at_least[..., :-1], 1e-30), 1.0)


def at_least_lengths(probs: torch.Tensor) -> torch.Tensor:
    """probs [..., K+1] over L* -> [..., l] = P(L* >= l)."""
    return probs.flip(-1).cumsum(-1).flip(-1)


def lengths_at_threshold(probs: torch.Tensor, tau: float) -> torch.Tensor:
    """probs [..., K+1] over L* -> the longest l with P(L* >= l) >= tau."""
    return (at_least_lengths(probs) >= tau).sum(-1) - 1


def collocation_lengths(head_logits: list[torch.Tensor], label_ids: torch.Tensor) -> torch.Tensor:
    """L*: at each position where all K heads have a label, how many leading heads are right.

    head_logits: K tensors [B, T-1-i, V or N]; label_ids [B, T]: the tokens as indices into the
    heads' output vocabulary (layers.draft_vocab_labels) -> [B, T-1-K] in 0..K.
    """
    n = head_logits[-1].shape[1]  # positions valid for every head
    correct = torch.stack([(logits[:, :n].argmax(-1) == head_labels(label_ids, i)[:, :n])
                           for i, logits in enumerate(head_logits, start=1)], dim=-1)  # [B, n, K]
    return correct.long().cumprod(-1).sum(-1)
