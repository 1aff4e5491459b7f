"""The frozen base model as the trainer sees it: loaded once, read-only, never saved."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FrozenBase:
    """What the heads take from the base model (methods.FrozenBaseView)."""

    model: nn.Module            # HF causal LM
    lm_head_weight: torch.Tensor
    embed_weight: torch.Tensor  # the input embedding (the LM head's own tensor when tied)
    config: object

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Last hidden states after the final norm: what vLLM hands a proposer."""
        return self.model.model(input_ids=input_ids).last_hidden_state

    def last_layer_state(self) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{self.config.num_hidden_layers - 1}."
        return {k.removeprefix(prefix): v.clone() for k, v in self.model.state_dict().items()
                if k.startswith(prefix)}

    def final_norm_weight(self) -> torch.Tensor:
        return self.model.model.norm.weight.detach()


def load_base(base_dir: Path, dtype: str) -> tuple[FrozenBase, object]:
    """(the frozen base, its tokenizer) from a local Hugging Face directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=DTYPES[dtype]).eval()
    model.requires_grad_(False)
    return FrozenBase(model, model.get_output_embeddings().weight, model.get_input_embeddings().weight,
                      model.config), tokenizer
