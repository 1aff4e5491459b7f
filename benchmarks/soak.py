"""Soak: `vllm serve` with a speculator and without, side by side, under the mixed load
production sends them, for as long as you like.

    python -m benchmarks.soak --minutes 20 --clients 24 --rate 4 \\
        --spec '{"method": "clover", "model": "assets/demo-heads/clover", "num_speculative_tokens": 4}' \\
        --out benchmarks/results/soak/demo-clover.json

Both servers run at once, on loopback, and every request goes to both at the same moment,
so they see the same load. `--clients` clients each send on their own Poisson clock
(together `--rate` requests/s) without waiting for answers (open loop), until `--minutes`
or `--max-requests` is reached. The mix (`KINDS`): greedy and sampled completions and chats,
streamed or not, with stop strings, logprobs, seeds, penalties, min_tokens, n = 2,
structured outputs, parameters vLLM refuses with speculative decoding (logit_bias, min_p),
prompts longer than the context, and clients that disconnect mid-stream or give up on a
request. Checked and written to the JSON, per server: requests by kind and status,
mismatches of greedy requests against the plain server, structured outputs that break
their constraint, /health failures, ERROR records in the server's log not explained by a
refused request, RSS of every server process (start, middle, end and a timeline), the
spec-decode counters, p50/p99 latency and time to first token, whether the queue and KV
cache emptied after the load, and how the server took SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.load import metric_sums, percentile, read_counters, vllm_serve_command, wait_until_healthy
from benchmarks.run import REPO, add_engine_arguments, load_prompts
from vllm_clover.atomic import atomic_write_text

# The chat template the README's serve command passes for the demo base (it has none).
TRANSCRIPT_TEMPLATE = REPO / "examples" / "transcript.jinja"

# Request kinds and their share of the load.
KINDS = {"greedy": 0.30, "sampled": 0.26, "n2": 0.08, "structured": 0.08, "refused_params": 0.06,
         "over_context": 0.04, "disconnect": 0.10, "cancel": 0.08}
CHOICES = ["yes", "no", "maybe"]
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_cache_usage": "vllm:kv_cache_usage_perc"}
STOPS = ["\n\n", "return", ":"]
# What a speculative server logs, as an ERROR, about a request it refused on purpose.
EXPLAINED_ERRORS = {
    "refused min_p / logit_bias": "not yet supported with speculative decoding",
    "prompt over the context": "maximum context length",
}


@dataclass(frozen=True)
class Request:
    """One request of the load, sent to both servers."""
    index: int
    kind: str
    chat: bool
    stream: bool
    body: dict
    greedy: bool = False                  # must equal the plain server's answer
    refused_with_spec: bool = False       # a speculative server must refuse it (vLLM's rule)
    refused: bool = False                 # every server must refuse it
    stop_after_chunks: int | None = None  # the client disconnects after this many chunks
    give_up_after: float | None = None    # the client cancels after this many seconds

    def must_refuse(self, speculative: bool) -> bool:
        return self.refused or (speculative and self.refused_with_spec)


@dataclass
class Outcome:
    # ok, refused, disconnected, cancelled, http_4xx, http_5xx, error_event or client_error
    status: str = "pending"
    texts: list[str] = field(default_factory=list)
    latency: float | None = None
    first_token: float | None = None
    detail: str = ""


def make_requests(count: int, prompts: list[str], max_model_len: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    names, weights = list(KINDS), np.array(list(KINDS.values()))
    return [make_request(i, str(rng.choice(names, p=weights / weights.sum())), prompts[i % len(prompts)],
                         max_model_len, rng) for i in range(count)]


def make_request(index: int, kind: str, prompt: str, max_model_len: int, rng: np.random.Generator) -> Request:
    chat = kind not in ("structured", "over_context") and rng.random() < 0.4
    stream = kind in ("disconnect",) or (kind != "cancel" and rng.random() < 0.5)
    body: dict = {"max_tokens": int(rng.integers(8, 97))}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
    if rng.random() < 0.2:
        body["stop"] = [str(rng.choice(STOPS))]
    if rng.random() < 0.2:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    extra: dict = {}
    if kind == "greedy":
        body["temperature"] = 0.0
        extra["greedy"] = True
    elif kind in ("sampled", "n2", "disconnect", "cancel"):
        body.update(temperature=round(float(rng.uniform(0.3, 1.2)), 2), top_p=round(float(rng.uniform(0.7, 1.0)), 2),
                    top_k=int(rng.choice([-1, 20, 50])))
        if rng.random() < 0.5:
            body["seed"] = int(rng.integers(1 << 30))
        if rng.random() < 0.3:
            body.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
        if rng.random() < 0.2:
            body["min_tokens"] = 4
        if kind == "n2":
            body["n"] = 2
    elif kind == "structured":
        body.update(temperature=0.0, structured_outputs={"choice": CHOICES})
    elif kind == "refused_params":
        body.update({"min_p": 0.1} if rng.random() < 0.5 else {"logit_bias": {"13": 2.0}})
        extra["refused_with_spec"] = True
    elif kind == "over_context":
        body["prompt"] = prompt * (1 + 8 * max_model_len // len(prompt))  # > 8 characters a token: too long
        extra["refused"] = True
    if kind == "disconnect":
        extra["stop_after_chunks"] = int(rng.integers(1, 5))
    if kind == "cancel":
        extra["give_up_after"] = round(float(rng.uniform(0.05, 1.0)), 2)
    return Request(index, kind, chat, stream, body, **extra)


async def send(session, url: str, model: str, request: Request, outcome: Outcome) -> None:
    endpoint = "chat/completions" if request.chat else "completions"
    start = time.perf_counter()
    try:
        work = post(session, f"{url}/v1/{endpoint}", {"model": model, **request.body}, request, outcome, start)
        if request.give_up_after is None:
            await work
        else:
            try:
                await asyncio.wait_for(work, request.give_up_after)
            except asyncio.TimeoutError:
                outcome.status = "cancelled"
                return
    except Exception as e:  # a failed request is a result, not the end of the run
        outcome.status, outcome.detail = "client_error", f"{type(e).__name__}: {e}"[:300]
        return
    outcome.latency = time.perf_counter() - start


async def post(session, url: str, body: dict, request: Request, outcome: Outcome, start: float) -> None:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            outcome.status = f"http_{response.status // 100}xx"
            outcome.detail = (await response.text())[:300]
            return
        if not request.stream:
            choices = sorted((await response.json())["choices"], key=lambda c: c["index"])
            outcome.texts = [c["message"]["content"] if request.chat else c["text"] for c in choices]
            outcome.status = "ok"
            return
        texts: dict[int, str] = {}
        chunks = 0
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                outcome.status, outcome.detail = "error_event", json.dumps(chunk["error"])[:300]
                return
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") if request.chat else choice.get("text")
                if piece:
                    outcome.first_token = outcome.first_token or time.perf_counter() - start
                    texts[choice["index"]] = texts.get(choice["index"], "") + piece
            chunks += 1
            if request.stop_after_chunks is not None and chunks >= request.stop_after_chunks:
                outcome.status = "disconnected"  # leaving the block closes the connection mid-stream
                return
        outcome.texts = [texts.get(i, "") for i in range(request.body.get("n", 1))]
        outcome.status = "ok"


def classify(request: Request, outcome: Outcome, speculative: bool) -> str:
    """The outcome's status, with a refusal the request was built to get counted as such."""
    if request.must_refuse(speculative) and (outcome.status == "http_4xx" or
                        (outcome.status == "error_event" and '"code": 400' in outcome.detail)):
        return "refused"
    return outcome.status


