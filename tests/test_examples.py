"""Every file in examples/ runs as a user would run it, with small arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from test_serve import Server, free_port

EXAMPLES = REPO / "examples"
LOSSLESS = ("vanilla", "ngram", "medusa", "clover", "clp")


def run(*command: str, timeout: int = 900) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # the venv's tools
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_offline_generation():
    out = run(sys.executable, str(EXAMPLES / "offline_generate.py"), "--num-prompts", "4", "--max-tokens", "24")
    assert "clover: 4 outputs, mean acceptance length" in out


def test_serve_and_query(tmp_path):
    port = free_port()
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    server = Server([str(EXAMPLES / "serve_clover.sh"), str(port)], port, tmp_path / "serve.log", env=env)
    try:
        server.wait_ready()
        out = run(sys.executable, str(EXAMPLES / "query_server.py"), "--port", str(port))
    finally:
        server.stop()
    assert "completion:" in out and "chat:" in out
    drafts = int(next(line for line in out.splitlines() if line.startswith("num_drafts:")).split()[1])
    assert drafts > 0


def test_train_clover_heads(tmp_path):
    data, heads = tmp_path / "train.jsonl", tmp_path / "clover"
    run(str(EXAMPLES / "train_clover_heads.sh"), str(data), str(heads), "24")
    config = json.loads((heads / "config.json").read_text())
    assert config["architectures"] == ["CloverDraftModel"] and config["n_predict"] == 4
    assert len(json.loads((heads / "eval.json").read_text())["per_head"]) == 4


def test_compare_methods_writes_complete_results(tmp_path):
    run(str(EXAMPLES / "compare_methods.sh"), str(tmp_path), "3", "16", "1,2", "--enforce-eager")
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["failed"] == {} and report["versions"]["vllm"].startswith("0.32")
    assert set(report["results"]) == set(LOSSLESS)
    for method in LOSSLESS:
        for batch in ("1", "2"):
            result = report["results"][method][batch]
            assert result["output_tokens"] == 3 * 16 and result["output_tokens_per_s"] > 0
            assert result["mismatches"] == [0, 0, 0], (method, batch)
            if method != "vanilla":
                assert 0 < result["draft_time_fraction"] < 1
                assert len(result["acceptance_rate_per_position"]) == 4
    for png in ("throughput.png", "speedup.png", "acceptance.png", "ablation.png"):
        assert (tmp_path / png).stat().st_size > 10_000
