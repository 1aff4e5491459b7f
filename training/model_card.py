"""A heads checkpoint's model card (README.md), written from what the directory itself records:
config.json (method, K, hyper-parameters, base fingerprint), provenance.json (command, data
hashes, versions, training time), when training had --eval-data eval.json (per-head
accuracy and the greedy acceptance length it implies) and, once a benchmark has served the
heads in vLLM, served.json (acceptance measured there), so its numbers cannot drift from the
weights they describe. It opens with the Hugging Face model-card metadata, so the directory
can be pushed to the Hub as it is.

    vllm-clover-train card assets/smollm2-heads/clover [...]
    vllm-clover-train card assets/smollm2-heads/clover --served benchmarks/results/smollm2/peer.json
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_clover.atomic import atomic_write_text
from vllm_clover.errors import CheckpointError


def training_minutes(provenance: dict) -> float | None:
    """None for heads trained before provenance recorded it."""
    seconds = provenance["final_metrics"].get("train_seconds")
    return None if seconds is None else round(seconds / 60, 1)


SERVED = "served.json"


def served_record(heads_dir: Path, results: Path) -> dict:
    """What a `benchmarks.run` results file measured of these heads in vLLM: per way it served
    them ("clover-fixed": K every step; "clover": the default goodput policy) and batch size,
    acceptance and speed-up over plain decoding, with the run's command, machine and prompts."""
    method = json.loads((heads_dir / "config.json").read_text())["vllm_clover"]["method"]
    try:
        report = json.loads(Path(results).read_text())
        settings = report["settings"]
        served_from = dict(settings.get("heads") or []).get(method, str(Path(settings["heads_dir"]) / method))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{results} is not a benchmarks.run results file: {e}") from None
    if Path(served_from).resolve() != heads_dir.resolve():
        raise CheckpointError(f"{results} served {method} heads from {served_from}, not {heads_dir}")
    # Lossless ways only: clp-trust accepts drafts unverified, so its "acceptance" is not the heads'.
    runs = {name: report["results"][name] for name in (f"{method}-fixed", method) if name in report["results"]}
    if not runs:
        raise CheckpointError(f"{results} has no results for {method} heads (methods: {', '.join(report['results'])})")
    return {
        "results": str(results), "command": report["command"], "date": report["date"],
        "machine": report["machine"], "versions": report["versions"], "prompts": settings["prompts"],
        "temperature": settings["temperature"], "num_speculative_tokens": settings["k"],
        "by_method_and_batch": {name: {batch: {"mean_acceptance_length": round(r["mean_acceptance_length"], 3),
                                                "acceptance_rate_per_position": [
                                                    round(x, 4) for x in r.get("acceptance_rate_per_position", [])],
                                                "speedup_over_vanilla": round(r["speedup_over_vanilla"], 3)}
                                        for batch, r in by_batch.items() if "mean_acceptance_length" in r}
                                for name, by_batch in runs.items()},
    }


def served_acceptance(served: dict) -> float | None:
    """The front matter's one number: at batch 1, with K every step where the run had it."""
    for by_batch in served["by_method_and_batch"].values():
        if "1" in by_batch:
            return by_batch["1"]["mean_acceptance_length"]
    return None


def front_matter(method: str, k: int, vocab: int | None, provenance: dict, evaluation: dict | None,
                 served: dict | None) -> list[str]:
    """Hugging Face model-card metadata: YAML between `---` lines, each value written as JSON
    (which YAML reads as it is)."""
    args = provenance["args"]
    ours = {"method": method, "num_speculative_tokens": k, "draft_vocab_size": vocab,
            "training_data": list(provenance["data_sha256"]),
            "training_minutes": training_minutes(provenance)}
    if provenance.get("base_commit"):  # trained on a Hub id's snapshot: the commit, since base_model names no revision
        ours["base_commit"] = provenance["base_commit"]
    if evaluation is not None:
        ours["top1_per_head"] = [round(h["top1"], 4) for h in evaluation["per_head"]]
        ours["top5_per_head"] = [round(h["top5"], 4) for h in evaluation["per_head"]]
        if "greedy_acceptance" in evaluation:
            accepted = evaluation["greedy_acceptance"]["per_position_acceptance_length"]
            ours["greedy_acceptance_length"] = round(accepted, 3)
    served_length = None if served is None else served_acceptance(served)
    if served_length is not None:
        ours["served_acceptance_length"] = served_length
    meta = {"base_model": str(args["base_model"]), "library_name": "vllm",
            "tags": ["speculative-decoding", "vllm-clover", method], "vllm_clover": ours}
    return ["---", *(f"{key}: {json.dumps(value)}" for key, value in meta.items()), "---", ""]


