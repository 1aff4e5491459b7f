"""`vllm-clover-train` on the demo base: learning, checkpoints, errors, resume, torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import DEMO_HEADS, REPO
from vllm_clover import checkpoint
from vllm_clover.methods import TABLE
from vllm_clover_training import model_card, stdlib_corpus
from vllm_clover_training.cli import main

SMALL = ["--num-heads", "3", "--max-len", "64", "--batch-size", "4", "--save-every", "4"]


@pytest.fixture(scope="module")
def train_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    train, _ = stdlib_corpus.split_sources()
    with open(path, "w") as f:
        for src in train[:12]:
            f.write(json.dumps({"text": stdlib_corpus.read_source(src)[:2500]}) + "\n")
    return path


def run_cli(*args: str) -> None:
    main([str(a) for a in args])


def metrics(heads_dir):
    return [json.loads(line) for line in (heads_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", [m.name for m in TABLE])
def test_short_run_learns_and_writes_a_loadable_checkpoint(method, demo_base, train_jsonl, tmp_path):
    out = tmp_path / method
    run_cli(method, "--base-model", demo_base, "--data", train_jsonl, "--out", out, "--epochs", "2", *SMALL)
    losses = [m["loss"] for m in metrics(out)]
    assert len(losses) >= 20
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    config, tensors = checkpoint.load_heads(out, demo_base)
    assert config["vllm_clover"]["method"] == method and config["vllm_clover"]["hyper"]["num_heads"] == 3
    assert set(json.loads((out / "provenance.json").read_text())) >= {
        "git_commit", "versions", "command", "data_sha256", "final_metrics"}
    module = checkpoint.build_heads_module(out, config, tensors)
    assert sum(p.numel() for p in module.parameters()) > 0
    assert not out.with_name(out.name + ".work").exists()  # finished: nothing left to resume
    card = (out / "README.md").read_text()  # every directory the CLI writes can go to the Hub as it is
    assert card.startswith("---\nbase_model: ") and f'"method": "{method}"' in card
    assert json.loads((out / "provenance.json").read_text())["final_metrics"]["train_seconds"] > 0


def test_eval_reports_per_head_accuracy(demo_base, train_jsonl, tmp_path):
    out = tmp_path / "clp"
    run_cli("clp", "--base-model", demo_base, "--data", train_jsonl, "--out", out, "--eval-data", train_jsonl, *SMALL)
    report = tmp_path / "eval.json"
    run_cli("eval", "--heads", out, "--base-model", demo_base, "--data", train_jsonl, "--out", report,
            "--max-len", "64")
    result = json.loads(report.read_text())
    assert result["method"] == "clp" and len(result["per_head"]) == 3
    for head in result["per_head"]:
        assert 0 <= head["top1"] <= head["top5"] <= 1
    assert {"tau", "length_exact_acc", "expected_accepted"} <= set(result["clp"])
    # Greedy acceptance: a position accepts head i's draft only if it accepted heads 1..i-1's.
    accepted = result["greedy_acceptance"]
    rates = accepted["rate_per_position"]
    assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:]))
    assert accepted["per_position_acceptance_length"] == pytest.approx(1 + sum(rates), abs=1e-3)
    assert rates[0] > 0  # the demo heads learn something in 12 steps

    # Training with --eval-data leaves the same evaluation, and a model card written from it.
    trained_eval = json.loads((out / "eval.json").read_text())
    assert [h["top1"] for h in trained_eval["per_head"]] == pytest.approx([h["top1"] for h in result["per_head"]],
                                                                         abs=0.01)
    card = (out / "README.md").read_text()
    assert card == model_card.heads_card(out)
    assert card.startswith(f"---\nbase_model: \"{demo_base}\"\nlibrary_name: \"vllm\"\n")
    front = card.split("---\n")[1]
    assert f'"top1_per_head": [{round(trained_eval["per_head"][0]["top1"], 4)}' in front
    assert f"\n# clp draft heads for `{demo_base.name}`" in card
    assert f"| 1 | {100 * trained_eval['per_head'][0]['top1']:.1f}% |" in card
    assert f"{trained_eval['greedy_acceptance']['per_position_acceptance_length']:.2f} tokens a step" in card
    assert '"method": "clp"' in card and "Length predictor at tau" in card

    # The goodput policy's prior, on request: acceptance per draft position and confidence bin
    # on this data, counted as the policy counts served drafts (its first position is the
    # greedy rate); training writes none (README: why).
    assert not (out / "calibration.json").exists()
    run_cli("eval", "--heads", out, "--base-model", demo_base, "--data", train_jsonl, "--out", report,
            "--max-len", "64", "--calibrate")
    calibration = json.loads((out / "calibration.json").read_text())
    tried, accepted = np.array(calibration["tried"]), np.array(calibration["accepted"])
    assert tried.shape == accepted.shape == (3, 10) and (accepted <= tried).all()
    assert accepted[0].sum() / tried[0].sum() == pytest.approx(rates[0], abs=1e-4)
    assert calibration["data"] == [str(train_jsonl)] and "calibration" not in json.loads(report.read_text())


def test_card_rewrites_a_heads_directorys_model_card(demo_base, train_jsonl, tmp_path):
    out = tmp_path / "clover"
    run_cli("clover", "--base-model", demo_base, "--data", train_jsonl, "--out", out, *SMALL)
    written = (out / "README.md").read_text()
    (out / "README.md").unlink()
    run_cli("card", out)
    assert (out / "README.md").read_text() == written
    assert "None was run with this training" in written
    with pytest.raises(SystemExit, match=r"no config.json in .*: a card describes a heads directory"):
        run_cli("card", tmp_path)


def test_card_records_acceptance_a_benchmark_measured_in_vllm(tmp_path):
    """The committed policy benchmark of the demo heads, as if it had served this copy of them."""
    heads = tmp_path / "heads" / "clover"
    shutil.copytree(DEMO_HEADS / "clover", heads)
    report = json.loads((REPO / "benchmarks" / "results" / "policy" / "demo.json").read_text())
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(report))
    with pytest.raises(SystemExit, match=r"served clover heads from .*demo-heads/clover, not .*heads/clover"):
        run_cli("card", heads, "--served", elsewhere)
    report["settings"]["heads_dir"] = str(tmp_path / "heads")
    results = tmp_path / "results.json"
    results.write_text(json.dumps(report))
    run_cli("card", heads, "--served", results)
    fixed = report["results"]["clover-fixed"]["1"]
    card = (heads / "README.md").read_text()
    assert f'"served_acceptance_length": {round(fixed["mean_acceptance_length"], 3)}' in card.split("\n---\n")[0]
    assert f"| clover-fixed | 1 | {fixed['mean_acceptance_length']:.2f} |" in card
    assert f"Measured by `{report['command']}`" in card
    run_cli("card", heads)  # served.json stays with the heads: a later card keeps the measurement
    assert (heads / "README.md").read_text() == card


SHIPPED_HEADS = sorted(p.relative_to(REPO) for p in REPO.glob("assets/*-heads/*") if (p / "config.json").exists())


@pytest.mark.parametrize("heads", SHIPPED_HEADS, ids=str)
def test_shipped_cards_describe_their_files(heads, monkeypatch):
    monkeypatch.chdir(REPO)  # the cards name their directories as the repository does
    assert (heads / "README.md").read_text() == model_card.heads_card(heads)


def test_heads_for_another_base_are_refused(demo_base, train_jsonl, tmp_path):
    out = tmp_path / "medusa"
    run_cli("medusa", "--base-model", demo_base, "--data", train_jsonl, "--out", out, *SMALL)
    other = tmp_path / "other-base"
    other.mkdir()
    for f in demo_base.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    weights = load_file(other / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] + 1e-3
    from safetensors.torch import save_file
    save_file(weights, other / "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="trained for another base model: lm_head_sha256"):
        checkpoint.load_heads(out, other)


@pytest.mark.parametrize("line,message", [
    ('{"text": "ok"}\n{"text": 3}\n', r"train\.jsonl:2: field 'text' must be a non-empty string"),
    ('{"text": "ok"}\n\n{"txt": "x"}\n', r"train\.jsonl:3: expected a 'text', 'messages' or 'conversations'"),
    ('[1, 2]\n', r"train\.jsonl\[0\]: expected a JSON object, found int"),
    ('[{"text": "ok"},\n {"txt": "x"}]\n', r"train\.jsonl\[1\]: expected a 'text', 'messages' or 'conversations'"),
    ('[{"text": "ok"},\n {"text": }]\n', r"train\.jsonl:2: not valid JSON"),
    ('{"text": "a"\n', r"train\.jsonl:1: not valid JSON"),
    ('{"messages": [{"role": "robot", "content": "x"}]}\n', r"train\.jsonl:1: messages\[0\] must be"),
    ('{"conversations": [{"from": "human"}]}\n', r"train\.jsonl:1: conversations\[0\] must be"),
])
def test_bad_data_stops_with_file_and_line(demo_base, tmp_path, line, message):
    data = tmp_path / "train.jsonl"
    data.write_text(line)
    with pytest.raises(SystemExit, match=message):
        run_cli("clover", "--base-model", demo_base, "--data", data, "--out", tmp_path / "h", *SMALL)
    assert list(tmp_path.iterdir()) == [data]  # no heads, no h.work/


def test_data_is_checked_before_the_base_model_loads(train_jsonl, tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "x"}\n')
    missing_base = tmp_path / "no-such-base"  # loading it would fail with another error
    with pytest.raises(SystemExit, match=r"eval\.jsonl:2: expected a 'text'"):
        run_cli("clover", "--base-model", missing_base, "--data", train_jsonl, "--eval-data", bad,
                "--out", tmp_path / "h", *SMALL)
    with pytest.raises(SystemExit, match=r"eval\.jsonl:2: expected a 'text'"):
        run_cli("eval", "--heads", tmp_path / "no-such-heads", "--base-model", missing_base, "--data", bad,
                "--out", tmp_path / "eval.json")
    assert list(tmp_path.iterdir()) == [bad]


def test_sharegpts_own_file_layout_trains(demo_base, tmp_path):
    """ShareGPT_V3_unfiltered_cleaned_split.json is one JSON array of {"id", "conversations"}."""
    train, _ = stdlib_corpus.split_sources()
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([
        {"id": str(i), "conversations": [{"from": "human", "value": f"Show me {src}."},
                                         {"from": "gpt", "value": stdlib_corpus.read_source(src)[:1500]}]}
        for i, src in enumerate(train[:8])], indent=1))
    out = tmp_path / "clover"
    run_cli("clover", "--base-model", demo_base, "--data", data, "--out", out, *SMALL)
    assert checkpoint.load_heads(out, demo_base)[0]["vllm_clover"]["method"] == "clover"
    assert json.loads((out / "provenance.json").read_text())["data_sha256"]


def chat_rows(sources: list[str]) -> list[dict]:
    """UltraChat's row layout: a prompt, and the chat as OpenAI-style messages."""
    return [{"prompt": f"Show me {src}.",
             "messages": [{"role": "user", "content": f"Show me {src}."},
                          {"role": "assistant", "content": stdlib_corpus.read_source(src)[:1500]}]}
            for src in sources]


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` converts what it loads into Arrow files under its cache: keep them in tmp."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    return datasets


def test_a_hugging_face_dataset_directory_trains_and_evaluates(demo_base, tmp_path, datasets_cache):
    train, held_out = stdlib_corpus.split_sources()
    saved = tmp_path / "ultrachat"  # as `DatasetDict.save_to_disk` writes it
    datasets_cache.DatasetDict({"train_sft": datasets_cache.Dataset.from_list(chat_rows(train[:8])),
                                "test_sft": datasets_cache.Dataset.from_list(chat_rows(held_out[:3]))}
                               ).save_to_disk(str(saved))
    out = tmp_path / "clover"
    run_cli("clover", "--base-model", demo_base, "--data", saved, "--data-split", "train_sft", "--out", out,
            "--eval-data", saved, "--eval-data-split", "test_sft", *SMALL)
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["args"]["data_split"] == "train_sft" and provenance["data_sha256"][str(saved)]
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["positions"] > 0 and evaluation["data"] == [str(saved)]


def test_parquet_files_and_dataset_repos_read_with_a_chosen_column(tmp_path, datasets_cache):
    from vllm_clover_training import data as data_mod

    train, _ = stdlib_corpus.split_sources()
    rows = chat_rows(train[:4])
    parquet = tmp_path / "chats.parquet"
    datasets_cache.Dataset.from_list(rows).to_parquet(str(parquet))
    as_prompts = data_mod.read_records(parquet, field="prompt")  # a text column
    assert [r.text for r in as_prompts] == [row["prompt"] for row in rows]
    assert [r.messages for r in data_mod.read_records(parquet)] == [tuple(row["messages"]) for row in rows]
    # A dataset repo's own layout (data/{split}-NNNNN-of-NNNNN.parquet, UltraChat's split names):
    # the splits come from the file names.
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    for split, part in (("train_sft", rows[:3]), ("test_sft", rows[3:])):
        datasets_cache.Dataset.from_list(part).to_parquet(str(repo / "data" / f"{split}-00000-of-00001.parquet"))
    test_records = data_mod.read_records(repo, split="test_sft", field="messages")
    assert [r.source for r in test_records] == [f"{repo}[test_sft][0]"]


@pytest.mark.parametrize("extra,message", [
    ([], r"holds the splits \['a', 'b'\]: choose one with --data-split"),
    (["--data-split", "c"], r"has no split 'c'; it has \['a', 'b'\]"),
    (["--data-split", "b", "--data-field", "answer"], r"\[b\]\[0\]: no field 'answer' \(--data-field\)"),
    (["--data-split", "a"], r"\[a\]\[1\]: messages\[0\] must be"),
])
def test_dataset_errors_name_split_row_and_field_before_the_base_loads(tmp_path, datasets_cache, extra, message):
    chats = tmp_path / "chats"
    rows = [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "robot", "content": "x"}]}]
    datasets_cache.DatasetDict({"a": datasets_cache.Dataset.from_list(rows),
                                "b": datasets_cache.Dataset.from_list(rows[:1])}).save_to_disk(str(chats))
    with pytest.raises(SystemExit, match=message):
        run_cli("clover", "--base-model", tmp_path / "no-such-base", "--data", chats, *extra, "--out", tmp_path / "h")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats"]


def test_chat_and_sharegpt_records_tokenise(demo_base, tmp_path):
    from transformers import AutoTokenizer

    from vllm_clover_training import data as data_mod

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "def f():"},
                                             {"role": "assistant", "content": "return 1"}]}) + "\n"
                    + json.dumps({"conversations": [{"from": "human", "value": "def f():"},
                                                    {"from": "gpt", "value": "return 1"}]}) + "\n")
    tok = AutoTokenizer.from_pretrained(demo_base)
    chat, sharegpt = data_mod.read_records(path)
    assert data_mod.tokenize(chat, tok) == data_mod.tokenize(sharegpt, tok)
    prompt = data_mod.prompt_ids(chat, tok, 64)
    assert tok.decode(prompt).endswith("assistant: ")


def test_resume_after_kill_matches_uninterrupted_run(demo_base, train_jsonl, tmp_path):
    args = ["clover", "--base-model", demo_base, "--data", train_jsonl, "--epochs", "2", *SMALL]
    full = tmp_path / "full"
    run_cli(*args, "--out", full)

    killed = tmp_path / "killed"
    state = killed.with_name("killed.work") / "state.pt"
    cmd = [sys.executable, "-m", "vllm_clover_training.cli", *map(str, args), "--out", str(killed)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state.exists() and not killed.exists(), "the run must be killed between a save and the end"
    with pytest.raises(SystemExit, match="pass --resume"):
        run_cli(*args, "--out", killed)
    run_cli(*args, "--out", killed, "--resume")

    a, b = load_file(full / "model.safetensors"), load_file(killed / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
    assert [m["step"] for m in metrics(killed)] == [m["step"] for m in metrics(full)]


def test_torchrun_two_processes_match_one(demo_base, train_jsonl, tmp_path):
    args = ["medusa", "--base-model", demo_base, "--data", train_jsonl, *SMALL]
    single = tmp_path / "single"
    run_cli(*args, "--out", single)
    ddp = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "-m", "vllm_clover_training.cli", *map(str, args), "--out", str(ddp)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Two ranks with half the batch each, gradients averaged = one process with the whole batch.
    a, b = load_file(single / "model.safetensors"), load_file(ddp / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-4, rtol=1e-3)


def test_self_distill_trains_on_the_base_greedy_continuations(demo_base, tmp_path):
    """--self-distill generates with vLLM once, caches it, and the cached sequences are the
    base's own greedy continuations (checked against transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "prompts.jsonl"
    prompts = stdlib_corpus.heldout_prompts(24)
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    out = tmp_path / "clover"
    run_cli("clover", "--base-model", demo_base, "--data", data, "--out", out, "--self-distill",
            "--distill-prompt-tokens", "48", "--distill-new-tokens", "16", *SMALL)
    cache = json.loads((tmp_path / "clover.work" / "distilled.json").read_text())
    assert len(cache["sequences"]) == 24
    tok = AutoTokenizer.from_pretrained(demo_base)
    model = AutoModelForCausalLM.from_pretrained(demo_base, dtype=torch.float32).eval()
    prompt = tok(prompts[0]).input_ids[:48]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
    assert cache["sequences"][0] == expected
    assert checkpoint.load_heads(out, demo_base)[0]["vllm_clover"]["method"] == "clover"


DRAFT_VOCAB_PROMPTS, DRAFT_VOCAB_TOKENS = 16, 24


def serve_greedy(demo_base, spec):
    from vllm import SamplingParams

    from conftest import make_llm, shutdown
    from vllm_clover.spec_metrics import spec_decode_counters
    from vllm_clover_training.stdlib_corpus import heldout_prompts

    params = SamplingParams(temperature=0, max_tokens=DRAFT_VOCAB_TOKENS, ignore_eos=True)
    llm = make_llm(demo_base, speculative_config=spec, disable_log_stats=False)
    outputs = [list(o.outputs[0].token_ids)
               for o in llm.generate(heldout_prompts(DRAFT_VOCAB_PROMPTS), params, use_tqdm=False)]
    counters = spec_decode_counters(llm, 3)
    shutdown(llm)
    return outputs, counters


@pytest.fixture(scope="module")
def plain_outputs(demo_base):
    return serve_greedy(demo_base, None)[0]


@pytest.mark.parametrize("method", ["clover", "medusa"])  # our runner hook, and vLLM's own Medusa
def test_heads_with_a_draft_vocabulary_train_load_and_serve_exactly(method, demo_base, train_jsonl, tmp_path,
                                                                     plain_outputs):
    """The heads score 256 of the 4,096 tokens (their drafts are among those: test_draft_vocab.py);
    vLLM still verifies over all of them, so the output equals plain decoding."""
    out = tmp_path / method
    run_cli(method, "--base-model", demo_base, "--data", train_jsonl, "--out", out, "--draft-vocab-size", "256",
            *SMALL)
    config, tensors = checkpoint.load_heads(out, demo_base)
    vocab = tensors["token_map" if method == "medusa" else "draft_vocab"]
    assert vocab.shape == (256,) and len(set(vocab.tolist())) == 256
    outputs, counters = serve_greedy(demo_base, {"method": method, "model": str(out)})
    assert outputs == plain_outputs
    assert counters["draft_tokens"] > 0


def test_hidden_states_are_computed_once_and_shared_across_methods(demo_base, train_jsonl, tmp_path):
    from vllm_clover_training import data as data_mod
    from vllm_clover_training.base import load_base
    from vllm_clover_training.hidden_cache import hidden_state_cache

    cache = tmp_path / "hidden"
    run_cli("clover", "--base-model", demo_base, "--data", train_jsonl, "--out", tmp_path / "clover",
            "--hidden-cache", cache, "--epochs", "2", *SMALL)
    losses = [m["loss"] for m in metrics(tmp_path / "clover")]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    meta = json.loads((tmp_path / "hidden.json").read_text())
    assert meta["done"] == meta["key"]["shape"][0] > 0
    written = (tmp_path / "hidden.bin").stat().st_mtime_ns
    run_cli("clp", "--base-model", demo_base, "--data", train_jsonl, "--out", tmp_path / "clp",
            "--hidden-cache", cache, *SMALL)
    assert (tmp_path / "hidden.bin").stat().st_mtime_ns == written  # reused, not recomputed
    # What is stored is the base's own hidden states, to bf16 precision.
    base, tokenizer = load_base(demo_base, "float32")
    windows = data_mod.packed_files([train_jsonl], tokenizer, 64)
    stored = hidden_state_cache(base, checkpoint.base_fingerprint(demo_base), windows, cache, 4)
    torch.testing.assert_close(stored[:4].float(), base.hidden_states(windows.ids[:4]), rtol=2e-2, atol=2e-2)


def test_soft_targets_train(demo_base, train_jsonl, tmp_path):
    out = tmp_path / "clover"
    run_cli("clover", "--base-model", demo_base, "--data", train_jsonl, "--out", out, "--soft-targets",
            "--draft-vocab-size", "512", "--epochs", "2", "--compute-dtype", "bfloat16", "--augment-init", "identity",
            *SMALL)
    losses = [m["loss"] for m in metrics(out)]
    assert sum(losses[-5:]) / 5 < 0.95 * sum(losses[:5]) / 5, losses
