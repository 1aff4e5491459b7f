"""The code's seams: lint clean, no import circles, and the method table reaching every place
that depends on a method (no engine; the engine tests parametrize over the same table)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from benchmarks.run import BENCHMARK_METHODS, HEADS_METHODS
from conftest import REPO, SERVED_LOSSLESS
from vllm_clover.methods import TABLE
from vllm_clover_training.cli import build_parser

# Where each of our import names lives in the repository.
PACKAGES = {"vllm_clover": REPO / "vllm_clover", "vllm_clover_training": REPO / "training"}


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    done = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def module_names() -> dict[str, Path]:
    names = {}
    for package, folder in PACKAGES.items():
        for path in folder.glob("*.py"):
            names[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return names


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Our modules that `path` imports anywhere, inside functions too. `from pkg import mod`
    counts as importing pkg.mod when that is a module, else as importing pkg."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
            found |= submodules or {node.module}
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}  # "open" while on the DFS stack, then "done"

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, [*stack, nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_circles_in_the_packages():
    names = module_names()
    graph = {name: imports_of(path, set(names)) - {name} for name, path in names.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_table_entry_is_trained_served_and_benchmarked():
    commands = build_parser()._subparsers._group_actions[0].choices
    for method in TABLE:
        assert method.name in commands                     # vllm-clover-train METHOD
        served = [name for name in BENCHMARK_METHODS if HEADS_METHODS.get(name, (None,))[0] is method]
        assert served, method.name                          # benchmarks.run --methods ...
        assert set(served) & set(SERVED_LOSSLESS), method.name  # tests/test_lossless.py serves it


def test_every_architecture_of_ours_is_registered_with_vllm():
    from vllm import ModelRegistry

    import vllm_clover

    vllm_clover.register()
    for method in TABLE:
        assert method.architecture in ModelRegistry.get_supported_archs(), method.name
