"""Print the per-head accuracy table of a heads directory (README, "Head accuracy") as Markdown:
the demo heads and their ablations, or the SmolLM2 heads and theirs.

    python -m vllm_clover_training.accuracy_table assets/demo-heads
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = [  # (label, eval JSON relative to the heads directory): the demo heads
    ("Medusa (vLLM format, own LM heads)", "medusa/eval-heldout.json"),
    ("Clover without augmenting block", "ablations/no-augmenting-block.json"),
    ("Clover, MLP as regressive block", "ablations/mlp-regressive.json"),
    ("Clover without regressive connection", "ablations/no-regressive.json"),
    ("**Clover (full)**", "clover/eval-heldout.json"),
    ("CLP heads", "clp/eval-heldout.json"),
    ("EAGLE-1 draft (one decoder layer; vLLM's own proposer)", "eagle/eval-heldout.json"),
]

SMOLLM2_ROWS = [  # the SmolLM2 heads (8k draft vocabulary) and the choices measured on that model
    ("Medusa (vLLM format, one shared 8k LM head)", "medusa/eval.json"),
    ("Clover, 1 epoch, augmenting block = last layer (paper)", "ablations/clover-last-layer.json"),
    ("Clover, 1 epoch, identity-started augmenting block", "ablations/clover-identity.json"),
    ("Clover, 1 epoch, identity, soft targets", "ablations/clover-identity-soft.json"),
    ("Clover, 1 epoch, identity, MLP as regressive block", "ablations/clover-identity-mlp.json"),
    ("**Clover (shipped)**", "clover/eval.json"),
    ("CLP heads", "clp/eval.json"),
    ("EAGLE-1 draft (one decoder layer, full vocabulary; vLLM's own proposer)", "eagle/eval.json"),
]


def table(heads_dir: Path, rows: list[tuple[str, str]] = ROWS) -> str:
    """Top-1 / top-5 per head and, where the eval has it, greedy acceptance per position (evaluate.py)."""
    results = [(label, json.loads((heads_dir / rel).read_text())) for label, rel in rows
               if (heads_dir / rel).exists()]
    k = max(len(r["per_head"]) for _, r in results)
    with_acceptance = any("greedy_acceptance" in r for _, r in results)
    head = "| heads | " + " | ".join(f"head {i} top-1 / top-5" for i in range(1, k + 1)) + " |"
    head += " greedy acceptance per position |" if with_acceptance else ""
    lines = [head, "|---" * (k + 1 + with_acceptance) + "|"]
    for label, r in results:
        cells = [f"{100 * h['top1']:.1f} / {100 * h['top5']:.1f}" for h in r["per_head"]]
        if with_acceptance:
            accepted = r.get("greedy_acceptance")
            cells.append(f"{accepted['per_position_acceptance_length']:.2f}" if accepted else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "assets/demo-heads")))
