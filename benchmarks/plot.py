"""PNG plots of a benchmarks.run results file: throughput, speed-up and acceptance by batch
size; what our heads drafted per request and step, when the run recorded it; speed-up by
Spec-Bench task when the run has categories; and, for the demo heads, the per-head accuracy
ablation (their eval-heldout.json files).

    python -m benchmarks.plot benchmarks/results/results.json      # -> benchmarks/results/*.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_clover_training.accuracy_table import ROWS as ABLATIONS

REPO = Path(__file__).resolve().parents[1]
HEADS = REPO / "assets" / "demo-heads"


def by_method(results: dict, key: str) -> dict[str, tuple[list[int], list[float]]]:
    series = {}
    for method, by_batch in results.items():
        points = sorted((int(b), r[key]) for b, r in by_batch.items() if key in r)
        if points:
            series[method] = ([b for b, _ in points], [v for _, v in points])
    return series


def new_axes():
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6.4, 4.2))


def save(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def spreads(results: dict) -> dict[str, list[tuple[float, float]]]:
    """Per method, each batch size's speed-up range over rounds as error-bar lengths (below, above)."""
    bars = {}
    for method, by_batch in results.items():
        points = sorted((int(b), r) for b, r in by_batch.items() if "speedup_over_vanilla" in r)
        if points:
            ranges = [(r["speedup_over_vanilla"], *r.get("speedup_range", [r["speedup_over_vanilla"]] * 2))
                      for _, r in points]
            bars[method] = [(median - low, high - median) for median, low, high in ranges]
    return bars


def line_plot(series, ylabel: str, title: str, path: Path, baseline: float | None = None,
              errors: dict | None = None) -> None:
    fig, ax = new_axes()
    for method, (x, y) in series.items():
        if errors and method in errors:
            ax.errorbar(x, y, yerr=list(zip(*errors[method])), marker="o", capsize=3, label=method)
        else:
            ax.plot(x, y, marker="o", label=method)
    if baseline is not None:
        ax.axhline(baseline, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    save(fig, ax, "batch size (concurrent requests)", ylabel, title, path)


def drafted_series(results: dict) -> dict[str, tuple[list[int], list[float]]]:
    series = {}
    for method, by_batch in results.items():
        points = sorted((int(b), r["drafting"]["draft_tokens_per_request_step"]) for b, r in by_batch.items()
                        if "drafting" in r)
        if points:
            series[method] = ([b for b, _ in points], [v for _, v in points])
    return series


def acceptance_plot(results: dict, path: Path) -> None:
    """Acceptance rate per draft position, pooled over batch sizes (drafts don't depend on them)."""
    fig, ax = new_axes()
    for method, by_batch in results.items():
        totals = [r["spec_decode"] for r in by_batch.values() if "spec_decode" in r]
        if not totals:
            continue
        drafts = max(sum(t["drafts"] for t in totals), 1)  # CLP may not draft in a tiny run
        positions = range(len(totals[0]["accepted_per_pos"]))
        per_pos = [sum(t["accepted_per_pos"][i] for t in totals) / drafts for i in positions]
        ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=method)
    ax.xaxis.get_major_locator().set_params(integer=True)
    save(fig, ax, "draft position", "accepted / drafting steps", "Acceptance rate per position", path)


def ablation_plot(path: Path) -> None:
    fig, ax = new_axes()
    for label, relative in ABLATIONS:  # the README's head-accuracy table, as lines
        heads = json.loads((HEADS / relative).read_text())["per_head"]
        ax.plot(range(1, len(heads) + 1), [100 * h["top5"] for h in heads], marker="o", label=label.strip("*"))
    ax.xaxis.get_major_locator().set_params(integer=True)
    save(fig, ax, "head", "top-5 accuracy on held-out modules (%)", "Per-head accuracy, demo base, K = 4", path)


def category_plot(results: dict, path: Path) -> None:
    """Speed-up over vanilla at batch 1, one group of bars per Spec-Bench task."""
    import numpy as np

    methods = [m for m in results if "by_category" in results[m].get("1", {}) and m != "vanilla"]
    categories = list(results[methods[0]]["1"]["by_category"])
    fig, ax = new_axes()
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        by_category = results[method]["1"]["by_category"]
        ax.bar(np.arange(len(categories)) + i * width, [by_category[c].get("speedup_over_vanilla", 0)
                                                        for c in categories], width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(np.arange(len(categories)) + 0.4 - width / 2, categories, rotation=20, fontsize=8)
    save(fig, ax, "Spec-Bench task", "speed-up over vanilla", "Speed-up at batch 1 by task", path)


def plot_names(report: dict) -> list[str]:
    """The plots a results file gets (the report links the same names)."""
    results = report["results"]
    names = ["throughput", "speedup", "acceptance"]
    if any("drafting" in r for by_batch in results.values() for r in by_batch.values()):
        names.append("drafted")
    if any("by_category" in r.get("1", {}) for r in results.values()):
        names.append("categories")
    if bundled_heads(report) == HEADS.name:
        names.append("ablation")
    return names


def plots_dir(results_file: Path) -> Path:
    """Where a results file's plots live: next to a `results.json`, else in a folder named
    after the file (benchmarks/results/policy/demo.json -> benchmarks/results/policy/demo/)."""
    return results_file.parent if results_file.stem == "results" else results_file.parent / results_file.stem


def bundled_heads(report: dict) -> str:
    """Which of the repository's heads directories (assets/NAME) the run served, by name: the
    results file records the path on the machine that ran it."""
    return Path(report["settings"]["heads_dir"]).name


def write_plots(results_file: Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    report = json.loads(results_file.read_text())
    results = report["results"]
    out.mkdir(parents=True, exist_ok=True)
    draw = {
        "throughput": lambda p: line_plot(by_method(results, "output_tokens_per_s"), "output tokens/s",
                                          "Throughput", p),
        "speedup": lambda p: line_plot(by_method(results, "speedup_over_vanilla"), "speed-up over vanilla",
                                       "Speed-up (bars: lowest to highest round)", p, baseline=1.0,
                                       errors=spreads(results)),
        "acceptance": lambda p: acceptance_plot(results, p),
        "drafted": lambda p: line_plot(drafted_series(results), "draft tokens per request and step",
                                       "What the heads drafted", p),
        "categories": lambda p: category_plot(results, p),
        "ablation": ablation_plot,
    }
    paths = []
    for name in plot_names(report):
        paths.append(out / f"{name}.png")
        draw[name](paths[-1])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--out", type=Path, help="default: plots_dir(results)")
    args = parser.parse_args()
    for path in write_plots(args.results, args.out or plots_dir(args.results)):
        print(path)


if __name__ == "__main__":
    main()
