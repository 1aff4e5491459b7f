"""Medusa heads (Cai et al. 2024), the baseline, in the format vLLM 0.32 loads as is.

Each head: a residual SiLU block on the base's last hidden state, then its own LM head
(initialised from the base's). vLLM's built-in `MedusaModel` names the weights
`blocks.{i}.layers.0.{weight,bias}` and `lm_heads.{i}.weight`
(vllm/model_executor/models/medusa.py), so `vllm_state_dict` writes exactly those.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm_clover.layers import ResidualBlock


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, vocab_size: int):
        super().__init__()
        if not 1 <= num_heads <= 8:
            raise ValueError(f"num_heads must be in 1..8, got {num_heads}")
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    def init_from_base(self, lm_head_weight: torch.Tensor) -> None:
        for head in self.lm_heads:
            head.weight.data.copy_(lm_head_weight)

    def forward(self, h_base: torch.Tensor) -> list[torch.Tensor]:
        """Logits per head: K tensors [B, T-1-i, V] for 1-based head i (see clover.py's shift)."""
        T = h_base.shape[1]
        return [lm(block(h_base[:, : T - 1 - i])) for i, (block, lm) in
                enumerate(zip(self.blocks, self.lm_heads), start=1)]

    def vllm_config(self) -> dict:
        hidden, vocab = self.lm_heads[0].weight.shape[1], self.lm_heads[0].weight.shape[0]
        return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": hidden,
                "vocab_size": vocab, "num_heads": self.num_heads, "num_hidden_layers": 1,
                "medusa_fc_bias": True}

    def _vllm_names(self) -> dict[str, torch.nn.Parameter]:
        out = {}
        for i, (block, lm) in enumerate(zip(self.blocks, self.lm_heads)):
            out[f"blocks.{i}.layers.0.weight"] = block.linear.weight
            out[f"blocks.{i}.layers.0.bias"] = block.linear.bias
            out[f"lm_heads.{i}.weight"] = lm.weight
        return out

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self._vllm_names().items()}

    def load_vllm_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in self._vllm_names().items():
                param.copy_(tensors[name])
