"""The held-out split is fixed by module name and is about 10% of the corpus."""

from __future__ import annotations

from vllm_clover_training import stdlib_corpus
from vllm_clover_training.stdlib_corpus import HELDOUT_MODULES, heldout_prompts, split_sources


def test_split_is_disjoint_and_about_ten_percent():
    train, heldout = split_sources()
    assert {f.path for f in train}.isdisjoint(f.path for f in heldout)
    assert {f.module for f in heldout} == set(HELDOUT_MODULES)
    size = lambda files: sum(f.path.stat().st_size for f in files)  # noqa: E731
    share = size(heldout) / (size(train) + size(heldout))
    assert 0.08 < share < 0.14, share


def test_tests_and_data_folders_are_excluded():
    for f in stdlib_corpus.list_sources():
        rel = f.path.relative_to(stdlib_corpus.stdlib_root())
        assert not set(rel.parts[:-1]) & stdlib_corpus.EXCLUDED_DIRS, rel


def test_heldout_prompts_end_at_a_definition_and_are_stable():
    prompts = heldout_prompts(50)
    assert prompts == heldout_prompts(50)
    assert len(set(prompts)) == 50
    for p in prompts:
        last = p.rstrip("\n").splitlines()[-1].lstrip()
        assert last.startswith(("def ", "class ")) and last.endswith(":"), last
