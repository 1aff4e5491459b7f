"""The benchmark's pieces that need no engine: prompt sources, metrics, report and plots."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import plot, report
from benchmarks.run import (
    Prompts,
    compare_with_vanilla,
    cpu_model,
    generate_at_concurrency,
    install_step_timers,
    load_prompts,
    read_step_timers,
    repetition_ratio,
    request_inputs,
    step_breakdown,
    summarize,
    token_mismatches,
)
from conftest import REPO
from vllm_clover_training.data import DataError

RESULTS = REPO / "benchmarks" / "results" / "results.json"
SMOLLM2_RESULTS = REPO / "benchmarks" / "results" / "smollm2" / "results.json"
POLICY_RESULTS = REPO / "benchmarks" / "results" / "policy"
SPEC_BENCH = REPO.parent / "shared" / "data" / "spec_bench_questions.jsonl"


def test_prompt_sources(tmp_path):
    assert load_prompts("humaneval", 3).texts[0].startswith("from typing import List")
    assert len(load_prompts("heldout", 5).texts) == 5
    lines = [{"prompt": "def f():"}, {"turns": ["Write a haiku.", "Another."]},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]}]
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert load_prompts(str(tmp_path / "p.jsonl"), 10) == Prompts(["def f():", "Write a haiku.", "Why?"])
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"question": "y"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a \"prompt\" string, .* found keys \['question'\]"):
        load_prompts(str(tmp_path / "bad.jsonl"), 10)


def test_chat_models_get_prompts_through_their_chat_template(demo_base, real_base):
    from transformers import AutoTokenizer

    assert request_inputs(["def f():"], demo_base, raw=False) == ["def f():"]  # no template: text
    assert request_inputs(["Write a haiku."], real_base, raw=True) == ["Write a haiku."]
    [chat] = request_inputs(["Write a haiku."], real_base, raw=False)
    text = AutoTokenizer.from_pretrained(real_base).decode(chat["prompt_token_ids"])
    assert text.endswith("<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason="the shared Spec-Bench copy is not next to this checkout")
def test_spec_bench_file():
    assert len(load_prompts(str(SPEC_BENCH), 480).texts) == 480
    first = load_prompts(str(SPEC_BENCH), 12)  # round robin over Spec-Bench's six tasks
    assert first.categories == 2 * ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def test_categories_come_round_robin(tmp_path):
    lines = [{"prompt": f"{c}{i}", "category": c} for c in "ab" for i in range(3)]
    lines.append({"prompt": "w", "category": "writing"})  # an MT-Bench category: Spec-Bench's mt_bench
    (tmp_path / "c.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert load_prompts(str(tmp_path / "c.jsonl"), 5) == Prompts(["a0", "b0", "w", "a1", "b1"],
                                                                 ["a", "b", "mt_bench", "a", "b"])


def test_metrics():
    assert repetition_ratio([1, 2, 3, 4, 5, 6]) == 0.0
    assert repetition_ratio([7, 7, 7, 7, 7, 7]) == pytest.approx(2 / 3)  # 3 four-grams, 2 seen before
    assert token_mismatches([[1, 2, 3], [1, 2]], [[1, 2, 3], [1, 9, 3]]) == [0, 2]


def test_results_name_the_cpu_and_its_speed_deciding_instruction_sets(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Xeon X\nflags\t\t: fpu avx2 amx_tile sse4_2\n\n"
                       "processor\t: 1\nmodel name\t: Xeon X\nflags\t\t: fpu avx2 amx_tile sse4_2\n")
    machine = {"processor": "x86_64", **cpu_model(cpuinfo)}
    assert machine["cpu_flags"] == ["avx2", "amx_tile"]
    assert report.machine_text(machine) == "Xeon X (x86_64; avx2, amx_tile)"
    assert cpu_model(tmp_path / "absent") == {}
    assert report.machine_text({"processor": "x86_64"}) == "x86_64"  # results written before the CPU was


class StepsEngine:
    """An engine's request interface as generate_at_concurrency drives it: request `bench-i`
    finishes after (i * 5) % 3 + 1 steps with output [i]; vLLM's own ids carry a suffix."""

    def __init__(self):
        self.running: dict[str, int] = {}
        self.most_in_flight = 0
        self.steps = 0

    def add_request(self, request_id, prompt, params):
        self.running[f"{request_id}-x"] = (prompt * 5) % 3 + 1
        self.most_in_flight = max(self.most_in_flight, len(self.running))
        return f"{request_id}-x"

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        self.running = {r: left - 1 for r, left in self.running.items()}
        done = [r for r, left in self.running.items() if left == 0]
        for r in done:
            del self.running[r]
        self.steps += 1
        return [SimpleNamespace(request_id=r, finished=True,
                                outputs=[SimpleNamespace(token_ids=[int(r.split("-")[1])])]) for r in done]