# ---- the servers ----

class Server:
    """One `vllm serve` process, its log, and what is sampled from it while the load runs."""

    def __init__(self, name: str, command: list[str], port: int, log: Path):
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.memory: list[dict] = []       # {"t": seconds, "<process>": MB, ...}
        self.health_failures = 0

    def rss_mb(self) -> dict[str, float]:
        """RSS of the server and every process under it, by process title (vLLM names its
        engine core and workers), in MB."""
        import psutil

        root = psutil.Process(self.process.pid)
        found: Counter = Counter()
        for process in [root, *root.children(recursive=True)]:
            try:
                title = (process.cmdline() or [""])[0]
                name = ("api_server" if process.pid == root.pid else
                        title.split()[0] if title.startswith("VLLM::") else "helpers")
                found[name] += process.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                continue
        return {name: round(mb, 1) for name, mb in found.items()}

    def stop(self) -> dict:
        """SIGTERM, then how long it took to exit and with what code (or the code it had
        already exited with: a server whose engine died may stop by itself)."""
        if self.process.poll() is not None:
            return {"returncode": self.process.returncode, "seconds": None, "clean": False, "exited_before": True}
        start = time.monotonic()
        self.process.terminate()
        try:
            code = self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
            return {"returncode": code, "seconds": None, "clean": False}
        return {"returncode": code, "seconds": round(time.monotonic() - start, 1), "clean": code == 0}


