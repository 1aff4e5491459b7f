"""vLLM's spec-decode counters of an offline engine (`vllm.LLM`), for tests, benchmarks and
examples. The engine needs `disable_log_stats=False` for `LLM.get_metrics()` to report them.
"""

from __future__ import annotations

from typing import Callable


def spec_decode_counters(llm, num_positions: int = 4) -> dict | None:
    """{"drafts", "draft_tokens", "accepted", "accepted_per_pos"}; None for an engine without
    speculative decoding."""
    found = {m.name: m for m in llm.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in found:
        return None
    per_pos = found.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return {
        "drafts": found["vllm:spec_decode_num_drafts"].value,
        "draft_tokens": found["vllm:spec_decode_num_draft_tokens"].value,
        "accepted": found["vllm:spec_decode_num_accepted_tokens"].value,
        "accepted_per_pos": list(per_pos.values) if per_pos else [0] * num_positions,
    }


def own_spec_decode_counters(llm, num_positions: int = 4) -> Callable[[], dict | None]:
    """A reader of this engine's own counters, for a process that holds several engines.

    vLLM's Prometheus registry is global to the process, and each new engine unregisters the
    metrics of the engines before it, so `LLM.get_metrics()` then reports only the newest
    one. This tallies the per-step spec-decode stats the engine's front end records (what
    those counters add up); same keys as `spec_decode_counters`, None without speculation."""
    engine = llm.llm_engine
    if engine.vllm_config.speculative_config is None:
        return lambda: None
    if engine.logger_manager is None:
        raise ValueError("own_spec_decode_counters needs an engine built with disable_log_stats=False")
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * num_positions}
    record = engine.logger_manager.record

    def tallying_record(*args, **kwargs):
        stats = kwargs.get("scheduler_stats", args[0] if args else None)
        spec = getattr(stats, "spec_decoding_stats", None)
        if spec is not None:
            totals["drafts"] += spec.num_drafts
            totals["draft_tokens"] += spec.num_draft_tokens
            totals["accepted"] += spec.num_accepted_tokens
            for i, accepted in enumerate(spec.num_accepted_tokens_per_pos[:num_positions]):
                totals["accepted_per_pos"][i] += accepted
        return record(*args, **kwargs)

    engine.logger_manager.record = tallying_record
    return lambda: {**totals, "accepted_per_pos": list(totals["accepted_per_pos"])}


def counters_since(before: dict | None, after: dict | None) -> dict | None:
    """What the counters grew by between two readings (per position for lists)."""
    if after is None:
        return None
    return _elementwise(after, before, lambda a, b: a - b)


def counters_plus(total: dict | None, more: dict | None) -> dict | None:
    """Two growths added up (None: nothing counted yet)."""
    if total is None or more is None:
        return more if total is None else total
    return _elementwise(total, more, lambda a, b: a + b)


def _elementwise(x: dict, y: dict, op) -> dict:
    return {key: _elementwise(value, y[key], op) if isinstance(value, dict)
            else [op(a, b) for a, b in zip(value, y[key])] if isinstance(value, list) else op(value, y[key])
            for key, value in x.items()}


def mean_acceptance_length(counters: dict) -> float:
    """vLLM's definition: 1 + accepted / drafts, over steps that drafted (1.0 if none did)."""
    return 1 + counters["accepted"] / max(counters["drafts"], 1)


def first_draft_acceptance(counters: dict) -> float:
    """How often a request's first draft was accepted, over the steps that drafted: the
    heads' quality whatever lengths a policy chose (a mean acceptance length falls when a
    policy drafts fewer tokens, even from better heads)."""
    return counters["accepted_per_pos"][0] / max(counters["drafts"], 1)
