"""`make demo`: plain vLLM generation on the bundled base model, with its throughput.

Until the Clover and CLP proposers land this is the baseline every later speed-up is
measured against: greedy decoding of held-out standard-library prompts, one request at
a time and then all at once, warm-up excluded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed_generate(llm, prompts, params) -> tuple[int, float]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "assets" / "demo-base")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_clover_training.stdlib_corpus import heldout_prompts

    prompts = heldout_prompts(args.num_prompts)
    llm = LLM(model=str(args.model), dtype="float32", max_model_len=1024, seed=0,
              kv_cache_memory_bytes=512 << 20)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up

    rows = [("batch 1 (sequential)", *_sequential(llm, prompts[:4], params)),
            (f"batch {len(prompts)}", *timed_generate(llm, prompts, params))]
    print(f"\nvLLM {llm.llm_engine.vllm_config.model_config.dtype} greedy decoding of "
          f"held-out prompts on {args.model.name}, {args.max_tokens} new tokens each\n")
    print(f"{'run':<22}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}")
    for name, tokens, seconds in rows:
        print(f"{name:<22}{tokens:>8}{seconds:>10.2f}{tokens / seconds:>10.1f}")
    out = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    print(f"\nSample continuation of a held-out prompt:\n{prompts[0][-200:]}"
          f"\x1b[1m{out[0].outputs[0].text}\x1b[0m")


def _sequential(llm, prompts, params) -> tuple[int, float]:
    tokens, seconds = 0, 0.0
    for p in prompts:
        t, s = timed_generate(llm, [p], params)
        tokens, seconds = tokens + t, seconds + s
    return tokens, seconds


if __name__ == "__main__":
    main()
