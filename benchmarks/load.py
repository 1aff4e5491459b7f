"""Mixed load against `vllm serve`: an open-loop client whose arrival rate ramps up and down,
one server per method, one after the other on the same arrivals and prompts.

    python -m benchmarks.load --methods vanilla,clover,clover-fixed --rates 2,8,24,48,24,8,2 \\
        --phase-seconds 15 --out benchmarks/results/policy/demo-load.json

Requests arrive as a Poisson process whose rate (requests/s) steps through `--rates`, one
phase each; every request streams a greedy completion of exactly `--max-tokens` tokens
(ignore_eos), so methods do the same work. An open-loop client does not wait for answers
before sending more, as users do not: a method that is slower than the arrivals builds a
queue, and its latencies show it. Per phase (requests by the phase they arrived in): time to
first token, time per output token after it, end-to-end latency (p50, p99), and from the
server's /metrics at the phase's ends the tokens it generated, drafted and accepted. Outputs
are compared with the first method's (vanilla) request by request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.run import add_engine_arguments, load_prompts, speculative_config
from vllm_clover.atomic import atomic_write_text

# /metrics counters read at every phase boundary (Prometheus names, `_total` suffix).
COUNTERS = {"generated": "vllm:generation_tokens_total", "drafted": "vllm:spec_decode_num_draft_tokens_total",
            "accepted": "vllm:spec_decode_num_accepted_tokens_total"}


def arrival_times(rates: list[float], phase_seconds: float, seed: int = 0) -> list[tuple[float, int]]:
    """(seconds from the start, phase) of every request: a Poisson process of rate rates[p]
    during phase p, the same for every method (seeded)."""
    rng = np.random.default_rng(seed)
    arrivals = []
    for phase, rate in enumerate(rates):
        start, t = phase * phase_seconds, 0.0
        while rate > 0 and (t := t + rng.exponential(1 / rate)) < phase_seconds:
            arrivals.append((start + t, phase))
    return arrivals


@dataclass
class Completion:
    phase: int
    sent: float                         # seconds from the load's start
    first_token: float | None = None    # seconds after `sent`
    latency: float | None = None        # seconds after `sent`, to the last chunk
    tokens: int = 0
    text: str = ""
    error: str | None = None


async def complete(session, url: str, model: str, prompt, max_tokens: int, record: Completion) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    record.first_token = record.first_token or time.perf_counter() - start
                    record.text += chunk["choices"][0]["text"]
                if chunk.get("usage"):
                    record.tokens = chunk["usage"]["completion_tokens"]
        record.latency = time.perf_counter() - start
    except Exception as e:  # a failed request is a result, not the end of the run
        record.error = f"{type(e).__name__}: {e}"


def metric_sums(text: str, names: dict[str, str]) -> dict[str, float | None]:
    """key -> the sum over labels of Prometheus metric `names[key]` in a /metrics text, None
    where the server has no such metric (no spec-decode counters without a drafter)."""
    found = {}
    for key, name in names.items():
        values = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, flags=re.M)
        found[key] = sum(map(float, values)) if values else None
    return found


async def read_counters(session, url: str) -> dict[str, float | None]:
    async with session.get(f"{url}/metrics") as response:
        return metric_sums(await response.text(), COUNTERS)


async def drive(url: str, model: str, prompts: list, arrivals: list[tuple[float, int]], phase_seconds: float,
                num_phases: int, max_tokens: int) -> tuple[list[Completion], list[dict]]:
    """Send every request at its arrival time; read the counters at every phase boundary and
    once more when the last request has finished."""
    import aiohttp

    records = [Completion(phase, sent) for sent, phase in arrivals]
    timeout = aiohttp.ClientTimeout(total=None)
    # A fresh connection per request: reusing one the server's keep-alive timer has just
    # closed fails as "Server disconnected" before the request reaches the server.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start, counters = time.perf_counter(), []

        async def at(seconds: float):
            await asyncio.sleep(max(0.0, start + seconds - time.perf_counter()))

        async def read_at_boundaries():
            for boundary in range(num_phases + 1):
                await at(boundary * phase_seconds)
                counters.append(await read_counters(session, url))

        async def send(i: int, record: Completion):
            await at(record.sent)
            await complete(session, url, model, prompts[i % len(prompts)], max_tokens, record)

        await asyncio.gather(read_at_boundaries(), *(send(i, r) for i, r in enumerate(records)))
        counters.append(await read_counters(session, url))
    return records, counters


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarise(records: list[Completion], counters: list[dict], rates: list[float]) -> dict:
    """Per phase: what its requests saw, and what the server did between its boundaries (the
    last phase's counters run until the queue drained)."""
    phases = []
    for p, rate in enumerate(rates):
        done = [r for r in records if r.phase == p and r.error is None]
        tpot = [(r.latency - r.first_token) / (r.tokens - 1) for r in done if r.tokens > 1 and r.first_token]
        end = counters[p + 1] if p + 1 < len(rates) else counters[-1]  # the last phase: until drained
        delta = {k: None if end[k] is None else end[k] - counters[p][k] for k in COUNTERS}
        phases.append({
            "rate": rate, "requests": sum(r.phase == p for r in records),
            "errors": sum(r.phase == p and r.error is not None for r in records),
            "ttft_mean": round(statistics.fmean(r.first_token for r in done), 4) if done else None,
            "tpot_mean": round(statistics.fmean(tpot), 5) if tpot else None,
            "latency_p50": percentile([r.latency for r in done], 50),
            "latency_p99": percentile([r.latency for r in done], 99),
            "generated_tokens": delta["generated"],
            "draft_tokens_per_generated": ratio(delta["drafted"], delta["generated"]),
            "acceptance_rate": ratio(delta["accepted"], delta["drafted"]),
        })
    ok = [r for r in records if r.error is None]
    span = max(r.sent + r.latency for r in ok) - min(r.sent for r in ok) if ok else 0.0
    return {"phases": phases, "requests": len(records), "errors": len(records) - len(ok),
            "output_tokens_per_second": round(sum(r.tokens for r in ok) / span, 2) if span else None,
            "latency_mean": round(statistics.fmean(r.latency for r in ok), 4) if ok else None,
            "first_errors": [r.error for r in records if r.error][:3]}


def vllm_serve_command(args, port: int, spec: dict | None, extra: list[str] = ()) -> list[str]:
    """`vllm serve` (through vllm_clover.vllm_cli) on loopback with the engine arguments."""
    command = [sys.executable, "-m", "vllm_clover.vllm_cli", "serve", str(args.base_model), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--seed", "0",
               "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(args.kv_cache_mb << 20),
               *extra]
    if args.enforce_eager:
        command.append("--enforce-eager")
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec)]
    return command


