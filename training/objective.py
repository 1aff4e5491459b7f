"""The training loss of every method: per-head cross-entropy, plus a length term for heads
with a length predictor (CLP). What differs between methods lives in their heads module's
forward (methods.DraftHeads): here each is one call.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_clover.clp import collocation_lengths
from vllm_clover.layers import head_labels
from vllm_clover_training.base import FrozenBase


def losses(heads: nn.Module, base: FrozenBase, input_ids: torch.Tensor,
           head_weight_decay: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Sum of per-head cross-entropy (head i weighted by decay**(i-1)), plus, with a length
    predictor, its cross-entropy against L* measured on the heads' current guesses.
    `heads` may be wrapped in DistributedDataParallel: it is called once, through forward."""
    logits, length_logits = heads(base.hidden_states(input_ids), input_ids, base.lm_head_weight)
    total = torch.zeros(())
    metrics = {}
    for i, lg in enumerate(logits, start=1):
        labels = head_labels(input_ids, i)
        ce = F.cross_entropy(lg.flatten(0, 1), labels.flatten())
        total = total + head_weight_decay ** (i - 1) * ce
        metrics[f"loss_{i}"] = ce.item()
        metrics[f"top1_{i}"] = (lg.argmax(-1) == labels).float().mean().item()
    if length_logits is not None:
        target = collocation_lengths([lg.detach() for lg in logits], input_ids)
        length_logits = length_logits[:, : target.shape[1]]
        length_ce = F.cross_entropy(length_logits.flatten(0, 1), target.flatten())
        total = total + length_ce
        metrics["loss_length"] = length_ce.item()
        metrics["length_acc"] = (length_logits.argmax(-1) == target).float().mean().item()
    metrics["loss"] = total.item()
    return total, metrics
