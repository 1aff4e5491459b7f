"""A heads checkpoint's model card (README.md), written from what the directory itself records:
config.json (method, K, hyper-parameters, base fingerprint), provenance.json (command, data
hashes, versions, training time) and eval.json (per-head accuracy and the greedy acceptance
length it implies), so its numbers cannot drift from the weights they describe.

    python -m vllm_clover_training.model_card assets/smollm2-heads/clover [...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm_clover.atomic import atomic_write_text


def heads_card(heads_dir: Path) -> str:
    config = json.loads((heads_dir / "config.json").read_text())
    provenance = json.loads((heads_dir / "provenance.json").read_text())
    evaluation = json.loads((heads_dir / "eval.json").read_text())
    ours, args = config["vllm_clover"], provenance["args"]
    method, hyper, base = ours["method"], ours["hyper"], ours["base"]
    k = config.get("num_heads") or config.get("n_predict") or hyper.get("num_heads")
    size_mb = (heads_dir / "model.safetensors").stat().st_size / 1e6
    vocab = args.get("draft_vocab_size")
    lines = [
        f"# {method} draft heads for `{Path(args['base_model']).name}`",
        "",
        f"K = {k} draft tokens per step, trained by vllm-clover on a frozen base; {size_mb:.1f} MB "
        f"({args.get('save_dtype', 'float32')}). Only the new weights are here: the base's LM head is shared at "
        "serving time, never copied.",
        "",
        "## Serve",
        "",
        "```bash",
        f"vllm serve {args['base_model']} --speculative-config "
        f"'{{\"method\": \"{method}\", \"model\": \"{heads_dir.as_posix()}\", \"num_speculative_tokens\": {k}}}'",
        "```",
        "",
        "Outputs are exactly the base's (vLLM verifies every draft). The heads refuse to load against "
        "another base: config.json holds its fingerprint "
        f"({base['architecture']}, hidden {base['hidden_size']}, vocabulary {base['vocab_size']}, "
        f"{base['num_hidden_layers']} layers, LM head SHA-256 `{base['lm_head_sha256'][:16]}...`).",
        "",
        "## Architecture",
        "",
        f"- method `{method}`, hyper-parameters: `{json.dumps(hyper, sort_keys=True)}`",
        f"- draft vocabulary: {f'{vocab:,} most frequent answer tokens of the training data' if vocab else 'full'}",
        "",
        "## Training",
        "",
        "- data (training, then evaluation): "
        + ", ".join(f"`{p}` (SHA-256 `{h[:16]}...`)" for p, h in provenance["data_sha256"].items()),
        f"- {args['epochs']} epoch(s), batch {args['batch_size']} x {args['max_len']} tokens, lr {args['lr']}, "
        f"{'soft targets (the base distributions)' if args.get('soft_targets') else 'hard labels'}, "
        f"compute {args.get('compute_dtype', 'float32')}; "
        f"{provenance['final_metrics']['train_seconds'] / 60:.1f} min of training steps",
        f"- command: `{' '.join(provenance['command'])}`",
        f"- git commit `{provenance['git_commit'][:12]}`, versions: "
        + ", ".join(f"{name} {version}" for name, version in provenance["versions"].items()),
        "",
        f"## Evaluation ({evaluation['positions']:,} answer positions of `{', '.join(evaluation['data'])}`)",
        "",
        "| head | top-1 | top-5 |",
        "|---|---|---|",
        *[f"| {i} | {100 * h['top1']:.1f}% | {100 * h['top5']:.1f}% |"
          for i, h in enumerate(evaluation["per_head"], start=1)],
        "",
    ]
    if "greedy_acceptance" in evaluation:
        accepted = evaluation["greedy_acceptance"]
        lines += [f"Greedy acceptance on that data, teacher-forced, averaged over answer positions (all K drafts "
                  f"verified): {accepted['per_position_acceptance_length']:.2f} tokens a step, per draft position "
                  + " / ".join(f"{100 * r:.1f}%" for r in accepted["rate_per_position"]) + ".", ""]
    if "clp" in evaluation:
        clp = evaluation["clp"]
        lines += [f"Length predictor at tau = {clp['tau']}: mean draft length {clp['mean_draft_len']:.2f}, "
                  f"expected accepted {clp['expected_accepted']:.2f}, wrongly drafted {clp['expected_wrong']:.2f} "
                  "tokens per step.", ""]
    lines += ["Accuracy is teacher-forced on held-out data like the training data. Served acceptance is lower: "
              "serving averages over steps, which skip the easy positions after accepted drafts, and prompts "
              "unlike the training data (other tasks, languages, styles) get less. Benchmarks in vLLM: the "
              "repository's README.", ""]
    return "\n".join(lines)


def write_card(heads_dir: Path) -> Path:
    path = heads_dir / "README.md"
    atomic_write_text(path, heads_card(heads_dir))
    return path


if __name__ == "__main__":
    for directory in sys.argv[1:]:
        print(write_card(Path(directory)))