def test_requests_run_at_the_batch_size_each_replaced_as_it_finishes_and_come_back_in_prompt_order():
    llm = SimpleNamespace(llm_engine=StepsEngine())
    assert generate_at_concurrency(llm, list(range(7)), 3, params=None) == [[i] for i in range(7)]
    assert llm.llm_engine.most_in_flight == 3
    assert llm.llm_engine.steps == 5  # waves of 3 would take 3 + 3 + 1 steps


def a_round(seconds: float, outputs: list[list[int]], draft: float = 0.0) -> dict:
    """What benchmarks.run.measure returns for one round (10 engine steps, no categories)."""
    return {"outputs": outputs, "seconds": seconds, "by_category": {}, "spec_decode": None,
            "timers": {"execute": 0.5 * seconds, "sample": 0.25 * seconds, "draft": draft, "sample_calls": 10}}


def test_rounds_give_the_median_speed_and_per_round_ratios():
    outputs = [[1, 2, 3, 4]] * 2  # 8 tokens a round
    vanilla = summarize([a_round(1.0, outputs), a_round(2.0, outputs), a_round(4.0, outputs)])
    assert vanilla["output_tokens_per_s_rounds"] == [8.0, 4.0, 2.0]
    assert vanilla["output_tokens_per_s"] == 4.0 and vanilla["rounds_agree"]
    # The machine slowed down over the rounds; the method was 2x, 1x and 4x vanilla in its own round.
    ours = summarize([a_round(0.5, outputs, draft=0.1), a_round(2.0, outputs), a_round(1.0, [[1, 2, 3, 5]] * 2)])
    assert not ours["rounds_agree"]  # round 3 drifted: greedy outputs should never change
    results = {"vanilla": {"1": vanilla}, "ours": {"1": ours}}
    compare_with_vanilla(results)
    assert results["ours"]["1"]["speedup_over_vanilla"] == 2.0  # median of 2, 1, 4
    assert results["ours"]["1"]["speedup_range"] == [1.0, 4.0]
    assert results["ours"]["1"]["mismatches"] == [0, 0]  # against vanilla's first round
    assert ours["draft_time_fraction"] == pytest.approx(0.1 / (0.75 * 3.5))
    assert report.speed_cell(results["ours"]["1"], 1) == "8 (2.00x, 1.00–4.00 ≈)"  # rates 16, 4, 8


def test_step_timers_have_every_part_before_its_first_call():
    """Each round of fresh engines installs its own timers; parts a round never called (Clover's
    heads in an engine that drafted nothing) must still be summed with the other rounds'."""
    runner = SimpleNamespace(execute_model=lambda: None, sample_tokens=lambda: None,
                             propose_draft_token_ids=lambda: None)
    worker = SimpleNamespace(model_runner=runner)
    install_step_timers(worker)
    runner.execute_model()
    timers = read_step_timers(worker)
    assert timers == {"execute": timers["execute"], "execute_calls": 1, "sample": 0.0, "sample_calls": 0,
                      "draft": 0.0, "draft_calls": 0}


def test_step_breakdown_splits_the_draft_step():
    timers = {"execute": 5.0, "target_forward": 4.0, "sample": 3.0, "sampling": 0.5, "draft": 2.0,
              "draft_batch": 0.1, "attention_metadata": 0.2, "augmenting_block": 0.3, "heads_chain": 1.0,
              "head_logits": 0.4, "head_rows": 0.1, "sample_calls": 10, "draft_calls": 10}
    parts = step_breakdown(timers, wall_seconds=10.0)
    assert parts["wall"] == 1.0 and parts["runner"] == 0.8 and parts["outside_runner"] == pytest.approx(0.2)
    assert parts["execute_other"] == pytest.approx(0.1) and parts["sample_other"] == pytest.approx(0.05)
    assert parts["draft.heads_chain"] == pytest.approx(0.05)  # the chain less its logits and rows
    assert parts["draft.other"] == pytest.approx(0.04)  # 2.0 - (0.1 + 0.2 + 0.3 + 1.0), per step
    assert sum(v for k, v in parts.items() if k.startswith("draft.")) == pytest.approx(parts["draft"])


