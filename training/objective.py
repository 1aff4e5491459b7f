"""The training loss of every method: per-head cross-entropy, plus a length term for heads
with a length predictor (CLP) and a feature regression for drafts that return one
(EAGLE). What differs between methods lives in their heads module's
forward (methods.DraftHeads): here each is one call.

Labels: head i at position t is trained on x_{t+1+i} where the window's loss mask allows it
(a chat's answers, all of a text), as an index into the heads' output vocabulary (the full
one, or a draft vocabulary: layers.DraftVocabulary; tokens outside it are never right).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_clover.clp import collocation_lengths
from vllm_clover.layers import IGNORE, draft_vocab_labels, head_labels
from vllm_clover.methods import HeadOutputs
from vllm_clover_training.base import FrozenBase
from vllm_clover_training.data import Windows


def draft_vocab_of(heads: nn.Module) -> torch.Tensor | None:
    return getattr(getattr(heads, "module", heads), "draft_vocab", None)  # through DDP too


def label_ids(heads: nn.Module, windows: Windows, vocab_size: int) -> torch.Tensor:
    """[B, T]: each token as a label of the heads' output vocabulary, IGNORE where the loss mask
    is 0; head i's labels are `head_labels(label_ids, i)`."""
    labels = draft_vocab_labels(windows.ids, draft_vocab_of(heads), vocab_size)
    return labels.masked_fill(windows.loss_mask == 0, IGNORE)


def counted(windows: Windows, head: int) -> torch.Tensor:
    """[B, T-1-head]: positions whose head-`head` label the loss mask keeps."""
    return head_labels(windows.loss_mask, head) == 1


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean over kept positions of -sum_v p_teacher(v) log p_head(v)."""
    per_position = -(teacher_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    return (per_position * keep).sum() / keep.sum().clamp(min=1)


def losses(heads: nn.Module, base: FrozenBase, windows: Windows, head_weight_decay: float = 1.0,
           h_base: torch.Tensor | None = None, soft_targets: bool = False) -> tuple[torch.Tensor, dict]:
    """Sum of per-head cross-entropy (head i weighted by decay**(i-1)), plus, with a length
    predictor, its cross-entropy against L* measured on the heads' current guesses.
    `heads` may be wrapped in DistributedDataParallel: it is called once, through forward.
    `h_base`: the base's hidden states of these windows if already known (hidden_cache.py).
    `soft_targets` (the Clover-2 authors' signal): head i at t learns the base's own
    distribution over x_{t+1+i}, read at position t+i (over the draft vocabulary if any),
    instead of the one token in the data."""
    ids = windows.ids
    h_base = base.hidden_states(ids) if h_base is None else h_base
    logits, length_logits, regression = HeadOutputs(*heads(h_base, ids, base.lm_head_weight, base.embed_weight))
    labels_all = label_ids(heads, windows, base.config.vocab_size)
    draft_vocab = draft_vocab_of(heads)
    output_rows = base.lm_head_weight if draft_vocab is None else base.lm_head_weight[draft_vocab]
    total = torch.zeros(())
    metrics = {}
    for i, lg in enumerate(logits, start=1):
        lg = lg.float()  # bf16 under --compute-dtype bfloat16: the softmax wants fp32
        labels, keep = head_labels(labels_all, i), counted(windows, i)
        if soft_targets:
            with torch.no_grad():
                teacher = (h_base[:, i : i + lg.shape[1]] @ output_rows.T).float()
            ce = soft_cross_entropy(lg, teacher, keep)
        else:
            ce = F.cross_entropy(lg.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
            ce = ce / keep.sum().clamp(min=1)  # tokens outside a draft vocabulary count as misses
        total = total + head_weight_decay ** (i - 1) * ce
        metrics[f"loss_{i}"] = ce.item()
        metrics[f"top1_{i}"] = ((lg.argmax(-1) == labels) & keep).sum().item() / max(keep.sum().item(), 1)
    if length_logits is not None:
        target = collocation_lengths([lg.detach() for lg in logits], labels_all)
        length_logits = length_logits[:, : target.shape[1]].float()
        keep = counted(windows, 1)[:, : target.shape[1]]  # positions inside an answer (or text)
        length_ce = F.cross_entropy(length_logits[keep], target[keep]) if keep.any() else torch.zeros(())
        total = total + length_ce
        metrics["loss_length"] = length_ce.item()
        hits = (length_logits[keep].argmax(-1) == target[keep]).sum().item()
        metrics["length_acc"] = hits / max(keep.sum().item(), 1)
    if regression is not None:  # EAGLE: features regressed onto the base's next hidden state
        keep = counted(windows, 1)
        feature_loss = (regression.float() * keep).sum() / keep.sum().clamp(min=1)
        total = total + feature_loss
        metrics["loss_features"] = feature_loss.item()
    metrics["loss"] = total.item()
    return total, metrics
