"""Print the per-head accuracy table of the demo heads (README, "Head accuracy") as Markdown.

    python -m vllm_clover_training.accuracy_table assets/demo-heads
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = [  # (label, eval JSON relative to the demo-heads directory)
    ("Medusa (vLLM format, own LM heads)", "medusa/eval-heldout.json"),
    ("Clover without augmenting block", "ablations/no-augmenting-block.json"),
    ("Clover, MLP as regressive block", "ablations/mlp-regressive.json"),
    ("Clover without regressive connection", "ablations/no-regressive.json"),
    ("**Clover (full)**", "clover/eval-heldout.json"),
    ("CLP heads", "clp/eval-heldout.json"),
]


def table(heads_dir: Path) -> str:
    results = [(label, json.loads((heads_dir / rel).read_text())) for label, rel in ROWS
               if (heads_dir / rel).exists()]
    k = max(len(r["per_head"]) for _, r in results)
    head = "| heads | " + " | ".join(f"head {i} top-1 / top-5" for i in range(1, k + 1)) + " |"
    lines = [head, "|---" * (k + 1) + "|"]
    for label, r in results:
        cells = [f"{100 * h['top1']:.1f} / {100 * h['top5']:.1f}" for h in r["per_head"]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "assets/demo-heads")))
