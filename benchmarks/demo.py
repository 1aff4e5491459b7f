"""`make demo`: plain decoding vs Clover vs CLP on the bundled model, side by side.

A few held-out standard-library prompts, one request at a time, greedy, one vLLM engine
per method (warm-up excluded): tokens/s, speed-up, mean acceptance length, and whether
every output is token-identical to plain decoding. Engines run eagerly (no torch.compile)
so that three of them start within the demo's three minutes on 2 cores; the full sweep,
benchmarks.run, measures compiled engines.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import run

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "demo.json")
    args = parser.parse_args()

    report = run.main(["--methods", "vanilla,clover,clp", "--batch-sizes", "1", "--num-prompts", str(args.num_prompts),
                       "--max-tokens", str(args.max_tokens), "--out", str(args.out), "--enforce-eager"],
                      summary=False)
    print(f"\n{args.num_prompts} held-out prompts, {args.max_tokens} greedy tokens each, batch 1, eager engines, "
          f"vLLM {report['versions']['vllm']} on {report['machine']['cpus']} CPUs\n")
    print(f"{'method':<9}{'tokens/s':>10}{'speed-up':>10}{'mean acceptance length':>24}"
          f"{'draft share of step':>21}{'identical to plain':>20}")
    for method, by_batch in report["results"].items():
        r = by_batch["1"]
        mismatched = sum(m > 0 for m in r.get("mismatches", []))
        print(f"{method:<9}{r['output_tokens_per_s']:>10.1f}{r.get('speedup_over_vanilla', 1.0):>9.2f}x"
              f"{r.get('mean_acceptance_length', 1.0):>24.2f}{100 * r['draft_time_fraction']:>20.0f}%"
              f"{'yes' if not mismatched else f'no ({mismatched} prompts)':>20}")
    for method, error in report["failed"].items():
        print(f"{method:<9}FAILED: {error}")
    print(f"\nall numbers: {args.out}")


if __name__ == "__main__":
    main()