def test_a_drafting_cell_shows_the_steps_the_policy_slept_through():
    drafting = {"draft_tokens_per_request_step": 0.05, "steps_without_drafts_fraction": 0.9,
                "steps_slept_fraction": 0.6, "policy": {}, "draft_tokens_per_request_step_by_source":
                    {"rule": 0.0, "plan": 0.04, "look": 0.01, "deeper_look": 0.0}}
    assert report.drafting_cell(drafting) == "0.05 (90%, slept 60%, looks 0.01)"
    assert report.drafting_cell({**drafting, "steps_slept_fraction": 0.0}) == "0.05 (90%, looks 0.01)"


def test_the_drafting_summary_is_the_median_rounds_and_shows_every_rounds_spread():
    """A policy may draft in some rounds and not in others (a drafting spell in one engine's
    rounds): the median round alone would hide it."""
    def drafting(tokens):
        return {"draft_tokens_per_request_step": tokens, "steps_without_drafts_fraction": 1.0 - tokens}

    outputs = [[1, 2, 3, 4]] * 2
    ours = summarize([{**a_round(1.0, outputs), "drafting": drafting(t)} for t in (0.0, 0.9, 0.004)])
    assert ours["drafting"]["draft_tokens_per_request_step"] == 0.004  # the median round's
    assert ours["drafting"]["draft_tokens_per_request_step_rounds"] == [0.0, 0.9, 0.004]  # in round order
    assert report.drafting_cell(ours["drafting"]) == "0.00 [0.00–0.90] (100%)"
    assert report.drafting_cell(summarize([{**a_round(1.0, outputs), "drafting": drafting(0.0)}] * 2)["drafting"]) \
        == "0.00 (100%)"  # rounds that agree show no spread


@pytest.mark.parametrize("results_file,section,batches", [
    (RESULTS, "results", [1, 4, 8, 16, 32, 64]),
    (SMOLLM2_RESULTS, "smollm2-results", [1, 4, 16, 64]),
    (POLICY_RESULTS / "demo-priced-asleep-argmax.json", "policy-demo", [1, 4, 16, 64]),
    (POLICY_RESULTS / "smollm2-priced-asleep-argmax.json", "policy-smollm2", [1, 4, 16, 64]),
    (RESULTS.parent / "peer.json", "demo-peer", [1, 4]),
    (SMOLLM2_RESULTS.parent / "peer.json", "smollm2-peer", [1, 4]),
])
def test_report_and_plots_from_the_committed_results(results_file, section, batches, tmp_path):
    results = json.loads(results_file.read_text())
    text = report.markdown(results, results_file.relative_to(REPO))
    for method in results["results"]:
        assert f"| {method} |" in text
    assert "| method | " + " | ".join(f"batch {b}" for b in batches) + " |" in text
    start, end = report.markers(section)
    readme = (REPO / "README.md").read_text()
    assert f"{start}\n{text}\n{end}" in readme, (
        f"README section {section} is stale: rerun python -m benchmarks.report {results_file.relative_to(REPO)} "
        f"--readme README.md --section {section}")
    paths = plot.write_plots(results_file, tmp_path)
    assert [p.stem for p in paths] == plot.plot_names(results)
    assert all(p.stat().st_size > 10_000 for p in paths)


@pytest.mark.parametrize("name", ["demo-before", "demo-after", "smollm2-before", "smollm2-after"])
def test_profile_sections_match_the_committed_profiles(name):
    results_file = REPO / "benchmarks" / "results" / "profile" / f"{name}.json"
    text = report.markdown(json.loads(results_file.read_text()), results_file.relative_to(REPO), brief=True)
    assert "Where a step's time goes" in text
    start, end = report.markers(f"profile-{name}")
    assert f"{start}\n{text}\n{end}" in (REPO / "README.md").read_text(), (
        f"README section profile-{name} is stale: rerun python -m benchmarks.report "
        f"{results_file.relative_to(REPO)} --readme README.md --section profile-{name} --brief")


@pytest.mark.parametrize("target,results_name", [("demo", "demo-load-6cf7af3.json"),
                                                  ("smollm2", "smollm2-load-decode-gate.json")])
def test_load_sections_match_the_committed_load_runs(target, results_name):
    results_file = POLICY_RESULTS / results_name
    record = json.loads(results_file.read_text())
    text = report.load_markdown(record, results_file.relative_to(REPO))
    assert all(f"| {method} |" in text for method in record["results"])
    start, end = report.markers(f"load-{target}")
    assert f"{start}\n{text}\n{end}" in (REPO / "README.md").read_text(), (
        f"README section load-{target} is stale: rerun python -m benchmarks.report "
        f"{results_file.relative_to(REPO)} --readme README.md --section load-{target}")


