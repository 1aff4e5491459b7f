"""Does a worker's memory keep growing? The same offline workload, repeated, on a plain engine
and a speculative one, with the worker's RSS after each repetition.

    python -m benchmarks.memory_repeat --repeats 7 --out benchmarks/results/soak/memory-repeat.json

A cache that fills as new batch shapes appear stops growing once the workload has shown them
all; a leak grows with every repetition. The soak (benchmarks.soak) saw both servers' workers
grow ~450 MB in their first minutes and then level off, the speculative one by a few MB more
per 10 minutes; this asks whether plain vLLM grows the same way under identical work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from benchmarks.run import REPO, load_prompts, speculative_config
from vllm_clover.atomic import atomic_write_text


def worker_rss_mb(worker) -> float:
    """Runs in the worker (collective_rpc)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def repeat(method: str, args) -> list[float]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(args.base_model), dtype="float32", max_model_len=1024, kv_cache_memory_bytes=512 << 20,
              max_num_seqs=64, speculative_config=speculative_config(method, args.heads_dir, 4))
    prompts = load_prompts("heldout", args.num_prompts).texts
    # Greedy and sampled (no seeds: a seeded request whose prompt is chunked kills a plain
    # vLLM 0.32 CPU engine), lengths 8..97: many batch compositions, alike every repetition.
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.9, max_tokens=8 + (i * 37) % 90)
              for i in range(len(prompts))]
    found = []
    for _ in range(args.repeats):
        llm.generate(prompts, params, use_tqdm=False)
        found.append(round(llm.collective_rpc(worker_rss_mb)[0], 1))
        print(method, found, flush=True)
    llm.llm_engine.engine_core.shutdown()
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="vanilla,clover")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--base-model", type=Path, default=REPO / "assets" / "demo-base")
    parser.add_argument("--heads-dir", type=Path, default=REPO / "assets" / "demo-heads")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    series = {method: repeat(method, args) for method in args.methods.split(",")}
    record = {"command": "python -m benchmarks.memory_repeat " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "worker_rss_mb_after_each_repeat": series,
              "growth_mb_over_the_last_half": {m: round(s[-1] - s[len(s) // 2], 1) for m, s in series.items()}}
    atomic_write_text(args.out, json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
