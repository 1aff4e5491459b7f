"""self-instruct: a chat model writes user turns itself (Magpie); only turns it ended, of a sane
length, seen once and free of evaluation prompts are kept, in files `distill` reads; a model
without a chat template gets one clear error and nothing is written."""

from __future__ import annotations

import json

import pytest

from vllm_clover_training import data as data_mod
from vllm_clover_training.cli import main
from vllm_clover_training.instructions import EVAL_FILES
from vllm_clover_training.self_instruct import MAX_CHARS, keep_turns, user_turn_prefix


def test_only_ended_new_clean_turns_of_a_sane_length_are_kept():
    seen = {"already asked?"}
    evaluation = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture."]
    samples = [
        ("  How do I bake bread at home?  ", True),
        ("how do I   bake bread at HOME?", True),      # the same turn, case and spacing aside
        ("Already   asked?", True),                     # seen in an earlier round
        ("Tell me about the history of Rome and", False),  # cut at the token limit
        ("Hi!", True),                                  # too short to be a request
        ("x" * (MAX_CHARS + 1), True),
        ("Please compose an engaging travel blog post about a recent trip to Hawaii!", True),  # an eval prompt's words
        ("Write a haiku about autumn rain.", True),
    ]
    kept, contaminated = keep_turns(samples, seen, evaluation)
    assert kept == ["How do I bake bread at home?", "Write a haiku about autumn rain."]
    assert contaminated == 1
    assert "write a haiku about autumn rain." in seen


@pytest.fixture
def shared_data(tmp_path):
    """Evaluation prompts to decontaminate against, as the shared Spec-Bench and MT-Bench files hold them."""
    folder = tmp_path / "shared-data"
    folder.mkdir()
    for name in EVAL_FILES:
        (folder / name).write_text(json.dumps({"turns": ["Compose an engaging travel blog post about Hawaii."]}) + "\n")
    return folder


def test_the_prefix_is_smollm2s_template_up_to_the_user_text(real_base):
    from transformers import AutoTokenizer

    prefix = user_turn_prefix(AutoTokenizer.from_pretrained(real_base))
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_end|>\n<|im_start|>user\n")


def test_a_model_without_a_chat_template_is_refused_before_anything_is_written(demo_base, tmp_path, shared_data):
    out = tmp_path / "chats"
    with pytest.raises(SystemExit, match="has no chat template: self-instruct needs a chat model"):
        main(["self-instruct", "--base-model", str(demo_base), "--out-dir", str(out), "--count", "4",
              "--validation", "1", "--shared-data", str(shared_data)])
    assert not out.exists()


def test_missing_evaluation_prompts_are_named(real_base, tmp_path):
    out = tmp_path / "chats"
    with pytest.raises(SystemExit, match=r"--shared-data .*: no spec_bench_questions.jsonl, mt_bench_questions.jsonl"):
        main(["self-instruct", "--base-model", str(real_base), "--out-dir", str(out), "--count", "4",
              "--validation", "1", "--shared-data", str(tmp_path / "nowhere")])
    assert not out.exists()


def test_validation_must_leave_training_turns(real_base, tmp_path):
    with pytest.raises(SystemExit, match=r"--validation must be in 0\.\.3 \(--count 4\), got 4"):
        main(["self-instruct", "--base-model", str(real_base), "--out-dir", str(tmp_path), "--count", "4",
              "--validation", "4"])
    assert not any(tmp_path.iterdir())


def test_smollm2_writes_turns_that_distill_reads(real_base, tmp_path, shared_data):
    main(["self-instruct", "--base-model", str(real_base), "--out-dir", str(tmp_path), "--count", "6",
          "--validation", "2", "--seed", "1", "--shared-data", str(shared_data)])
    report = json.loads((tmp_path / "chat-report.json").read_text())
    assert (report["train"], report["validation"], report["kept"]) == (4, 2, 6)
    assert report["sampled"] >= 6
    turns = []
    for split, size in (("train", 4), ("validation", 2)):
        path = tmp_path / f"chat-{split}.jsonl"
        records = [data_mod.parse_record(obj, where) for where, obj in data_mod.iter_records(path, None, None)]
        assert len(records) == size
        turns += [obj["messages"][0]["content"] for _, obj in data_mod.iter_records(path, None, None)]
    assert len({" ".join(t.lower().split()) for t in turns}) == 6
    assert all(t == t.strip() and len(t) >= 16 for t in turns)
