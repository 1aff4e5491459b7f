"""Heads and bases given as Hugging Face Hub ids, offline: a Hub cache laid out on disk as
huggingface_hub writes it, HF_HUB_OFFLINE set, and the ids resolved to their snapshots by
the speculative-config checks, the training CLI and the benchmarks. (Serving from ids through
`vllm serve` is in test_serve.py.)"""

from __future__ import annotations

import json

import pytest
from huggingface_hub import constants

from benchmarks.run import parse_args
from conftest import DEMO_HEADS, REPO, hub_cache
from vllm_clover import checkpoint
from vllm_clover.errors import CheckpointError
from vllm_clover.spec_config import CARRIER, resolve
from vllm_clover_training.cli import main as train_cli

SMOLLM2_CLOVER = REPO / "assets" / "smollm2-heads" / "clover"


@pytest.fixture(scope="module")
def hub(demo_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    commits = hub_cache(root, {"vllm-clover/demo-base": demo_base, "vllm-clover/demo-clover": DEMO_HEADS / "clover",
                               "vllm-clover/smollm2-clover": SMOLLM2_CLOVER})
    return root, commits


@pytest.fixture
def offline(hub, monkeypatch):
    """HF_HUB_OFFLINE and HF_HUB_CACHE as huggingface_hub reads them at call time (as vLLM does)."""
    root, commits = hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root, commits


def snapshot(root, repo: str, commit: str):
    return root / f"models--{repo.replace('/', '--')}" / "snapshots" / commit


def test_heads_and_base_ids_resolve_to_their_snapshots(offline):
    root, commits = offline
    spec = {"method": "clover", "model": "vllm-clover/demo-clover", "num_speculative_tokens": 4}
    resolved, options = resolve(spec, "vllm-clover/demo-base")
    assert options is not None and options.method == "clover"
    # vLLM is handed the files that were checked, not the id to look up again.
    assert resolved == {**spec, "method": CARRIER,
                        "model": str(snapshot(root, "vllm-clover/demo-clover", commits["vllm-clover/demo-clover"]))}


def test_a_pinned_revision_resolves_and_an_unknown_one_is_named(offline):
    _, commits = offline
    commit = commits["vllm-clover/demo-clover"]
    resolved, _ = resolve({"method": "clover", "model": "vllm-clover/demo-clover", "revision": commit},
                          "vllm-clover/demo-base")
    assert resolved["model"].endswith(commit)
    with pytest.raises(CheckpointError, match=r"heads 'vllm-clover/demo-clover' .* revision v9"):
        resolve({"method": "clover", "model": "vllm-clover/demo-clover", "revision": "v9"}, "vllm-clover/demo-base")


def test_a_missing_id_is_one_error_naming_it(offline):
    with pytest.raises(CheckpointError) as error:
        resolve({"method": "clover", "model": "vllm-clover/no-such-heads"}, "vllm-clover/demo-base")
    message = str(error.value)
    assert message.startswith("heads 'vllm-clover/no-such-heads' is not a local directory")
    assert "HF_HUB_OFFLINE is set" in message


def test_heads_from_the_hub_are_checked_against_a_base_from_the_hub(offline):
    with pytest.raises(CheckpointError, match="trained for another base model"):
        resolve({"method": "clover", "model": "vllm-clover/smollm2-clover"}, "vllm-clover/demo-base")


def test_our_heads_by_id_are_recognised_without_a_method_and_others_are_left_alone(offline):
    resolved, options = resolve({"model": "vllm-clover/demo-clover"}, "vllm-clover/demo-base")
    assert options is not None and options.method == "clover" and resolved["method"] == CARRIER
    # Not ours, or not resolvable: vLLM gets the spec untouched and reports its own errors.
    for spec in ({"method": "eagle", "model": "someone/eagle-heads", "num_speculative_tokens": 2},
                 {"model": "someone/medusa-heads"}):
        assert resolve(spec, "vllm-clover/demo-base") == (spec, None)


def test_training_and_eval_take_hub_ids(offline, tmp_path):
    root, commits = offline
    data = tmp_path / "train.json"  # a JSON array, ShareGPT's layout
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Sort a list of numbers."},
                                                   {"from": "gpt", "value": "def sort(xs):\n    return sorted(xs)\n"
                                                                            * 8}]}] * 8))
    out = tmp_path / "clover"
    train_cli(["clover", "--base-model", "vllm-clover/demo-base", "--data", str(data), "--out", str(out),
               "--num-heads", "2", "--max-len", "64", "--batch-size", "2"])
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["args"]["base_model"] == "vllm-clover/demo-base"
    assert provenance["base_commit"] == commits["vllm-clover/demo-base"]
    card = (out / "README.md").read_text()
    assert card.startswith('---\nbase_model: "vllm-clover/demo-base"\n')
    assert f'"base_commit": "{commits["vllm-clover/demo-base"]}"' in card
    assert "vllm serve vllm-clover/demo-base --speculative-config" in card
    checkpoint.load_heads(out, snapshot(root, "vllm-clover/demo-base", commits["vllm-clover/demo-base"]))

    hub_cache(root, {"vllm-clover/new-clover": out})
    result = train_cli_eval(tmp_path, data, "vllm-clover/new-clover")
    assert result["heads"] == "vllm-clover/new-clover" and result["num_heads"] == 2


def train_cli_eval(tmp_path, data, heads: str) -> dict:
    out = tmp_path / "eval.json"
    train_cli(["eval", "--heads", heads, "--base-model", "vllm-clover/demo-base", "--data", str(data),
               "--out", str(out), "--max-len", "64"])
    return json.loads(out.read_text())


def test_training_from_a_missing_id_stops_before_writing(offline, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "x = 1\n" * 50}) + "\n")
    out = tmp_path / "clover"
    with pytest.raises(SystemExit, match="base model 'vllm-clover/no-such-base' is not a local directory"):
        train_cli(["clover", "--base-model", "vllm-clover/no-such-base", "--data", str(data), "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]


def test_benchmarks_take_a_base_id_and_heads_ids(offline):
    root, commits = offline
    args = parse_args(["--base-model", "vllm-clover/demo-base", "--heads", "clover=vllm-clover/demo-clover",
                       "--out", "unused.json"])
    assert args.base_model == snapshot(root, "vllm-clover/demo-base", commits["vllm-clover/demo-base"])
    assert dict(args.heads) == {"clover": "vllm-clover/demo-clover"}
    with pytest.raises(SystemExit):
        parse_args(["--heads", "cloverr=x", "--out", "unused.json"])
