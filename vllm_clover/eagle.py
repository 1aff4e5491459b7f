"""EAGLE-1 drafts (Li et al. 2024, arXiv 2401.15077), the peer to beat, in plain PyTorch:
trained by our trainer on the same data as our heads and served by vLLM's own EAGLE
proposer, `{"method": "eagle", "model": DIR}`, from a directory it loads unchanged.

One Llama decoder layer over a projection of the next token's embedding and a feature:

    f_{t+1}  = Layer(fc([E x_{t+1} ; h_t]))   h_t: the base's last hidden state (after its final norm)
    logits   = f_{t+1} W_lm^T                 the base's LM head, no norm: a guess at x_{t+2}

and each further draft feeds the draft's own f in place of the base's h, with the token
just drafted. vLLM 0.32's EagleLlamaForCausalLM (model_executor/models/llama_eagle.py)
drops the layer's input norm, has no final norm and no fc bias, names the weights
`fc.weight` and `layers.0.*` with no prefix, and shares the target's embedding and LM head
when the checkpoint has none: so the checkpoint is a one-layer Llama config with exactly
those tensors (the base's embedding is never copied: 28M parameters on SmolLM2).

Training, the authors' recipe (SafeAILab/EAGLE, eagle/train/main.py): the first draft
only, teacher-forced at every position; features regressed onto the base's next hidden
state with smooth L1, plus cross-entropy (weighted 0.1 to the regression's 1: here the
regression is weighted 10, the same under Adam) and uniform noise on the input features.
Evaluation unrolls all K drafts as vLLM serves them: draft j at position t attends to the
base's features up to t and to the draft's own entries for drafts 2..j (`unrolled_attention`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_clover.layers import (
    StateDictCheckpoint,
    TorchLlamaDecoderLayer,
    causal_attention,
    check_num_heads,
    decoder_layer_shape,
    numel,
)

REGRESSION_WEIGHT = 10.0  # the authors' 1.0 : 0.1 for regression : cross-entropy


@dataclass
class EagleConfig:
    num_heads: int                # K the draft is evaluated at (vLLM drafts any K with it)
    hidden_size: int
    vocab_size: int
    intermediate_size: int        # the decoder layer: the base's own layer shape
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    feature_noise: float = 0.2    # width of the uniform noise on input features in training

    def to_dict(self) -> dict:
        return asdict(self)


class EagleDraft(StateDictCheckpoint, nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        check_num_heads(config.num_heads)
        c = self.config = config
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        layer = TorchLlamaDecoderLayer(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                       c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta)
        layer.input_layernorm = nn.Identity()  # vLLM's EAGLE layer 0 has none
        self.layers = nn.ModuleList([layer])

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    # ---- the method-table interface (methods.DraftHeads) ----

    @classmethod
    def from_base(cls, base, num_heads: int, hyper: dict, draft_vocab: torch.Tensor | None = None) -> EagleDraft:
        """A fresh layer of the base's shape (the authors start from random weights)."""
        c = base.config
        return cls(EagleConfig(
            num_heads=num_heads, hidden_size=c.hidden_size, vocab_size=c.vocab_size, **decoder_layer_shape(c),
            max_position_embeddings=c.max_position_embeddings, **hyper))

    @classmethod
    def from_checkpoint(cls, config: dict) -> EagleDraft:
        return cls(EagleConfig(**config["vllm_clover"]["hyper"]))

    def checkpoint_hyper(self) -> dict:
        return self.config.to_dict()

    def vllm_config(self) -> dict:
        """The whole config.json vLLM reads: a one-layer Llama, which its EAGLE config renames
        to EagleLlamaForCausalLM (no "bias" key: vLLM would read it as attention bias)."""
        c = self.config
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False,
        }

    def parameters_read_per_step(self, hidden_size: int, vocab_size: int) -> int:
        """Weights K drafts read: the layer and fc once per draft, and the full LM head each."""
        return self.num_heads * (numel(self) + vocab_size * hidden_size)

    # ---- training and evaluation ----

    def forward(self, h_base: torch.Tensor, input_ids: torch.Tensor, lm_head_weight: torch.Tensor,
                embed_weight: torch.Tensor | None = None) -> tuple[list[torch.Tensor], None, torch.Tensor]:
        """(logits per draft j: [B, T-1-j, V], no length logits, the weighted regression loss
        per position of the first draft [B, T-2]). Training gives the first draft only (the
        authors' EAGLE-1); evaluation all K. `embed_weight`: the base's input embedding."""
        if embed_weight is None:
            raise ValueError("EAGLE drafts read the base's input embedding: pass embed_weight")
        B, T = input_ids.shape
        positions = torch.arange(T - 1, device=input_ids.device).expand(B, T - 1)
        features = h_base[:, :-1]
        if self.training and self.config.feature_noise:
            features = features + (torch.rand_like(features) - 0.5) * self.config.feature_noise
        embeddings = F.embedding(input_ids, embed_weight)
        first_keys: list[torch.Tensor] = []
        f = self.layers[0](self.fc(torch.cat([embeddings[:, 1:], features], -1)), positions,
                           keeping_keys(first_keys))                       # f_{t+1}, t = 0..T-2
        regression = REGRESSION_WEIGHT * F.smooth_l1_loss(
            f[:, :-1].float(), h_base[:, 1:-1].float(), reduction="none").mean(-1)
        logits = [f[:, : T - 2] @ lm_head_weight.T]
        own_keys: list[torch.Tensor] = []
        for j in range(2, 1 if self.training else self.num_heads + 1):
            valid = T - 1 - j                                              # rows t = 0..T-2-j
            if valid <= 0:
                break
            x = self.fc(torch.cat([embeddings[:, j : j + valid], f[:, :valid]], -1))
            own_keys = [(k[:, :valid], v[:, :valid]) for k, v in own_keys]
            f = self.layers[0](x, positions[:, :valid] + (j - 1),
                               unrolled_attention(first_keys[0], own_keys))
            logits.append(f @ lm_head_weight.T)
        return logits, None, regression


def keeping_keys(store: list) -> Callable:
    """Causal attention over the sequence that also keeps its (rotated) keys and values."""

    def attend(q, k, v):
        store.append((k, v))
        return causal_attention(q, k, v)
    return attend


def unrolled_attention(first: tuple[torch.Tensor, torch.Tensor], own: list) -> Callable:
    """Attention for draft j at every position t at once: the query sees the first pass's keys
    at positions <= t and, from drafts 2..j, only the entries drafted from t itself (what
    vLLM's paged cache holds when it drafts from t). `own` collects this draft's entry."""

    def attend(q, k, v):
        own.append((k, v))
        first_k, first_v = first
        T, groups = q.shape[1], q.shape[-2] // k.shape[-2]
        q32 = q.float().transpose(1, 2)                                   # [B, heads, T, d]
        expand = lambda x: x.float().repeat_interleave(groups, dim=-2).transpose(1, 2)  # noqa: E731
        scores = q32 @ expand(first_k[:, :T]).transpose(-1, -2)           # [B, heads, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonal = torch.stack([(q32 * expand(ok)).sum(-1) for ok, _ in own], -1)  # [B, heads, T, j-1]
        weights = (torch.cat([scores, diagonal], -1) * q.shape[-1] ** -0.5).softmax(-1)
        out = weights[..., :T] @ expand(first_v[:, :T])
        out = out + sum(weights[..., T + i, None] * expand(ov) for i, (_, ov) in enumerate(own))
        return out.transpose(1, 2).to(q.dtype)
    return attend