def wait_until_healthy(url: str, server: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}; its log: {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server did not become healthy in {timeout:.0f} s; its log: {log}")


@dataclass
class MethodRun:
    summary: dict
    texts: list[str]             # per request, in arrival order
    drafting_log: list[str]


def run_method(method: str, args, prompts: list, arrivals) -> MethodRun:
    url = f"http://127.0.0.1:{args.port}"
    log = args.out.with_suffix(f".{method}.log")
    command = vllm_serve_command(args, args.port, speculative_config(method, args.heads_dir, args.k, dict(args.heads)))
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_until_healthy(url, server, log)
            model = str(args.base_model)
            warm_up = [(0.05 * i, 0) for i in range(16)]
            asyncio.run(drive(url, model, prompts, warm_up, 1.0, 1, 8))
            records, counters = asyncio.run(drive(url, model, prompts, arrivals, args.phase_seconds,
                                                  len(args.rates), args.max_tokens))
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    drafting = [line.split("] ", 1)[-1].strip() for line in log.read_text().splitlines()
                if "draft tokens per request and step" in line]
    return MethodRun(summarise(records, counters, args.rates), [r.text for r in records], drafting)


def request_prompts(args) -> list:
    """Prompt token ids: through the chat template for a chat model, else the text's tokens."""
    from transformers import AutoTokenizer

    from vllm_clover_training.data import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    texts = load_prompts(args.prompts, args.num_prompts).texts
    if tokenizer.chat_template:
        return [chat_prompt_ids(tokenizer, t) for t in texts]
    return [tokenizer(t).input_ids for t in texts]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="vanilla,clover,clover-fixed", help="the first is the reference")
    parser.add_argument("--rates", default="2,8,24,48,24,8,2", help="requests/s, one phase each")
    parser.add_argument("--phase-seconds", type=float, default=15.0)
    parser.add_argument("--prompts", default="heldout", help="heldout, humaneval, or a JSONL file")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_engine_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--port", type=int, default=8642)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    args.rates = [float(r) for r in args.rates.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = request_prompts(args)
    arrivals = arrival_times(args.rates, args.phase_seconds, args.seed)
    results, reference = {}, None
    for method in args.methods:
        print(f"{method}: {len(arrivals)} requests over {len(args.rates)} phases", flush=True)
        run = run_method(method, args, prompts, arrivals)
        reference = reference or run.texts
        run.summary["mismatches"] = sum(a != b for a, b in zip(run.texts, reference))
        run.summary["drafting_log"] = run.drafting_log
        results[method] = run.summary
        print(json.dumps({k: v for k, v in run.summary.items() if k != "phases"}), flush=True)
    record = {"command": "python -m benchmarks.load " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results}
    atomic_write_text(args.out, json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