# "(APIServer pid=9227) ERROR 12-01 21:43:07 [serving.py:500] message": vLLM logs a
# traceback as ERROR lines with the same process, time and source.
SHUTDOWN_LINE = "[shutdown] API server: shutdown triggered"
ERROR_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?ERROR (\d\d-\d\d [\d:]+) \[([^\]]+)\] ?(.*)$")


def log_errors(log: Path) -> dict:
    """ERROR records in a server log (one record: consecutive ERROR lines from the same
    process, second and source line), those a refused request or the SIGTERM at the end
    explains counted by reason, the others listed."""
    records: list[str] = []
    previous, shutdown_from = None, None
    for line in log.read_text(errors="replace").splitlines():
        if shutdown_from is None and SHUTDOWN_LINE in line:
            shutdown_from = len(records)
        match = ERROR_LINE.match(line)
        key = match.groups()[:3] if match else None
        if key is not None and key == previous:
            records[-1] += "\n" + match.group(4)
        elif key is not None:
            records.append(line)
        previous = key
    explained: Counter = Counter()
    unexplained = []
    for i, record in enumerate(records):
        reason = next((why for why, text in EXPLAINED_ERRORS.items() if text in record), None)
        if shutdown_from is not None and i >= shutdown_from:
            reason = "during the SIGTERM shutdown"  # vLLM stops the engine under the API server's output loop
        if reason:
            explained[reason] += 1
        else:
            unexplained.append(record[:600])
    return {"records": len(records), "explained": dict(explained), "unexplained": len(unexplained),
            "unexplained_first": unexplained[:5]}


