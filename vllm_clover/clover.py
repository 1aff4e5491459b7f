"""Clover draft heads (Xiao et al. 2024, arXiv 2405.00263, section 3), in plain PyTorch.

Shared by the trainer and by the vLLM proposer. The base model stays frozen and
outside this module: its final hidden states come in, and its LM head weight is passed
to every call that needs it (shared, never copied into the checkpoint).

    base hidden states h_base [T, H] (after the base's final norm, as vLLM returns them)
      -> Augmenting Block: one extra Llama decoder layer + norm (init: the base's last layer,
         or that layer adding nothing at first: CloverHeads.init_from_base)
      -> h_0
    for head i = 1..K:
      h_i      = h_{i-1} + RegressiveBlock(h_{i-1}, e_{i-1})   (Attention Decoder by default)
      logits_i = LMHead(MLP_i(h_i))
      e_i      = normalised LM-head row of head i's token       (e_0: the base's own token)

The Attention Decoder attends from one query to one key, where softmax attention is
identically 1 and Q, K would never learn. Like the authors' Clover-2 code, each
attention head instead gates its value by the cosine similarity of query and key
(a weight in [-1, 1]), so Q and K shape the output and receive gradient.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_clover.draft_policy import GoodputPolicy
from vllm_clover.layers import (
    DenseLmHead,
    DraftVocabulary,
    LmHead,
    ResidualBlock,
    StateDictCheckpoint,
    TorchLlamaDecoderLayer,
    TorchRMSNorm,
    causal_attention,
    check_num_heads,
    decoder_layer_shape,
    numel,
    rms_normalize,
    top1_of,
)

Regressive = Literal["attention", "mlp", "none"]
AugmentInit = Literal["last_layer", "identity"]


@dataclass
class CloverConfig:
    num_heads: int                      # K: draft tokens per step
    hidden_size: int
    vocab_size: int
    # Shape of the augmenting block: a copy of the base's decoder layer shape.
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    decoder_heads: int = 4              # attention heads of the Attention Decoder gate
    init_noise: float = 0.01            # Q, K = identity + U(-noise, noise)
    # Ablations of the paper's Figure 7a.
    augmenting_block: bool = True
    augment_init: AugmentInit = "last_layer"  # how training starts the augmenting block (init_from_base)
    regressive: Regressive = "attention"
    draft_vocab_size: int | None = None  # N: heads score N frequent tokens (layers.DraftVocabulary)

    def __post_init__(self):
        check_num_heads(self.num_heads)
        if self.regressive not in ("attention", "mlp", "none"):
            raise ValueError(f"regressive must be 'attention', 'mlp' or 'none', got {self.regressive!r}")
        if self.augment_init not in ("last_layer", "identity"):
            raise ValueError(f"augment_init must be 'last_layer' or 'identity', got {self.augment_init!r}")
        if self.hidden_size % self.decoder_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by decoder_heads {self.decoder_heads}")

    def to_dict(self) -> dict:
        return asdict(self)


class AttentionDecoder(nn.Module):
    """h + concat_g( cos(Q_g norm(h), K_g e) * V_g e ) over G gate heads."""

    def __init__(self, hidden_size: int, num_gate_heads: int, eps: float, init_noise: float):
        super().__init__()
        self.num_gate_heads = num_gate_heads
        self.norm = TorchRMSNorm(hidden_size, eps)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj):
                proj.weight.uniform_(-init_noise, init_noise).add_(torch.eye(hidden_size))
            # V = 0: a fresh decoder returns its input, so training starts from Medusa-like heads.
            self.v_proj.weight.zero_()

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        split = lambda x: x.unflatten(-1, (self.num_gate_heads, -1))  # noqa: E731
        q, k, v = split(self.q_proj(self.norm(h))), split(self.k_proj(e)), split(self.v_proj(e))
        gate = F.cosine_similarity(q, k, dim=-1, eps=1e-6)  # [..., G] in [-1, 1]
        return h + (gate[..., None] * v).flatten(-2)


class ConcatMlpDecoder(nn.Module):
    """Ablation: h + W [norm(h); e], zero-initialised (the paper's 'MLP as regressive block')."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = TorchRMSNorm(hidden_size, eps)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.proj(torch.cat([self.norm(h), e], dim=-1)))


class CloverHeads(StateDictCheckpoint, DraftVocabulary, nn.Module):
    def __init__(self, config: CloverConfig):
        super().__init__()
        c = self.config = config
        if c.augmenting_block:
            self.augment = TorchLlamaDecoderLayer(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                             c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta)
            self.augment_norm = TorchRMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.regressive == "attention":
            self.decoder = AttentionDecoder(c.hidden_size, c.decoder_heads, c.rms_norm_eps, c.init_noise)
        elif c.regressive == "mlp":
            self.decoder = ConcatMlpDecoder(c.hidden_size, c.rms_norm_eps)
        self.mlps = nn.ModuleList(ResidualBlock(c.hidden_size) for _ in range(c.num_heads))
        self.init_draft_vocab(c.draft_vocab_size)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    # ---- the method-table interface (methods.DraftHeads) ----

    @classmethod
    def from_base(cls, base, num_heads: int, hyper: dict, draft_vocab: torch.Tensor | None = None) -> CloverHeads:
        """The augmenting block takes the base's decoder-layer shape and starts as its last layer."""
        c = base.config
        heads = cls(CloverConfig(
            num_heads=num_heads, hidden_size=c.hidden_size, vocab_size=c.vocab_size, **decoder_layer_shape(c),
            draft_vocab_size=None if draft_vocab is None else len(draft_vocab), **hyper))
        heads.init_from_base(base.last_layer_state(), base.final_norm_weight())
        if draft_vocab is not None:
            heads.set_draft_vocab(draft_vocab)
        return heads

    @classmethod
    def from_checkpoint(cls, config: dict) -> CloverHeads:
        return cls(CloverConfig(**config["vllm_clover"]["hyper"]))

    def checkpoint_hyper(self) -> dict:
        return self.config.to_dict()

    def parameters_read_per_step(self, hidden_size: int, vocab_size: int) -> int:
        """Weights one full draft step reads (bound by memory traffic at small batches): the
        augmenting block once, the shared regressive decoder and one LM-head scoring per head."""
        c = self.config
        block = numel(self.augment) + numel(self.augment_norm) if c.augmenting_block else 0
        decoder = numel(self.decoder) if c.regressive != "none" else 0
        return block + c.num_heads * (decoder + self.scored_rows(vocab_size) * hidden_size) + numel(self.mlps)

    @torch.no_grad()
    def init_from_base(self, last_layer_state: dict[str, torch.Tensor], final_norm_weight: torch.Tensor) -> None:
        """Augmenting block := the base's last decoder layer; its norm := the base's final norm.

        "identity" also zeroes the layer's two output projections, so the block starts by
        passing the base's hidden state through (rescaled to the final norm's RMS, which keeps
        its direction and so the base's own prediction) and learns what to add. The paper's
        copy re-applies the last layer to an input that has already been through it and the
        final norm: on SmolLM2 each fresh head's cross-entropy was 29, against 10-12 with the
        identity start."""
        if not self.config.augmenting_block:
            return
        self.augment.load_state_dict(last_layer_state)
        if self.config.augment_init == "identity":
            self.augment.self_attn["o_proj"].weight.zero_()
            self.augment.mlp["down_proj"].weight.zero_()
            self.augment_norm.weight.fill_(final_norm_weight.float().pow(2).mean().sqrt().item())
        else:
            self.augment_norm.weight.copy_(final_norm_weight)

    # ---- the pieces, used by both the sequence (training) and the serving paths ----

    def augmented(self, h_base: torch.Tensor, positions: torch.Tensor, attend=causal_attention) -> torch.Tensor:
        """h_0 for every position. h_base [..., T, H], positions [..., T]."""
        if not self.config.augmenting_block:
            return h_base
        return self.augment_norm(self.augment(h_base, positions, attend))

    def step(self, i: int, h: torch.Tensor, e_prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head i (0-based): (h_{i+1}, the hidden state head i's logits are read from)."""
        if self.config.regressive != "none":
            h = self.decoder(h, e_prev)
        return h, self.mlps[i](h)

    # ---- training: all heads at all positions, regressive inputs teacher-forced ----

    def forward(self, h_base: torch.Tensor, input_ids: torch.Tensor,
                lm_head_weight: torch.Tensor,
                embed_weight: torch.Tensor | None = None) -> tuple[list[torch.Tensor], None]:
        """(per head, logits [B, T-1-i, V or N] through the base's LM head; no length logits)."""
        out_weight = self.output_weight(lm_head_weight)
        return [h @ out_weight.T for h in self.head_hidden_states(h_base, input_ids, lm_head_weight)], None

    def head_hidden_states(self, h_base: torch.Tensor, input_ids: torch.Tensor, lm_head_weight: torch.Tensor,
                           positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per head, the hidden states its logits come from: a list of K tensors [B, T-1-i, H].

        Target shift (B = batch, T = sequence, x = input_ids):

            position t            0     1     2    ...   T-1
            base LM head at t  -> x1    x2    x3         (x_T, not in the batch)
            e_0 at t           =  x1    x2    x3         the token the base produced
            head 1 at t        -> x2    x3    x4         valid for t <= T-3
            head i at t        -> x_{t+1+i}, seeing e_j = x_{t+1+j} for j < i

        Head i (1-based) is trained at positions t = 0 .. T-2-i, so its output has T-1-i
        rows, and its labels are input_ids[:, 1+i:]. In serving, e_0 is the token vLLM
        just sampled, which on self-distilled data is exactly x_{t+1}.
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        h = self.augmented(h_base, positions)[:, :-1]           # positions 0..T-2
        emb = token_embeddings(lm_head_weight, input_ids)        # e for every token
        outs = []
        for i in range(self.config.num_heads):
            valid = T - 1 - (i + 1)                              # rows t = 0..T-3-i
            if valid <= 0:
                break
            h, out = self.step(i, h[:, :valid], emb[:, 1 + i : 1 + i + valid])
            outs.append(out)
        return outs

    # ---- serving: greedy chain from the base's sampled token ----

    @torch.no_grad()
    def draft(self, h0: torch.Tensor, first_token: torch.Tensor, lm_head: LmHead,
              num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy chain of `num_tokens` drafts per row. h0 [R, H] (augmented), first_token [R]
        (what the base just sampled) -> (token ids [R, num_tokens], each one's probability
        under its head [R, num_tokens]). `lm_head` is what the heads draft through:
        `output_head(the base's LM head)`."""
        h, token, drafts, confidence = h0, first_token, [], []
        for i in range(num_tokens):
            h, out = self.step(i, h, rms_normalize(lm_head.rows(token)))
            token, probability = lm_head.top1(out)
            drafts.append(token)
            confidence.append(probability)
        return torch.stack(drafts, dim=-1), torch.stack(confidence, dim=-1)

    def draft_confidence(self, logits: list[torch.Tensor], length_logits: None, positions: int) -> torch.Tensor:
        """Each draft's confidence as the goodput policy reads it when serving (its head's top-1
        probability), at the first `positions` positions: [B, positions, K]."""
        return torch.stack([top1_of(head[:, :positions])[1] for head in logits], dim=-1)

    def draft_depth(self, budgets: list[int], policy: GoodputPolicy | None = None) -> int:
        """How many heads run this step (0: none): the largest budget, or as deep as the
        policy finds worth it for this batch before seeing any head's confidence."""
        return max(budgets, default=0) if policy is None else policy.heads_to_run(budgets)

    def propose(self, h0: torch.Tensor, next_token: torch.Tensor, lm_head: LmHead, budgets: list[int],
                policy: GoodputPolicy | None = None) -> list[list[int]]:
        """One chain as long as the largest budget, each row cut to its own, or, with a
        policy, to what each head's confidence makes worth verifying."""
        drafts, confidence = self.draft(h0, next_token, lm_head, max(budgets))
        if policy is not None:
            budgets = policy.lengths(confidence.float().cpu().numpy(), budgets)
        return [row[:n] for row, n in zip(drafts.tolist(), budgets)]


def token_embeddings(lm_head_weight: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The regressive input e: the token's LM-head row, scaled to unit RMS so it lives on the
    same scale as the base's normalised hidden states (paper: 'normalised LM-head weight')."""
    return rms_normalize(DenseLmHead(lm_head_weight).rows(token_ids))