def test_soak_section_matches_the_committed_soak():
    results_file = REPO / "benchmarks" / "results" / "soak" / "demo-clover.json"
    text = report.soak_markdown(json.loads(results_file.read_text()), results_file.relative_to(REPO))
    start, end = report.markers("soak-demo")
    assert f"{start}\n{text}\n{end}" in (REPO / "README.md").read_text(), (
        "README section soak-demo is stale: rerun python -m benchmarks.report "
        f"{results_file.relative_to(REPO)} --readme README.md --section soak-demo")


def test_a_failing_method_is_reported_and_the_run_completes(tmp_path, monkeypatch):
    from benchmarks import run

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # run.main sets it; restored after the test
    out = tmp_path / "results.json"
    result = run.main(["--methods", "clover,clp", "--batch-sizes", "1", "--num-prompts", "1", "--max-tokens", "4",
                       "--heads-dir", str(tmp_path / "missing"), "--out", str(out)])
    assert set(result["failed"]) == {"clover", "clp"}
    assert "no config.json in heads directory" in result["failed"]["clover"]
    assert json.loads(out.read_text())["failed"] == result["failed"]


def test_a_run_stopped_by_sigterm_leaves_no_engine_process_behind(tmp_path, demo_base):
    """`kill` (SIGTERM) a run once its engine is up: the engine's processes go with it, and
    no results file is written."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    out, engines = tmp_path / "r.json", []
    run = subprocess.Popen([sys.executable, "-m", "benchmarks.run", "--methods", "vanilla", "--batch-sizes", "1",
                            "--num-prompts", "8", "--rounds", "1000", "--enforce-eager", "--out", str(out)],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and run.poll() is None:
            engines = psutil.Process(run.pid).children(recursive=True)
            if any("VLLM::Worker" in title(process) for process in engines):
                break
            time.sleep(1)
        assert run.poll() is None and engines, "the run ended or never started an engine"
        time.sleep(10)  # loaded, warming up or measuring
        engines = psutil.Process(run.pid).children(recursive=True)
        os.kill(run.pid, signal.SIGTERM)
        assert run.wait(timeout=120) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(engines, timeout=60)
        assert alive == [], alive
        assert not out.exists()
    finally:  # whatever failed, leave no engine running for the tests after this one
        run.kill()
        for process in engines:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def title(process) -> str:
    """A process's command line as `ps` shows it (vLLM names its engine's processes there)."""
    import psutil

    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def test_fresh_engines_measure_their_rounds_per_load_and_every_round_runs_once():
    from benchmarks.run import engine_lifetimes

    assert engine_lifetimes(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert engine_lifetimes(2, 1) == [[0], [1]]
    assert engine_lifetimes(3, 3) == [[0, 1, 2]]


def test_fresh_engines_are_loaded_anew_in_an_order_rotated_by_the_load(tmp_path, monkeypatch):
    """--fresh-engines: every two rounds (--rounds-per-load) start every engine anew, the
    first load's first engine the second's last (rotated by the load, not by its first round:
    round 2 would rotate two methods back to the first load's order), and measure it at every
    batch size; results look as usual.
    With --never-draft our method's policy drafts nothing in any engine, warmed-up or anew."""
    from benchmarks import run

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # run.main sets it; restored after the test
    started, start_engine = [], run.start_engine
    monkeypatch.setattr(run, "start_engine", lambda method, *a: started.append(method) or start_engine(method, *a))
    result = run.main(["--methods", "vanilla,clover", "--batch-sizes", "1,2", "--num-prompts", "2,3",
                       "--max-tokens", "6", "--rounds", "4", "--rounds-per-load", "2", "--fresh-engines",
                       "--enforce-eager", "--never-draft",
                       "--out", str(tmp_path / "r.json")], summary=False)
    assert started == ["vanilla", "clover", "clover", "vanilla"] and result["failed"] == {}
    for batch, prompts in (("1", 2), ("2", 3)):  # at batch 2 the third prompt replaces the first to finish
        second = result["results"]["clover"][batch]
        assert second["rounds"] == 4 and second["rounds_agree"] and second["mismatches"] == [0] * prompts
        low, high = second["speedup_range"]
        assert low <= second["speedup_over_vanilla"] <= high
        assert second["drafting"]["stats"]["rows"] > 0 and second["drafting"]["stats"]["drafted"] == 0


def test_interleaved_rounds_with_profile_in_real_engines(tmp_path, monkeypatch):
    """Four engines loaded together, two rounds each, with our draft step's parts timed;
    Clover with both draft policies (the fixed one drafts every head, so every part runs)."""
    from benchmarks import run

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # run.main sets it; restored after the test
    result = run.main(["--methods", "vanilla,clover-fixed,clover,medusa", "--batch-sizes", "1", "--num-prompts", "2",
                       "--max-tokens", "12", "--rounds", "2", "--profile", "--enforce-eager",
                       "--out", str(tmp_path / "r.json")], summary=False)
    assert result["failed"] == {}
    fixed, medusa = result["results"]["clover-fixed"]["1"], result["results"]["medusa"]["1"]
    goodput = result["results"]["clover"]["1"]
    assert fixed["rounds"] == 2 and len(fixed["output_tokens_per_s_rounds"]) == 2 and fixed["rounds_agree"]
    assert fixed["mismatches"] == [0, 0] and medusa["mismatches"] == [0, 0] and goodput["mismatches"] == [0, 0]
    low, high = fixed["speedup_range"]
    assert low <= fixed["speedup_over_vanilla"] <= high
    # Each engine's own counters: vLLM's process-wide metrics would report only the newest engine.
    for r in (fixed, medusa):
        assert r["spec_decode"]["drafts"] > 0 and r["mean_acceptance_length"] > 1.2
    assert fixed["spec_decode"] != medusa["spec_decode"]
    steps = fixed["step_seconds"]
    for part in ("target_forward", "sampling", "draft.augmenting_block", "draft.augmenting_rows",
                 "draft.attention_metadata", "draft.heads_chain", "draft.head_logits", "draft.head_rows"):
        assert steps[part] > 0, part
    assert "draft.augmenting_block" not in result["results"]["vanilla"]["1"]["step_seconds"]
    # What our heads drafted: all 4 every step with the fixed policy; the goodput policy's models.
    assert fixed["drafting"]["draft_tokens_per_request_step"] == 4.0 and fixed["drafting"]["policy"] is None
    assert fixed["drafting"]["draft_tokens_per_request_step_by_source"] == {"rule": 4.0, "plan": 0.0, "look": 0.0,
                                                                            "deeper_look": 0.0}
    by_source = goodput["drafting"]["draft_tokens_per_request_step_by_source"]
    assert by_source["rule"] == 0 and sum(by_source.values()) == pytest.approx(
        goodput["drafting"]["draft_tokens_per_request_step"])
    assert "drafting" not in medusa
    policy = goodput["drafting"]["policy"]
    assert policy["step_seconds_by_requests_and_tokens"] and sum(policy["judged_drafts_per_position"]) > 0
    markdown = report.markdown(result, tmp_path / "r.json")
    assert "Where a step's time goes" in markdown and "tokens drafted in looks" in markdown
    assert "| 4.00 (0%) |" in markdown  # clover-fixed: no policy, so no looks


def test_load_arrivals_ramp_with_the_rates_and_repeat_with_the_seed():
    from benchmarks.load import arrival_times

    arrivals = arrival_times([2.0, 20.0, 0.0, 2.0], phase_seconds=30.0)
    per_phase = [sum(p == phase for _, p in arrivals) for phase in range(4)]
    assert 30 < per_phase[0] < 95 and 480 < per_phase[1] < 720 and per_phase[2] == 0 and 30 < per_phase[3] < 95
    assert all(30 * p <= t < 30 * (p + 1) for t, p in arrivals) and arrivals == sorted(arrivals)
    assert arrival_times([2.0, 20.0, 0.0, 2.0], 30.0) == arrivals


def test_load_summary_per_phase():
    from benchmarks.load import Completion, summarise

    records = [Completion(0, 0.0, first_token=0.1, latency=1.0, tokens=10),
               Completion(0, 0.5, first_token=0.3, latency=2.0, tokens=10),
               Completion(1, 1.2, error="HTTP 500: boom")]
    counters = [{"generated": 0, "drafted": 0, "accepted": 0}, {"generated": 20, "drafted": 40, "accepted": 10},
                {"generated": 20, "drafted": 40, "accepted": 10}, {"generated": 25, "drafted": 40, "accepted": 10}]
    summary = summarise(records, counters, rates=[2.0, 1.0])
    first, second = summary["phases"]
    assert first["requests"] == 2 and first["ttft_mean"] == pytest.approx(0.2)
    assert first["tpot_mean"] == pytest.approx(((0.9 / 9) + (1.7 / 9)) / 2, abs=1e-5)
    assert first["draft_tokens_per_generated"] == 2.0 and first["acceptance_rate"] == 0.25
    assert second["errors"] == 1 and second["generated_tokens"] == 5  # the last phase runs until drained
    assert summary["output_tokens_per_second"] == pytest.approx(20 / 2.5)
    assert summary["first_errors"] == ["HTTP 500: boom"]