async def watch(servers: list[Server], start: float, until: asyncio.Event, every: float) -> None:
    """Every `every` seconds until the load is done: each server's RSS and /health."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:  # one sample more once the load is done
            for server in servers:
                server.memory.append({"t": round(time.perf_counter() - start, 1), **server.rss_mb()})
                try:
                    async with session.get(f"{server.url}/health") as response:
                        server.health_failures += response.status != 200
                except Exception:
                    server.health_failures += 1
            if until.is_set():
                return
            try:
                await asyncio.wait_for(until.wait(), every)
            except asyncio.TimeoutError:
                pass


async def drive(servers: list[Server], model: str, requests: list[Request], args) -> tuple[dict, dict, float]:
    """Send the load to every server; (outcomes per server, counters before/after, seconds)."""
    import aiohttp

    rng = np.random.default_rng(args.seed + 1)
    # Each client's Poisson clock; the request list is dealt out in order of send time.
    times = sorted(t for c in range(args.clients)
                   for t in np.cumsum(rng.exponential(args.clients / args.rate, len(requests))))
    deadline = args.minutes * 60
    schedule = [(t, r) for t, r in zip(times, requests) if t < deadline]
    outcomes = {s.name: [Outcome() for _ in schedule] for s in servers}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=connector) as session:
        before = {s.name: await read_counters(session, s.url) for s in servers}
        start, done = time.perf_counter(), asyncio.Event()
        watcher = asyncio.create_task(watch(servers, start, done, args.sample_seconds))

        async def at(seconds: float, request: Request, i: int):
            await asyncio.sleep(max(0.0, start + seconds - time.perf_counter()))
            await asyncio.gather(*(send(session, s.url, model, request, outcomes[s.name][i]) for s in servers))

        await asyncio.gather(*(at(t, r, i) for i, (t, r) in enumerate(schedule)))
        seconds = time.perf_counter() - start
        done.set()
        await watcher
        await asyncio.sleep(2)  # let aborted requests leave the engines before reading the gauges
        after = {s.name: await read_counters(session, s.url) for s in servers}
    return {"requests": [r for _, r in schedule], "outcomes": outcomes}, {"before": before, "after": after}, seconds


def drained(server: Server) -> dict:
    """The queue and KV-cache gauges once the load is over: requests a disconnect or cancel
    left behind would show here."""
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        return metric_sums(response.read().decode(), GAUGES)


# ---- the summary ----

def memory_summary(samples: list[dict]) -> dict:
    """Per process and in total: MB at the first, middle and last sample, and the growth per
    10 minutes over the second half (a line through its samples: is it levelling off?)."""
    totals = [sum(v for k, v in s.items() if k != "t") for s in samples]
    names = sorted({k for s in samples for k in s if k != "t"})
    pick = {"start": samples[0], "middle": samples[len(samples) // 2], "end": samples[-1]}
    half = samples[len(samples) // 2:]
    slope = (np.polyfit([s["t"] for s in half], totals[len(samples) // 2:], 1)[0] * 600) if len(half) > 2 else None
    return {"mb": {when: {"total": round(sum(s.get(n, 0) for n in names), 1), **{n: s.get(n) for n in names}}
                   for when, s in pick.items()},
            "growth_mb": round(totals[-1] - totals[0], 1),
            "second_half_mb_per_10_min": None if slope is None else round(float(slope), 1),
            "timeline": [{"t": s["t"], "total_mb": round(t, 1)} for s, t in zip(samples, totals)]}


def server_summary(server: Server, requests: list[Request], outcomes: list[Outcome], speculative: bool,
                   counters: dict, seconds: float) -> dict:
    statuses = [classify(r, o, speculative) for r, o in zip(requests, outcomes)]
    by_kind: dict[str, Counter] = {}
    for request, status in zip(requests, statuses):
        by_kind.setdefault(request.kind, Counter())[status] += 1
    complete = [o for o, s in zip(outcomes, statuses) if s == "ok"]
    first = [o.first_token for o in complete if o.first_token is not None]
    delta = {k: None if counters["after"][k] is None else counters["after"][k] - counters["before"][k]
             for k in counters["after"]}
    unexpected = [f"#{r.index} {r.kind}: {s} {o.detail}"[:300] for r, o, s in zip(requests, outcomes, statuses)
                  if s not in ("ok", "refused", "disconnected", "cancelled")
                  or (s == "ok" and r.must_refuse(speculative))]
    return {
        "requests": len(requests), "by_status": dict(Counter(statuses)),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "unexpected": len(unexpected), "unexpected_first": unexpected[:5],
        "latency_p50": percentile([o.latency for o in complete], 50),
        "latency_p99": percentile([o.latency for o in complete], 99),
        "ttft_p50": percentile(first, 50), "ttft_p99": percentile(first, 99),
        "generated_tokens_per_second": None if delta["generated"] is None else round(delta["generated"] / seconds, 1),
        "spec_decode": None if delta["drafted"] is None else {
            "draft_tokens": delta["drafted"], "accepted_tokens": delta["accepted"],
            "acceptance_rate": round(delta["accepted"] / delta["drafted"], 3) if delta["drafted"] else None},
        "health_failures": server.health_failures,
        "memory": memory_summary(server.memory),
    }


def compare(requests: list[Request], plain: list[Outcome], spec: list[Outcome]) -> dict:
    """Greedy answers both servers completed must be equal; structured outputs must be one
    of their choices on both."""
    checked = [(r, a, b) for r, a, b in zip(requests, plain, spec)
               if r.greedy and a.status == b.status == "ok"]
    mismatches = [f"#{r.index}: {a.texts!r} vs {b.texts!r}"[:400] for r, a, b in checked if a.texts != b.texts]
    violations = {name: sum(1 for r, o in zip(requests, outcomes) if r.kind == "structured" and o.status == "ok"
                            and any(t.strip() not in CHOICES for t in o.texts))
                  for name, outcomes in (("plain", plain), ("speculative", spec))}
    return {"greedy_checks": len(checked), "mismatches": len(mismatches), "mismatches_first": mismatches[:5],
            "structured_checks": sum(r.kind == "structured" for r in requests),
            "structured_violations": violations}


# ---- the run ----

def serve_command(args, port: int, spec: dict | None) -> list[str]:
    extra = ["--chat-template", str(args.chat_template)] if args.chat_template else []
    if spec is None:
        # The plain server is the reference, and vLLM 0.32's CPU build kills plain decoding on
        # a seeded request whose prompt is prefilled in chunks (patches.py,
        # `cpu_seeded_prefill_chunks`, mends it in our engines only): a test's soak on a slow
        # machine, its prompts queueing, lost the plain server that way. Prefilled whole, a
        # prompt never meets that rewind.
        extra.append("--no-enable-chunked-prefill")
    return vllm_serve_command(args, port, spec, extra)


def start_servers(args) -> list[Server]:
    logs = args.out.with_suffix("")
    specs = {"plain": None, "speculative": args.spec}
    servers = [Server(name, serve_command(args, args.port + i, spec), args.port + i, Path(f"{logs}.{name}.log"))
               for i, (name, spec) in enumerate(specs.items())]
    try:
        for server in servers:
            wait_until_healthy(server.url, server.process, server.log)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=json.loads, required=True, help="the speculative server's --speculative-config")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s from all clients together")
    parser.add_argument("--max-requests", type=int, default=20_000)
    parser.add_argument("--prompts", default="heldout", help="heldout, humaneval, or a JSONL file")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--chat-template", type=Path, default=None,
                        help="for a base without one (default: examples/transcript.jinja for such a base)")
    add_engine_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--sample-seconds", type=float, default=10.0, help="RSS and /health every so often")
    parser.add_argument("--port", type=int, default=8650, help="the plain server's; the speculative one's is +1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.chat_template is None and not base_has_chat_template(args.base_model):
        args.chat_template = TRANSCRIPT_TEMPLATE
    return args


def base_has_chat_template(base: Path) -> bool:
    from transformers import AutoTokenizer

    return bool(AutoTokenizer.from_pretrained(base).chat_template)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts, args.num_prompts).texts
    requests = make_requests(args.max_requests, prompts, args.max_model_len, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    servers = start_servers(args)
    try:
        load, counters, seconds = asyncio.run(drive(servers, str(args.base_model), requests, args))
        after_load = {s.name: drained(s) for s in servers}
    finally:
        shutdowns = {s.name: s.stop() for s in servers}
    sent = load["requests"]
    results = {}
    for server in servers:
        summary = server_summary(server, sent, load["outcomes"][server.name], server.name == "speculative",
                                 {k: v[server.name] for k, v in counters.items()}, seconds)
        summary.update(after_load=after_load[server.name], log_errors=log_errors(server.log),
                       shutdown=shutdowns[server.name])
        results[server.name] = summary
    record = {
        "command": "python -m benchmarks.soak " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": round(seconds, 1), "requests": len(sent), "by_kind": dict(Counter(r.kind for r in sent)),
        "checks": compare(sent, load["outcomes"]["plain"], load["outcomes"]["speculative"]),
        "servers": results,
    }
    atomic_write_text(args.out, json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "servers"}, indent=1), flush=True)
    return record


if __name__ == "__main__":
    main()
