"""Clover, CLP and Medusa as the trainer sees them: build, loss, checkpoint tensors.

Every method returns, per draft head i (1-based), logits [B, T-1-i, V] whose labels are
`head_labels(input_ids, i)`; the shift itself is drawn in vllm_clover/clover.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_clover.clover import CloverConfig, CloverHeads
from vllm_clover.clp import ClpHeads, collocation_lengths
from vllm_clover.layers import head_labels
from vllm_clover.medusa import MedusaHeads


@dataclass
class FrozenBase:
    """What the heads take from the base model: read-only, never trained, never saved."""

    model: nn.Module            # HF causal LM
    lm_head_weight: torch.Tensor
    config: object

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Last hidden states after the final norm: what vLLM hands a proposer."""
        return self.model.model(input_ids=input_ids).last_hidden_state

    def last_layer_state(self) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{self.config.num_hidden_layers - 1}."
        return {k.removeprefix(prefix): v.clone() for k, v in self.model.state_dict().items()
                if k.startswith(prefix)}


def build_heads(method: str, base: FrozenBase, num_heads: int, hyper: dict) -> nn.Module:
    c = base.config
    if method == "clover":
        config = CloverConfig(
            num_heads=num_heads, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
            intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps, rope_theta=_rope_theta(c), **hyper)
        heads = CloverHeads(config)
        heads.init_from_base(base.last_layer_state(), base.model.model.norm.weight.detach())
        return heads
    if method == "clp":
        return ClpHeads(num_heads, c.hidden_size, **hyper)
    if method == "medusa":
        heads = MedusaHeads(num_heads, c.hidden_size, c.vocab_size)
        heads.init_from_base(base.lm_head_weight)
        return heads
    raise ValueError(f"unknown method {method!r}")


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def head_logits(method: str, heads: nn.Module, base: FrozenBase, h_base: torch.Tensor,
                input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(per-head logits, CLP's length logits or None). Calls the module once, so the
    forward runs through DistributedDataParallel when it wraps the heads."""
    if method == "medusa":
        return heads(h_base), None
    if method == "clover":
        hidden, length_logits = heads(h_base, input_ids, base.lm_head_weight), None
    else:
        hidden, length_logits = heads(h_base)
    return [h @ base.lm_head_weight.T for h in hidden], length_logits


def losses(method: str, heads: nn.Module, base: FrozenBase, input_ids: torch.Tensor,
           head_weight_decay: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Sum of per-head cross-entropy (head i weighted by decay**(i-1)), plus for CLP the
    length predictor's cross-entropy against L* measured on the heads' current guesses."""
    h_base = base.hidden_states(input_ids)
    logits, length_logits = head_logits(method, heads, base, h_base, input_ids)
    total = torch.zeros(())
    metrics = {}
    for i, lg in enumerate(logits, start=1):
        labels = head_labels(input_ids, i)
        ce = F.cross_entropy(lg.flatten(0, 1), labels.flatten())
        total = total + head_weight_decay ** (i - 1) * ce
        metrics[f"loss_{i}"] = ce.item()
        metrics[f"top1_{i}"] = (lg.argmax(-1) == labels).float().mean().item()
    if method == "clp":
        target = collocation_lengths([lg.detach() for lg in logits], input_ids)
        length_logits = length_logits[:, : target.shape[1]]
        length_ce = F.cross_entropy(length_logits.flatten(0, 1), target.flatten())
        total = total + length_ce
        metrics["loss_length"] = length_ce.item()
        metrics["length_acc"] = (length_logits.argmax(-1) == target).float().mean().item()
    metrics["loss"] = total.item()
    return total, metrics


def checkpoint_tensors(method: str, heads: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the checkpoint stores: vLLM's own names for Medusa, ours otherwise."""
    if method == "medusa":
        return heads.vllm_state_dict()
    return {k: v.detach() for k, v in heads.state_dict().items()}


def checkpoint_hyper(method: str, heads: nn.Module, hyper: dict) -> dict:
    if method == "clover":
        return heads.config.to_dict()
    if method == "clp":
        return {"num_heads": heads.num_heads, "tau": heads.tau}
    return {"num_heads": heads.num_heads, **hyper}
