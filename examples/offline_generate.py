"""Offline batch generation with Clover (or CLP) in vllm.LLM, and the acceptance it got.

    python examples/offline_generate.py [--method clp] [--num-prompts 16]
"""

import argparse

from vllm import LLM, SamplingParams

from vllm_clover.methods import SERVING_NAMES
from vllm_clover.spec_metrics import mean_acceptance_length, spec_decode_counters
from vllm_clover_training.stdlib_corpus import heldout_prompts

if __name__ == "__main__":  # vLLM starts worker processes: keep module-level code import-safe
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=list(SERVING_NAMES), default="clover")  # clover, clp, clp-trust
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    heads = "assets/demo-heads/" + SERVING_NAMES[args.method][0].name  # clp-trust serves the CLP heads
    llm = LLM(
        model="assets/demo-base",
        speculative_config={"method": args.method, "model": heads},  # K defaults to the heads' count
        dtype="float32",           # the demo model is fp32; CPUs without AVX-512 run bf16 slowly
        max_model_len=1024,
        kv_cache_memory_bytes=512 << 20,  # on CPU the default reserves 92% of RAM for the KV cache
        disable_log_stats=False,   # needed for llm.get_metrics()
    )
    prompts = heldout_prompts(args.num_prompts)  # Python definitions cut at their first line
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    for output in outputs[:2]:
        print(output.prompt[-80:] + "\033[1m" + output.outputs[0].text + "\033[0m\n")

    counters = spec_decode_counters(llm)
    print(f"{args.method}: {len(outputs)} outputs, mean acceptance length {mean_acceptance_length(counters):.2f}")
