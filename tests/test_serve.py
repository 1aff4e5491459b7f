"""`vllm serve` with Clover, as a user runs it: the README's command as written (completions
and chat), the plugin loading by itself, the OpenAI API answering through the `openai`
client exactly as a plain server does, and vLLM's spec-decode metrics counting our drafts on
/metrics and in the log. A configuration error is one line from the CLI, no traceback."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from conftest import DEMO_HEADS, ENGINE_DEFAULTS, REPO, hub_cache
from vllm_clover_training.stdlib_corpus import heldout_prompts

STARTUP_SECONDS = 300
README_HEADS = "assets/demo-heads/clover"  # the heads directory of the README's serve command


def readme_serve_command() -> list[str]:
    """The CPU command of the README's "Serving with Clover or CLP", as a user pastes it."""
    section = (REPO / "README.md").read_text().split("## Serving with Clover or CLP", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return shlex.split(next(line for line in block.splitlines()
                            if line.startswith("python -m vllm_clover.vllm_cli serve")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `vllm serve` process on a free local port, its output in `log`."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict | None = None):
        self.port, self.log = port, log
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})}, cwd=REPO)

    @classmethod
    def from_readme(cls, base: Path | str, log: Path, speculator: bool = True, heads: str | None = None,
                    env: dict | None = None) -> "Server":
        """The README's command (run from the repository, as its relative paths expect) on
        `base`, without its --speculative-config for a plain server, or with `heads` for its
        heads directory; then this machine's settings (loopback, a free port, eager, the
        tests' KV cache)."""
        command = readme_serve_command()
        at = command.index("--speculative-config")
        if not speculator:
            del command[at: at + 2]
        elif heads is not None:
            command[at + 1] = command[at + 1].replace(README_HEADS, heads)
        command[0] = sys.executable
        command[command.index("serve") + 1] = str(base)
        port = free_port()
        command += ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--seed", "0",
                    "--max-model-len", str(ENGINE_DEFAULTS["max_model_len"]),
                    "--kv-cache-memory-bytes", str(ENGINE_DEFAULTS["kv_cache_memory_bytes"])]
        return cls(command, port, log, env={"VLLM_LOG_STATS_INTERVAL": "1", **(env or {})})

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
    plain = Server.from_readme(demo_base, logs / "plain.log", speculator=False)
    clover = Server.from_readme(demo_base, logs / "clover.log")
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


def test_the_readme_command_serves_the_bundled_clover_heads():
    command = readme_serve_command()
    assert command[:4] == ["python", "-m", "vllm_clover.vllm_cli", "serve"]
    assert f'"model": "{README_HEADS}"' in command[command.index("--speculative-config") + 1]


def test_heads_and_base_served_by_hub_id_offline(servers, demo_base, tmp_path):
    """The README's command with Hub ids for base and heads, from a Hub cache with
    HF_HUB_OFFLINE=1: the same answers as the plain server on the local directory."""
    plain, _ = servers
    hub_cache(tmp_path / "hub", {"vllm-clover/demo-base": demo_base, "vllm-clover/demo-clover": DEMO_HEADS / "clover"})
    by_id = Server.from_readme("vllm-clover/demo-base", tmp_path / "by-id.log", heads="vllm-clover/demo-clover",
                               env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    try:
        by_id.wait_ready()
        prompts = heldout_prompts(4)
        assert completions(by_id, prompts) == completions(plain, prompts)
        assert metric(by_id.metrics(), "vllm:spec_decode_num_drafts_total") > 0
    finally:
        by_id.stop()


def test_a_bad_heads_directory_is_one_line_from_the_cli(demo_base, tmp_path):
    heads = tmp_path / "clover"
    shutil.copytree(DEMO_HEADS / "clover", heads)
    weights = heads / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy that stopped half-way
    command = readme_serve_command()
    command[0] = sys.executable
    spec = command.index("--speculative-config") + 1
    command[spec] = command[spec].replace(README_HEADS, str(heads))
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=STARTUP_SECONDS)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"vllm-clover: {weights} is not a readable safetensors file: Error while deserializing header")
