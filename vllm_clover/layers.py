"""Building blocks shared by the draft models, in plain PyTorch (no vLLM imports).

Training runs them over [batch, seq, hidden] tensors; vLLM's runner runs the same
modules over its flattened [tokens, hidden] batch. Only the attention kernel differs,
so the Llama-style layer takes it as an argument.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

# attend(q [..., T, n_heads, d], k [..., T, n_kv, d], v [..., T, n_kv, d]) -> [..., T, n_heads, d]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LmHead(Protocol):
    """The base model's output projection, as the draft heads use it. Training holds the
    weight matrix (`DenseLmHead`); vLLM holds a vocab-sharded layer behind the same calls."""

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The LM-head weight rows of `token_ids` ([...] -> [..., H])."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]."""

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] the token id with the highest logit."""

    def top1(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> (the greedy token ids [...], their softmax probability [...])."""


def top1_of(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, its softmax probability) over the last dim: 1 / sum exp(logit - max)."""
    best, index = logits.max(-1)
    return index, torch.exp(best - torch.logsumexp(logits.float(), -1))


class DenseLmHead:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.T

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).argmax(-1)

    def top1(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return top1_of(self.logits(hidden))


# rows [N, H] -> (hidden [..., H] -> scores [..., N])
MakeScorer = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def dense_scorer(rows: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda hidden: hidden @ rows.T


class DraftVocabHead:
    """The LM head restricted to a draft vocabulary (FR-Spec, EAGLE-3's `d2t`): heads score
    only its N most frequent tokens instead of all V, so each draft step reads N rows of the
    LM head, not V. Drafts can only be those N tokens; verification still scores the full
    vocabulary, so outputs are unchanged, and only drafts outside it are lost."""

    def __init__(self, lm_head: LmHead, draft_vocab: torch.Tensor, make_scorer: MakeScorer | None = None):
        """`make_scorer(rows)` -> the function that scores hidden states against those N rows;
        by default a plain matmul. Serving may pack the rows for a faster kernel or a smaller
        dtype: at small batches a draft step is bound by reading them, and drafts are only
        proposals, so outputs never change."""
        self.full, self.draft_vocab = lm_head, draft_vocab
        self.weight = lm_head.rows(draft_vocab)  # [N, H], gathered once
        self.score = (make_scorer or dense_scorer)(self.weight)

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.full.rows(token_ids)  # the regressive input of any token, drafted or sampled

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., N], in draft-vocabulary order."""
        return self.score(hidden)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft_vocab[self.logits(hidden).argmax(-1)]

    def top1(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The probability is over the draft vocabulary (the policy calibrates it)."""
        index, probability = top1_of(self.logits(hidden))
        return self.draft_vocab[index], probability


IGNORE = -100  # F.cross_entropy's ignore_index: a label the heads cannot or should not predict


class DraftVocabulary:
    """Mixin for heads that may score a reduced draft vocabulary (Clover, CLP, Medusa): the token ids
    live in a buffer `draft_vocab` [N], saved in the checkpoint; None scores the full vocabulary."""

    draft_vocab: torch.Tensor | None

    def init_draft_vocab(self, size: int | None) -> None:
        if size is None:
            self.draft_vocab = None
        else:
            self.register_buffer("draft_vocab", torch.zeros(size, dtype=torch.long))

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        self.draft_vocab.copy_(token_ids)

    def output_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Training: the LM-head rows the heads' logits are computed over ([N or V, H])."""
        return lm_head_weight if self.draft_vocab is None else lm_head_weight[self.draft_vocab]

    def scored_rows(self, vocab_size: int) -> int:
        """LM-head rows each drafting head reads: N with a draft vocabulary, else V."""
        return vocab_size if self.draft_vocab is None else len(self.draft_vocab)

    def output_head(self, lm_head: LmHead, make_scorer: MakeScorer | None = None) -> LmHead:
        """Serving: the LM head the heads draft through (build once, it gathers N rows and
        hands them to `make_scorer`, see DraftVocabHead)."""
        if self.draft_vocab is None:
            return lm_head
        return DraftVocabHead(lm_head, self.draft_vocab, make_scorer)


def draft_vocab_labels(token_ids: torch.Tensor, draft_vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Token ids as indices into the heads' output vocabulary: unchanged without a draft
    vocabulary, else the index in it, or IGNORE for tokens outside it (never predictable)."""
    if draft_vocab is None:
        return token_ids
    index = torch.full((vocab_size,), IGNORE, dtype=torch.long, device=token_ids.device)
    index[draft_vocab] = torch.arange(len(draft_vocab), device=token_ids.device)
    return index[token_ids]


def most_frequent_tokens(token_ids: torch.Tensor, n: int, vocab_size: int) -> torch.Tensor:
    """The n most frequent ids in `token_ids` (ties by id), as a draft vocabulary."""
    counts = torch.bincount(token_ids.flatten(), minlength=vocab_size)
    return torch.sort(counts, descending=True, stable=True).indices[:n]


class StateDictCheckpoint:
    """Heads whose checkpoint tensors are their own state dict (Clover, CLP; Medusa uses
    vLLM's names instead). Part of the method-table interface, methods.DraftHeads."""

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.state_dict().items()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(tensors)

    def vllm_config(self) -> dict:
        return {}  # served by our draft model, which reads only vllm_clover's fields


class TorchRMSNorm(nn.Module):
    """Llama's RMSNorm in plain PyTorch (vLLM's own `RMSNorm` serves the augmenting block)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Scale each row to unit RMS (RMSNorm without a weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ResidualBlock(nn.Module):
    """Medusa's head body: x + SiLU(W x + b). Zero-initialised, so it starts as the identity
    and a fresh head predicts what the base's LM head predicts."""

    def __init__(self, hidden_size: int, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=bias)
        nn.init.zeros_(self.linear.weight)
        if bias:
            nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [..., T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's (GPT-NeoX style) rotary embedding on x [..., T, heads, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[..., None, :].to(x.dtype), sin[..., None, :].to(x.dtype)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full causal attention over [B, T, heads, d] (training and reference path)."""
    groups = q.shape[-2] // k.shape[-2]
    q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [B, heads, T, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    return out.transpose(-3, -2)


def rope_theta(config) -> float:
    """The base's RoPE base frequency (transformers moved it into `rope_parameters`)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def decoder_layer_shape(config) -> dict:
    """A Hugging Face Llama config's decoder-layer shape, under the names our heads' configs
    and TorchLlamaDecoderLayer use (Clover's augmenting block, EAGLE's layer)."""
    return dict(intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                rms_norm_eps=config.rms_norm_eps, rope_theta=rope_theta(config))


class TorchLlamaDecoderLayer(nn.Module):
    """One Llama decoder layer in plain PyTorch, with Hugging Face's parameter names, so a base
    model's layer state dict loads into it unchanged (vLLM serves it as its own
    `LlamaDecoderLayer`, vllm_models.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_attention_heads: int,
                 num_key_value_heads: int, head_dim: int, rms_norm_eps: float, rope_theta: float):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.rope_theta = (
            num_attention_heads, num_key_value_heads, head_dim, rope_theta)
        self.input_layernorm = TorchRMSNorm(hidden_size, rms_norm_eps)
        self.post_attention_layernorm = TorchRMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = nn.ModuleDict({
            "q_proj": nn.Linear(hidden_size, num_attention_heads * head_dim, bias=False),
            "k_proj": nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=False),
            "v_proj": nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=False),
            "o_proj": nn.Linear(num_attention_heads * head_dim, hidden_size, bias=False),
        })
        self.mlp = nn.ModuleDict({
            "gate_proj": nn.Linear(hidden_size, intermediate_size, bias=False),
            "up_proj": nn.Linear(hidden_size, intermediate_size, bias=False),
            "down_proj": nn.Linear(intermediate_size, hidden_size, bias=False),
        })

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: AttendFn = causal_attention) -> torch.Tensor:
        """x [..., T, H], positions [..., T] -> [..., T, H]."""
        attn, mlp = self.self_attn, self.mlp
        h = self.input_layernorm(x)
        q = attn["q_proj"](h).unflatten(-1, (self.n_heads, self.head_dim))
        k = attn["k_proj"](h).unflatten(-1, (self.n_kv, self.head_dim))
        v = attn["v_proj"](h).unflatten(-1, (self.n_kv, self.head_dim))
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta)
        o = attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        x = x + attn["o_proj"](o.flatten(-2))
        h = self.post_attention_layernorm(x)
        return x + mlp["down_proj"](F.silu(mlp["gate_proj"](h)) * mlp["up_proj"](h))


MAX_HEADS = 8


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def check_num_heads(num_heads: int) -> None:
    """K draft heads: 1..8 (vLLM's scheduler and our CLP length classes assume a small K)."""
    if not 1 <= num_heads <= MAX_HEADS:
        raise ValueError(f"num_heads must be in 1..{MAX_HEADS}, got {num_heads}")


def head_labels(input_ids: torch.Tensor, head: int) -> torch.Tensor:
    """Labels of 1-based draft head `head` at positions 0..T-2-head: x_{t+1+head}.

    The base's LM head at t predicts x_{t+1}; draft head i predicts the token i after that.
    """
    return input_ids[:, 1 + head :]
