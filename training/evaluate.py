"""Head accuracy on held-out data, and CLP's threshold sweep.

Head i's top-k accuracy counts, over every position where its label exists and the loss
mask keeps it (a chat's answers, all of a text), whether x_{t+1+i} is among its k best
tokens (never, for a token outside a draft vocabulary), with earlier regressive inputs teacher-forced
(so it is head i's accuracy given that heads 1..i-1 were right: the case in which
verification ever reaches head i).

The same pass gives greedy acceptance: while heads 1..i-1 are right, their drafts *are* the
teacher-forced inputs, so a step drafting at t would accept as many drafts as the heads get
right in a row there (on self-distilled data, the base's own greedy answers). Averaged over
*positions*, 1 + that run is not what serving reports, an average over *steps*: a step that
accepts n drafts skips the n positions after it, mostly easy ones, so steps land on hard
positions more often than positions do, and serving sees less (SmolLM2 validation prompts:
Clover 1.48 served against 1.94 per position, Medusa 1.39 against 1.72).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_clover import checkpoint
from vllm_clover.atomic import atomic_write_text
from vllm_clover.clp import collocation_lengths, lengths_at_threshold
from vllm_clover.draft_policy import calibration_counts
from vllm_clover.errors import CheckpointError
from vllm_clover.hub import is_hub_id, local_dir
from vllm_clover.layers import head_labels
from vllm_clover.methods import BY_NAME, HeadOutputs
from vllm_clover_training import data as data_mod
from vllm_clover_training.base import FrozenBase, load_base
from vllm_clover_training.data import Windows
from vllm_clover_training.objective import counted, label_ids

TAUS = [round(0.05 * i, 2) for i in range(1, 20)]


@torch.no_grad()
def _predictions(heads, base: FrozenBase, windows: Windows, batch_size: int):
    """(the batch's windows, its label ids, per-head logits, length logits or None) batch by batch."""
    heads.eval()  # EAGLE: every draft, unrolled, without training noise
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        labels = label_ids(heads, batch, base.config.vocab_size)
        outputs = HeadOutputs(*heads(base.hidden_states(batch.ids), batch.ids, base.lm_head_weight, base.embed_weight))
        yield batch, labels, outputs.logits, outputs.length_logits


def _length_predictions(length_logits: torch.Tensor, logits: list[torch.Tensor], batch: Windows,
                        labels: torch.Tensor):
    """(P(L*) [n, K+1], L* [n]) at every position where all heads have a label and the loss
    mask keeps the first one."""
    target = collocation_lengths(logits, labels)
    keep = counted(batch, 1)[:, : target.shape[1]]
    return length_logits[:, : target.shape[1]][keep].softmax(-1), target[keep]


@torch.no_grad()
def evaluate_module(method: str, heads, base: FrozenBase, windows: Windows, batch_size: int,
                    calibrate: bool = False) -> dict:
    """Per-head accuracy, greedy acceptance (and CLP's length predictor); with `calibrate`, also
    the goodput policy's calibration table (draft_policy.calibration_counts)."""
    hits = None
    counts = None
    length_probs, length_targets = [], []
    accepted_runs, confidences = [], []
    for batch, labels_all, logits, length_logits in _predictions(heads, base, windows, batch_size):
        if hits is None:
            hits, counts = torch.zeros(len(logits), 2), torch.zeros(len(logits))
        runs = collocation_lengths(logits, labels_all)  # a missing label counts as a miss
        kept = counted(batch, 1)[:, : runs.shape[1]]
        accepted_runs.append(runs[kept])
        if calibrate:
            confidences.append(heads.draft_confidence(logits, length_logits, runs.shape[1])[kept])
        for i, lg in enumerate(logits, start=1):
            labels, keep = head_labels(labels_all, i), counted(batch, i)
            top5 = lg.topk(5, dim=-1).indices
            hits[i - 1, 0] += ((top5[..., 0] == labels) & keep).sum()
            hits[i - 1, 1] += ((top5 == labels[..., None]).any(-1) & keep).sum()
            counts[i - 1] += keep.sum()
        if length_logits is not None:
            probs, target = _length_predictions(length_logits, logits, batch, labels_all)
            length_probs.append(probs)
            length_targets.append(target)
    acc = hits / counts[:, None]
    result = {"method": method, "num_heads": len(acc), "positions": int(counts[0]),
              "per_head": [{"top1": round(a[0].item(), 4), "top5": round(a[1].item(), 4)} for a in acc]}
    runs = torch.cat(accepted_runs)
    result["greedy_acceptance"] = {
        "per_position_acceptance_length": round(1 + runs.float().mean().item(), 4),
        "rate_per_position": [round((runs >= i).float().mean().item(), 4) for i in range(1, len(acc) + 1)],
        "positions": len(runs)}
    if calibrate:
        result["calibration"] = calibration_counts(torch.cat(confidences).float().numpy(), runs.numpy())
    if length_probs:
        probs, target = torch.cat(length_probs), torch.cat(length_targets)
        result["clp"] = {"tau": heads.tau, **length_report(probs, target, heads.tau),
                         "length_exact_acc": round((probs.argmax(-1) == target).float().mean().item(), 4),
                         "mean_true_length": round(target.float().mean().item(), 4)}
    return result


def length_report(probs: torch.Tensor, target: torch.Tensor, tau: float) -> dict:
    """At threshold tau: mean draft length L, tokens verification accepts (min(L, L*)),
    and drafted tokens that are wrong (max(0, L - L*); what trust mode would emit wrongly)."""
    L = lengths_at_threshold(probs, tau)
    return {"mean_draft_len": round(L.float().mean().item(), 4),
            "expected_accepted": round(torch.minimum(L, target).float().mean().item(), 4),
            "expected_wrong": round((L - target).clamp(min=0).float().mean().item(), 4)}


@torch.no_grad()
def choose_tau(heads, base: FrozenBase, windows: Windows, batch_size: int) -> tuple[float, list[dict]]:
    """Sweep tau on validation data; keep the one with most accepted minus wrong drafted
    tokens per step (a drafted token must be more often right than wrong to pay)."""
    pairs = [_length_predictions(length_logits, logits, batch, labels)
             for batch, labels, logits, length_logits in _predictions(heads, base, windows, batch_size)]
    probs, target = torch.cat([p for p, _ in pairs]), torch.cat([t for _, t in pairs])
    sweep = [{"tau": tau, **length_report(probs, target, tau)} for tau in TAUS]
    best = max(sweep, key=lambda r: (r["expected_accepted"] - r["expected_wrong"], -r["tau"]))
    return best["tau"], sweep


def evaluate_checkpoint(heads: str, heads_revision: str | None, base_model: str, base_revision: str | None,
                        data: list[Path], split: str | None, field: str | None, out: Path, max_len: int,
                        batch_size: int, dtype: str, calibrate: bool = False) -> dict:
    """Heads and base are directories or Hub ids; the data is checked before either loads.
    With `calibrate`, the acceptance per draft position and confidence on this data becomes
    the heads' calibration.json (the goodput policy's prior when serving)."""
    if calibrate and is_hub_id(heads):
        raise CheckpointError(f"--calibrate writes into a local heads directory, not the Hub cache's copy of {heads}")
    for path in data:
        data_mod.read_records(path, split, field)
    heads_dir = local_dir(heads, "heads", heads_revision)
    base_dir = local_dir(base_model, "base model", base_revision)
    config, tensors = checkpoint.load_heads(heads_dir, base_dir)
    method = config["vllm_clover"]["method"]
    if calibrate and not BY_NAME[method].served_by_plugin:
        raise CheckpointError(f"{heads}: {method} heads are served by vLLM's own proposer, which has no goodput "
                              "policy to calibrate")
    module = checkpoint.build_heads_module(heads_dir, config, tensors)
    base, tokenizer = load_base(base_dir, dtype)
    windows = data_mod.packed_files(data, tokenizer, max_len, split, field)
    result = evaluate_module(method, module, base, windows, batch_size, calibrate)
    result["heads"], result["data"] = str(heads), [str(p) for p in data]
    if calibrate:
        sources = {"data": result["data"], "data_sha256": [data_mod.data_sha256(p) for p in data]}
        atomic_write_text(heads_dir / checkpoint.CALIBRATION,
                          json.dumps({**result.pop("calibration"), **sources}) + "\n")
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    return result
