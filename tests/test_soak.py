"""A one-minute soak (benchmarks.soak): `vllm serve` with Clover and a plain server under the
mixed load, each request sent to both. Every check of the long run, none of its length: the
README's committed run (>= 20 minutes) is the one that shows memory over time."""

from __future__ import annotations

import json

import pytest

from benchmarks import soak
from conftest import DEMO_HEADS


@pytest.fixture(scope="module")
def record(demo_base, tmp_path_factory):
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    spec = {"method": "clover", "model": str(DEMO_HEADS / "clover"), "num_speculative_tokens": 4}
    soak.main(["--minutes", "1", "--clients", "16", "--rate", "3", "--enforce-eager", "--kv-cache-mb", "256",
               "--base-model", str(demo_base), "--spec", json.dumps(spec), "--out", str(out)])
    return json.loads(out.read_text())


def test_every_kind_of_request_was_sent(record):
    assert set(record["by_kind"]) == set(soak.KINDS)


def test_greedy_answers_equal_the_plain_servers(record):
    assert record["checks"]["greedy_checks"] > 20
    assert record["checks"]["mismatches"] == 0, record["checks"]["mismatches_first"]
    assert record["checks"]["structured_violations"] == {"plain": 0, "speculative": 0}


@pytest.mark.parametrize("server", ["plain", "speculative"])
def test_every_request_ends_as_its_kind_should(record, server):
    found = record["servers"][server]
    assert found["unexpected"] == 0, found["unexpected_first"]
    assert found["by_kind"]["over_context"] == {"refused": record["by_kind"]["over_context"]}
    # vLLM refuses min_p and logit_bias with speculative decoding only.
    refused_params = "refused" if server == "speculative" else "ok"
    assert found["by_kind"]["refused_params"] == {refused_params: record["by_kind"]["refused_params"]}
    # A stream that ends before the client meant to leave it is simply complete.
    assert set(found["by_kind"]["disconnect"]) <= {"disconnected", "ok"}
    assert found["by_kind"]["disconnect"].get("disconnected", 0) > 0


@pytest.mark.parametrize("server", ["plain", "speculative"])
def test_the_server_stayed_healthy_and_stopped_cleanly(record, server):
    found = record["servers"][server]
    assert found["log_errors"]["unexplained"] == 0, found["log_errors"]["unexplained_first"]
    assert found["health_failures"] == 0
    assert found["after_load"] == {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
    assert found["shutdown"]["clean"]


def test_the_speculative_server_drafted_and_the_counters_show_it(record):
    drafted = record["servers"]["speculative"]["spec_decode"]
    assert drafted["draft_tokens"] > 0 and drafted["accepted_tokens"] > 0
    assert record["servers"]["plain"]["spec_decode"] is None
