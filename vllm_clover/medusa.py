"""Medusa heads (Cai et al. 2024), the baseline, in the format vLLM 0.32 loads as is.

Each head: a residual SiLU block on the base's last hidden state, then its own LM head
(initialised from the base's). vLLM's built-in `MedusaModel` names the weights
`blocks.{i}.layers.0.{weight,bias}` and `lm_heads.{i}.weight`
(vllm/model_executor/models/medusa.py), so `checkpoint_tensors` writes exactly those.

With a draft vocabulary of N tokens (as our heads get one) the heads share one LM head of
N rows, in vLLM's own terms: `original_lm_head` (one head for all), `truncated_vocab_size`
N and a `token_map` tensor of the N token ids. Full-vocabulary heads cost K x V x H
parameters (4 x 28M on SmolLM2), the shared reduced head N x H.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm_clover.layers import DraftVocabulary, ResidualBlock, check_num_heads, numel


class MedusaHeads(DraftVocabulary, nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, vocab_size: int, draft_vocab_size: int | None = None):
        super().__init__()
        check_num_heads(num_heads)
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        self.init_draft_vocab(draft_vocab_size)
        own_heads, rows = (num_heads, vocab_size) if draft_vocab_size is None else (1, draft_vocab_size)
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows, bias=False) for _ in range(own_heads))

    def lm_head(self, i: int) -> nn.Linear:
        return self.lm_heads[i if len(self.lm_heads) > 1 else 0]

    # ---- the method-table interface (methods.DraftHeads) ----

    @classmethod
    def from_base(cls, base, num_heads: int, hyper: dict, draft_vocab: torch.Tensor | None = None) -> MedusaHeads:
        """Every LM head starts as a copy of the base's (its draft-vocabulary rows)."""
        heads = cls(num_heads, base.config.hidden_size, base.config.vocab_size,
                    None if draft_vocab is None else len(draft_vocab))
        if draft_vocab is not None:
            heads.set_draft_vocab(draft_vocab)
        for head in heads.lm_heads:
            head.weight.data.copy_(heads.output_weight(base.lm_head_weight))
        return heads

    @classmethod
    def from_checkpoint(cls, config: dict) -> MedusaHeads:
        truncated = config.get("truncated_vocab_size")
        draft_vocab_size = truncated if truncated is not None and truncated < config["vocab_size"] else None
        return cls(config["num_heads"], config["hidden_size"], config["vocab_size"], draft_vocab_size)

    def checkpoint_hyper(self) -> dict:
        return {"num_heads": self.num_heads}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """vLLM's own names, so its MedusaModel loads the file as it is."""
        tensors = {k: v.detach().contiguous() for k, v in self._vllm_names().items()}
        if self.draft_vocab is not None:
            tensors["token_map"] = self.draft_vocab.clone()
        return tensors

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self._vllm_names().items():
                param.copy_(tensors[name])
            if self.draft_vocab is not None:
                self.draft_vocab.copy_(tensors["token_map"])

    def vllm_config(self) -> dict:
        """MedusaConfig's switch for the biases our residual blocks have, and the shared
        reduced LM head when there is a draft vocabulary."""
        if self.draft_vocab is None:
            return {"medusa_fc_bias": True}
        return {"medusa_fc_bias": True, "original_lm_head": True, "truncated_vocab_size": len(self.draft_vocab)}

    def parameters_read_per_step(self, hidden_size: int, vocab_size: int) -> int:
        """Weights one draft step reads: each block, and an LM head per head (a shared one
        is still read once per head: vLLM scores the heads one after another)."""
        return numel(self.blocks) + self.num_heads * self.lm_heads[0].weight.numel()

    def forward(self, h_base: torch.Tensor, input_ids: torch.Tensor,
                lm_head_weight: torch.Tensor,
                embed_weight: torch.Tensor | None = None) -> tuple[list[torch.Tensor], None]:
        """Logits per head through its own LM head: K tensors [B, T-1-i, V or N] for 1-based
        head i (see clover.py's shift); input_ids and the base's LM head are not used."""
        T = h_base.shape[1]
        return [self.lm_head(i - 1)(block(h_base[:, : T - 1 - i]))
                for i, block in enumerate(self.blocks, start=1)], None

    def _vllm_names(self) -> dict[str, torch.nn.Parameter]:
        out = {}
        for i, block in enumerate(self.blocks):
            out[f"blocks.{i}.layers.0.weight"] = block.linear.weight
            out[f"blocks.{i}.layers.0.bias"] = block.linear.bias
        for i, lm in enumerate(self.lm_heads):
            out[f"lm_heads.{i}.weight"] = lm.weight
        return out
