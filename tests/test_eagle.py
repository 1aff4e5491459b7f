"""The EAGLE-1 draft module (vllm_clover/eagle.py), engine-free: its unrolled evaluation is
what serving computes, its checkpoint has vLLM's names, and training sees the first draft
only. tests/test_lossless.py serves a trained draft with vLLM's own EAGLE proposer."""

from __future__ import annotations

import torch

from vllm_clover.eagle import EagleConfig, EagleDraft

H, V, K = 16, 11, 3


def small_draft() -> EagleDraft:
    torch.manual_seed(0)
    draft = EagleDraft(EagleConfig(num_heads=K, hidden_size=H, vocab_size=V, intermediate_size=24,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                                   rope_theta=10000.0, max_position_embeddings=64))
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return draft


def test_unrolled_drafts_equal_drafting_step_by_step_from_each_position():
    """Draft j from position t, as vLLM runs it: one causal layer over the first pass's inputs
    up to t, then the inputs of drafts 2..j at the next positions (each the previous
    draft's feature and the teacher-forced token)."""
    draft = small_draft().eval()
    T = 9
    ids, h_base = torch.randint(0, V, (1, T)), torch.randn(1, T, H)
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    with torch.no_grad():
        logits, length_logits, regression = draft(h_base, ids, lm_head, embed)
        assert length_logits is None and regression.shape == (1, T - 2)
        assert [lg.shape[1] for lg in logits] == [T - 2, T - 3, T - 4]
        layer = draft.layers[0]
        first = draft.fc(torch.cat([embed[ids[:, 1:]], h_base[:, :-1]], -1))   # inputs at positions 0..T-2
        for t in range(T - 2):
            inputs = first[:, : t + 1]
            f = layer(inputs, torch.arange(t + 1)[None])[:, -1]
            assert torch.allclose(f @ lm_head.T, logits[0][:, t], atol=1e-5)
            for j in range(2, K + 1):
                if t > T - 2 - j:
                    break
                inputs = torch.cat([inputs, draft.fc(torch.cat([embed[ids[:, t + j]], f], -1))[:, None]], 1)
                f = layer(inputs, torch.arange(inputs.shape[1])[None])[:, -1]
                assert torch.allclose(f @ lm_head.T, logits[j - 1][:, t], atol=1e-5), (t, j)


def test_training_sees_the_first_draft_only_with_noise():
    draft = small_draft().train()
    ids, h_base = torch.randint(0, V, (2, 8)), torch.randn(2, 8, H)
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    logits, _, regression = draft(h_base, ids, lm_head, embed)
    again, _, _ = draft(h_base, ids, lm_head, embed)
    assert len(logits) == 1 and not torch.equal(logits[0], again[0])  # noisy features
    regression.sum().backward()
    assert draft.fc.weight.grad is not None


def test_checkpoint_holds_exactly_what_vllm_eagle_loads():
    draft = small_draft()
    names = set(draft.checkpoint_tensors())
    layer = {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | \
        {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert names == {"fc.weight", "layers.0.post_attention_layernorm.weight"} | layer
    assert draft.checkpoint_tensors()["fc.weight"].shape == (H, 2 * H)
    config = draft.vllm_config()
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert "bias" not in config and "num_heads" not in config
    restored = EagleDraft.from_checkpoint({"vllm_clover": {"hyper": draft.checkpoint_hyper()}})
    restored.load_checkpoint_tensors(draft.checkpoint_tensors())
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), draft.state_dict().values()))
