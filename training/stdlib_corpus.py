"""The demo corpus: the running interpreter's standard library, split by module name.

Every later measurement (head accuracy, acceptance length, speed) is reported on the
held-out modules, so the split is fixed by name here and nowhere else: never random,
never re-drawn per run.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

# About 10% of the corpus by bytes (checked by tests/test_corpus.py), chosen to span
# parsers, networking, data structures and text processing. Top-level names: a package
# is held out with all its submodules.
HELDOUT_MODULES: tuple[str, ...] = (
    "argparse",
    "configparser",
    "difflib",
    "email",
    "http",
    "ipaddress",
    "json",
    "smtplib",
    "statistics",
    "wsgiref",
)

# Test suites are excluded as the issue asks (test/ and every nested tests folder), and so
# are two folders that are data written as Python: codec tables (encodings/) and the
# 750 KB pydoc topics string (pydoc_data/). They would teach the model tables, not code.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data"})


@dataclass(frozen=True)
class SourceFile:
    path: Path
    module: str  # top-level module or package name, e.g. "email" for email/parser.py

    @property
    def heldout(self) -> bool:
        return self.module in HELDOUT_MODULES


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[SourceFile]:
    """All corpus files under `root` (default: this interpreter's stdlib), sorted by path."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        module = rel.parts[0].removesuffix(".py")
        files.append(SourceFile(path=path, module=module))
    return files


def read_source(f: SourceFile) -> str:
    # A few stdlib files carry Latin-1 bytes in comments; replacing them keeps the corpus text.
    return f.path.read_text(encoding="utf-8", errors="replace")


def split_sources(root: Path | None = None) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout) file lists."""
    files = list_sources(root)
    return [f for f in files if not f.heldout], [f for f in files if f.heldout]


def definition_prompts(files: list[SourceFile], context_lines: int = 30) -> list[str]:
    """Prompts from `files`, each ending just after a `def`/`class` line.

    A prompt is up to `context_lines` lines of source ending with a function or class
    header, so the continuation a model writes is that body. Deterministic: files in
    path order, boundaries in line order, taken round-robin across files so the first
    prompts cover every module before any module repeats.
    """
    per_file = []
    for f in files:
        lines = read_source(f).splitlines(keepends=True)
        ends = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))
                and line.rstrip().endswith(":")]
        # No trailing newline: BPE merges it with the next line's indentation (see demo_base.py).
        per_file.append(["".join(lines[max(0, i + 1 - context_lines) : i + 1]).rstrip("\n") for i in ends])
    prompts: list[str] = []
    for depth in range(max(map(len, per_file), default=0)):
        prompts += [p[depth] for p in per_file if depth < len(p)]
    return prompts


def heldout_prompts(n: int, context_lines: int = 30) -> list[str]:
    """The first `n` definition prompts of the held-out modules: code the base never saw."""
    prompts = definition_prompts(split_sources()[1], context_lines)
    if len(prompts) < n:
        raise ValueError(f"the held-out modules have {len(prompts)} def/class boundaries, {n} asked for")
    return prompts[:n]


def main(argv: list[str] | None = None) -> None:
    """Write definition prompts of one split as JSONL {"text": ...} (training data input)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--split", choices=["train", "heldout"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-prompts", type=int, help="default: all")
    args = parser.parse_args(argv)
    files = split_sources()[0 if args.split == "train" else 1]
    prompts = definition_prompts(files)[: args.num_prompts]
    args.out.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts from the {args.split} split -> {args.out}")


if __name__ == "__main__":
    main()
