"""Medusa heads (Cai et al. 2024), the baseline, in the format vLLM 0.32 loads as is.

Each head: a residual SiLU block on the base's last hidden state, then its own LM head
(initialised from the base's). vLLM's built-in `MedusaModel` names the weights
`blocks.{i}.layers.0.{weight,bias}` and `lm_heads.{i}.weight`
(vllm/model_executor/models/medusa.py), so `vllm_state_dict` writes exactly those.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm_clover.layers import ResidualBlock, check_num_heads


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, vocab_size: int):
        super().__init__()
        check_num_heads(num_heads)
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    # ---- the method-table interface (methods.DraftHeads) ----

    @classmethod
    def from_base(cls, base, num_heads: int, hyper: dict, draft_vocab: torch.Tensor | None = None) -> MedusaHeads:
        """Every head's LM head starts as a copy of the base's."""
        if draft_vocab is not None:
            raise ValueError("Medusa heads are written in vLLM's own format, which has no draft vocabulary here")
        heads = cls(num_heads, base.config.hidden_size, base.config.vocab_size)
        for head in heads.lm_heads:
            head.weight.data.copy_(base.lm_head_weight)
        return heads

    @classmethod
    def from_checkpoint(cls, config: dict) -> MedusaHeads:
        return cls(config["num_heads"], config["hidden_size"], config["vocab_size"])

    def checkpoint_hyper(self) -> dict:
        return {"num_heads": self.num_heads}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """vLLM's own names, so its MedusaModel loads the file as it is."""
        return {k: v.detach().contiguous() for k, v in self._vllm_names().items()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self._vllm_names().items():
                param.copy_(tensors[name])

    def vllm_config(self) -> dict:
        """MedusaConfig's switch for the biases our residual blocks have."""
        return {"medusa_fc_bias": True}

    def forward(self, h_base: torch.Tensor, input_ids: torch.Tensor,
                lm_head_weight: torch.Tensor) -> tuple[list[torch.Tensor], None]:
        """Logits per head through its own LM head: K tensors [B, T-1-i, V] for 1-based head i
        (see clover.py's shift); input_ids and the base's LM head are not used."""
        T = h_base.shape[1]
        return [lm(block(h_base[:, : T - 1 - i])) for i, (block, lm) in
                enumerate(zip(self.blocks, self.lm_heads), start=1)], None

    def _vllm_names(self) -> dict[str, torch.nn.Parameter]:
        out = {}
        for i, (block, lm) in enumerate(zip(self.blocks, self.lm_heads)):
            out[f"blocks.{i}.layers.0.weight"] = block.linear.weight
            out[f"blocks.{i}.layers.0.bias"] = block.linear.bias
            out[f"lm_heads.{i}.weight"] = lm.weight
        return out
