"""A reduced draft vocabulary (FR-Spec, EAGLE-3's d2t) and the answer-only loss, without an
engine: labels, the draft chain's token ids, checkpoints, and packing with loss masks."""

from __future__ import annotations

import torch

from vllm_clover.clover import CloverConfig, CloverHeads
from vllm_clover.clp import ClpHeads
from vllm_clover.layers import IGNORE, DenseLmHead, DraftVocabHead, draft_vocab_labels, most_frequent_tokens
from vllm_clover_training.data import Tokens, pack

H, V = 32, 50


def test_most_frequent_tokens_by_count_then_id():
    ids = torch.tensor([7, 7, 7, 3, 3, 9, 9, 1])
    assert most_frequent_tokens(ids, 3, V).tolist() == [7, 3, 9]


def test_labels_index_the_draft_vocabulary_and_ignore_the_rest():
    draft_vocab = torch.tensor([7, 3, 9])
    labels = draft_vocab_labels(torch.tensor([[3, 4, 9, 7]]), draft_vocab, V)
    assert labels.tolist() == [[1, IGNORE, 2, 0]]
    assert draft_vocab_labels(torch.tensor([4]), None, V).tolist() == [4]


def test_a_draft_vocabulary_head_drafts_the_best_token_among_its_own():
    torch.manual_seed(0)
    weight = torch.randn(V, H)
    full = DenseLmHead(weight)
    draft_vocab = torch.tensor([5, 11, 42, 17])
    reduced = DraftVocabHead(full, draft_vocab)
    hidden = torch.randn(6, H)
    expected = draft_vocab[(hidden @ weight[draft_vocab].T).argmax(-1)]
    assert torch.equal(reduced.greedy(hidden), expected)
    assert set(reduced.greedy(hidden).tolist()) <= set(draft_vocab.tolist())
    assert torch.equal(reduced.rows(torch.tensor([2])), full.rows(torch.tensor([2])))  # any token's row


def test_clover_and_clp_heads_carry_their_draft_vocabulary_through_a_checkpoint():
    torch.manual_seed(0)
    draft_vocab = torch.tensor([4, 8, 15, 16, 23, 42])
    clover = CloverHeads(CloverConfig(num_heads=2, hidden_size=H, vocab_size=V, intermediate_size=64,
                                      num_attention_heads=1, num_key_value_heads=1, head_dim=32, decoder_heads=4,
                                      draft_vocab_size=len(draft_vocab)))
    clover.set_draft_vocab(draft_vocab)
    clp = ClpHeads(2, H, draft_vocab_size=len(draft_vocab))
    clp.set_draft_vocab(draft_vocab)
    lm_head = torch.randn(V, H)
    h, ids = torch.randn(1, 9, H), torch.randint(0, V, (1, 9))
    for heads in (clover, clp):
        logits, _ = heads(h, ids, lm_head)
        assert logits[0].shape[-1] == len(draft_vocab)
        config = {"hidden_size": H, "vocab_size": V, "num_heads": 2,
                  "vllm_clover": {"hyper": heads.checkpoint_hyper()}}
        loaded = type(heads).from_checkpoint(config)
        loaded.load_checkpoint_tensors(heads.checkpoint_tensors())
        assert torch.equal(loaded.draft_vocab, draft_vocab)
        drafts = loaded.propose(h[0, -1:], ids[0, -1:], loaded.output_head(DenseLmHead(lm_head)), [2])
        assert set(drafts[0]) <= set(draft_vocab.tolist())


def test_packing_keeps_each_tokens_loss_mask():
    text = Tokens([1, 2, 3], [1, 1, 1])
    chat = Tokens([4, 5, 6, 7], [0, 0, 1, 0])
    windows = pack([text, chat], max_len=4, eos_id=0)
    assert windows.ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    # After a text its EOS is learned; after a chat the answer's own end token was.
    assert windows.loss_mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 0]]
    assert windows[1:].ids.tolist() == [[4, 5, 6, 7]]


def test_soft_cross_entropy_is_cross_entropy_for_a_certain_teacher():
    import torch.nn.functional as F

    from vllm_clover_training.objective import soft_cross_entropy

    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, V), torch.randint(0, V, (2, 5))
    certain = F.one_hot(labels, V).float() * 1e4  # softmax = one-hot
    keep = torch.ones(2, 5, dtype=torch.bool)
    torch.testing.assert_close(soft_cross_entropy(logits, certain, keep), F.cross_entropy(logits.flatten(0, 1),
                                                                                            labels.flatten()))
    keep[1] = False  # masked positions do not count
    torch.testing.assert_close(soft_cross_entropy(logits, certain, keep), F.cross_entropy(logits[0], labels[0]))


def test_parameters_read_per_step_on_smollm2_shapes():
    """SmolLM2-135M (hidden 576, vocabulary 49,152, 134.5M parameters), K = 4: with the full
    vocabulary each drafter reads ~0.9x the target's parameters a step, with 8k ~0.2x."""
    from vllm_clover.medusa import MedusaHeads

    target, hidden, vocab = 134_515_008, 576, 49152
    with torch.device("meta"):
        def clover(n):
            return CloverHeads(CloverConfig(num_heads=4, hidden_size=hidden, vocab_size=vocab, intermediate_size=1536,
                                            num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                            draft_vocab_size=n))
        full, reduced = clover(None), clover(8192)
        clp, medusa = ClpHeads(4, hidden, draft_vocab_size=8192), MedusaHeads(4, hidden, vocab, 8192)
    assert 0.85 < full.parameters_read_per_step(hidden, vocab) / target < 0.95
    assert 0.18 < reduced.parameters_read_per_step(hidden, vocab) / target < 0.23
    mlps = sum(p.numel() for p in clp.parameters())
    assert clp.parameters_read_per_step(hidden, vocab) == mlps + 4 * 8192 * hidden
    assert medusa.parameters_read_per_step(hidden, vocab) == clp.parameters_read_per_step(hidden, vocab) - (
        clp.length.weight.numel() + clp.length.bias.numel())


def test_a_draft_vocabulary_can_be_scored_by_another_kernel():
    """Serving hands DraftVocabHead a scorer over its rows (vllm_models.cpu_draft_vocab_scorer:
    vLLM's prepacked oneDNN GEMM, bf16 for fp32 targets); here a bf16 matmul."""
    torch.manual_seed(0)
    lm_head, vocab = torch.randn(V, H), torch.tensor([3, 5, 7, 11])

    def bf16_scorer(rows):
        packed = rows.to(torch.bfloat16)
        return lambda hidden: hidden.to(torch.bfloat16) @ packed.T

    exact, half = DraftVocabHead(DenseLmHead(lm_head), vocab), DraftVocabHead(DenseLmHead(lm_head), vocab, bf16_scorer)
    hidden = 4 * lm_head[vocab]  # each row scores its own token far above the others
    assert half.logits(hidden).dtype == torch.bfloat16 and exact.logits(hidden).dtype == torch.float32
    assert torch.equal(half.greedy(hidden), vocab) and torch.equal(exact.greedy(hidden), vocab)
    assert torch.equal(half.rows(vocab), lm_head[vocab])  # regressive inputs stay exact