def base_name(provenance: dict) -> str:
    """The base as a reader knows it: the Hub id it was trained from, or its directory's name."""
    base = str(provenance["args"]["base_model"])
    return base if provenance.get("base_commit") else Path(base).name


def heads_card(heads_dir: Path) -> str:
    for name in ("config.json", "provenance.json", "model.safetensors"):
        if not (heads_dir / name).is_file():
            raise CheckpointError(f"no {name} in {heads_dir}: a card describes a heads directory "
                                  "vllm-clover-train wrote")
    config = json.loads((heads_dir / "config.json").read_text())
    provenance = json.loads((heads_dir / "provenance.json").read_text())
    evaluation = json.loads((heads_dir / "eval.json").read_text()) if (heads_dir / "eval.json").exists() else None
    served = json.loads((heads_dir / SERVED).read_text()) if (heads_dir / SERVED).exists() else None
    ours, args = config["vllm_clover"], provenance["args"]
    method, hyper, base = ours["method"], ours["hyper"], ours["base"]
    k = config.get("num_heads") or config.get("n_predict") or hyper.get("num_heads")
    size_mb = (heads_dir / "model.safetensors").stat().st_size / 1e6
    vocab = args.get("draft_vocab_size")
    lines = [
        *front_matter(method, k, vocab, provenance, evaluation, served),
        f"# {method} draft heads for `{base_name(provenance)}`",
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
        + (f"{minutes} min of training steps" if (minutes := training_minutes(provenance)) is not None
           else "training time not recorded"),
        f"- command: `{' '.join(provenance['command'])}`",
        f"- git commit `{provenance['git_commit'][:12]}`, versions: "
        + ", ".join(f"{name} {version}" for name, version in provenance["versions"].items()),
        "",
    ]
    if evaluation is None:
        lines += ["## Evaluation", "", "None was run with this training (`--eval-data`).", ""]
    else:
        lines += evaluation_section(evaluation)
    return "\n".join(lines + (served_section(served) if served is not None else []))


def evaluation_section(evaluation: dict) -> list[str]:
    lines = [
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
              "unlike the training data (other tasks, languages, styles) get less.", ""]
    return lines


def served_section(served: dict) -> list[str]:
    machine = served["machine"]
    lines = [
        "## Served in vLLM",
        "",
        f"Measured by `{served['command']}` ({served['date']}; vLLM {served['versions']['vllm']}, "
        f"{machine['cpus']} CPUs {machine['processor']}; prompts `{served['prompts']}`, temperature "
        f"{served['temperature']}, K = {served['num_speculative_tokens']}). Mean acceptance length is vLLM's: "
        "1 + accepted drafts per drafting step. `-fixed`: K drafts every step; without it, the default goodput "
        "policy (draft lengths per request and step).",
        "",
        "| served as | batch | mean acceptance length | accepted per draft position | speed-up over plain decoding |",
        "|---|---|---|---|---|",
    ]
    for name, by_batch in served["by_method_and_batch"].items():
        for batch, r in by_batch.items():
            rates = " / ".join(f"{100 * x:.0f}%" for x in r["acceptance_rate_per_position"])
            lines.append(f"| {name} | {batch} | {r['mean_acceptance_length']:.2f} | {rates} | "
                         f"{r['speedup_over_vanilla']:.2f}x |")
    return [*lines, ""]


def write_card(heads_dir: Path, served: Path | None = None) -> Path:
    """README.md from the directory's files; with `served` (benchmark results that served
    these heads), first that run's measurements as the directory's served.json."""
    if served is not None:
        atomic_write_text(heads_dir / SERVED, json.dumps(served_record(heads_dir, served), indent=2) + "\n")
    path = heads_dir / "README.md"
    atomic_write_text(path, heads_card(heads_dir))
    return path
