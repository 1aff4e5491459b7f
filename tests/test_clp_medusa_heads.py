"""CLP and Medusa heads: shapes, the collocation-length target, the tau rule, vLLM's names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_clover.clp import ClpHeads, collocation_lengths, conditional_lengths, lengths_at_threshold
from vllm_clover.layers import head_labels
from vllm_clover.medusa import MedusaHeads

H, V, T, B, K = 32, 50, 10, 2, 3


def test_clp_and_medusa_shapes_follow_the_shift():
    h, ids, lm_head = torch.randn(B, T, H), torch.randint(0, V, (B, T)), torch.randn(V, H)
    clp_out, length_logits = ClpHeads(K, H)(h, ids, lm_head)
    assert length_logits.shape == (B, T, K + 1)
    medusa_out, no_length = MedusaHeads(K, H, V)(h, ids, lm_head)
    assert no_length is None
    for i in range(1, K + 1):
        assert clp_out[i - 1].shape == (B, T - 1 - i, V)
        assert medusa_out[i - 1].shape == (B, T - 1 - i, V)
        assert head_labels(ids, i).shape == (B, T - 1 - i)
    assert torch.equal(head_labels(ids, 2)[:, 0], ids[:, 3])  # head 2 at t=0 predicts x_3


def test_collocation_length_counts_leading_correct_heads():
    ids = torch.arange(T)[None]  # x_t = t
    # Head i at t must predict x_{t+1+i} = t+1+i. Heads 1 and 3 are always right, head 2
    # only at t=0: L* = 3 at t=0, and 1 elsewhere (head 3 counts only after heads 1 and 2).
    def logits_predicting(tokens):
        return torch.nn.functional.one_hot(tokens, V).float()
    n = T - 1 - K
    heads = []
    for i in range(1, K + 1):
        tokens = torch.arange(T - 1 - i)[None] + 1 + i
        if i == 2:
            tokens = tokens.clone()
            tokens[:, 1:] = 0
        heads.append(logits_predicting(tokens))
    lengths = collocation_lengths(heads, ids)
    assert lengths.shape == (1, n)
    assert lengths[0].tolist() == [3] + [1] * (n - 1)


def test_tau_rule_takes_longest_length_with_enough_probability():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4],    # P(L*>=l) = 1, .9, .7, .4
                          [0.7, 0.1, 0.1, 0.1]])   # 1, .3, .2, .1
    assert lengths_at_threshold(probs, 0.5).tolist() == [2, 0]
    assert lengths_at_threshold(probs, 0.3).tolist() == [3, 1]
    assert lengths_at_threshold(probs, 1.0).tolist() == [0, 0]
    assert lengths_at_threshold(probs, 0.0).tolist() == [3, 3]


def test_conditional_lengths_are_ratios_of_tail_probabilities():
    """What the goodput policy reads as CLP's confidence: P(L* >= j | L* >= j-1), from logits
    in any scale; a length far beyond reach gives 0, not NaN."""
    probs = np.array([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]])  # P(L*>=l) = 1, .9, .7, .4 / 1, .3, .2, .1
    expected = [[0.9, 0.7 / 0.9, 0.4 / 0.7], [0.3, 0.2 / 0.3, 0.1 / 0.2]]
    np.testing.assert_allclose(conditional_lengths(np.log(probs) + 50.0), expected, rtol=1e-6)
    assert conditional_lengths(np.array([[0.0, 0.0, -1e4, -1e4]])).tolist() == [[0.5, 0.0, 0.0]]


def test_medusa_state_dict_uses_vllm_names():
    medusa = MedusaHeads(K, H, V)
    names = set(medusa.checkpoint_tensors())
    expected = {f"blocks.{i}.layers.0.{p}" for i in range(K) for p in ("weight", "bias")}
    expected |= {f"lm_heads.{i}.weight" for i in range(K)}
    assert names == expected
    assert medusa.vllm_config() == {"medusa_fc_bias": True}


def logits_of(heads, base, h_base: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    from vllm_clover.methods import HeadOutputs

    return HeadOutputs(*heads(h_base, ids, base.lm_head_weight, base.embed_weight)).logits


def test_save_load_round_trip_reproduces_every_method(demo_base, tmp_path):
    """What the trainer writes, the loader rebuilds into a module with identical outputs."""
    from vllm_clover import checkpoint
    from vllm_clover.methods import TABLE
    from vllm_clover_training.base import load_base

    base, _ = load_base(demo_base, "float32")
    ids = torch.randint(0, base.config.vocab_size, (2, 24))
    h_base = base.hidden_states(ids)
    for method in TABLE:
        torch.manual_seed(0)
        hyper = {"tau": 0.3} if method.length_predictor else {}
        heads = method.heads.from_base(base, 3, hyper)
        for p in heads.parameters():  # move off the (partly zero) init so the check means something
            p.data.add_(0.01 * torch.randn_like(p))
        out = tmp_path / method.name
        checkpoint.save_heads(out, method, heads, demo_base, {})
        config, tensors = checkpoint.load_heads(out, demo_base)
        loaded = checkpoint.build_heads_module(out, config, tensors)
        before, after = (logits_of(module.eval(), base, h_base, ids) for module in (heads, loaded))
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a, b), method.name
        if method.length_predictor:
            assert loaded.tau == 0.3
        # Shipped in bf16: half the bytes, the same heads to bf16 precision.
        checkpoint.save_heads(tmp_path / "bf16", method, heads, demo_base, {}, dtype=torch.bfloat16)
        config, tensors = checkpoint.load_heads(tmp_path / "bf16", demo_base)
        assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.bfloat16}
        half = checkpoint.build_heads_module(tmp_path / "bf16", config, tensors)
        for a, b in zip(before, logits_of(half.eval(), base, h_base, ids), strict=True):
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def test_missing_or_misshaped_tensor_is_named(demo_base, tmp_path):
    from safetensors.torch import load_file, save_file

    from vllm_clover import checkpoint
    from vllm_clover.methods import BY_NAME

    medusa = MedusaHeads(2, 256, 4096)
    out = tmp_path / "m"
    checkpoint.save_heads(out, BY_NAME["medusa"], medusa, demo_base, {})
    tensors = load_file(out / "model.safetensors")
    del tensors["blocks.1.layers.0.bias"]
    save_file(tensors, out / "model.safetensors")
    config, loaded = checkpoint.load_heads(out, demo_base)
    with pytest.raises(checkpoint.CheckpointError, match=r"tensor 'blocks.1.layers.0.bias' missing"):
        checkpoint.build_heads_module(out, config, loaded)
    tensors["blocks.1.layers.0.bias"] = torch.zeros(3)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match=r"has shape \(3,\), expected \(256,\)"):
        checkpoint.build_heads_module(out, *checkpoint.load_heads(out, demo_base))
