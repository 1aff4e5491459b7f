"""Clover's heads in plain PyTorch: shapes, the target shift, and the initialisation."""

from __future__ import annotations

import pytest
import torch

from vllm_clover.clover import CloverConfig, CloverHeads, token_embeddings
from vllm_clover.layers import DenseLmHead

H, V, T, B, K = 64, 97, 12, 3, 4


def small_config(**overrides) -> CloverConfig:
    args = dict(num_heads=K, hidden_size=H, vocab_size=V, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, decoder_heads=4)
    return CloverConfig(**{**args, **overrides})


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    return torch.randn(B, T, H), torch.randint(0, V, (B, T)), torch.randn(V, H)


def test_head_outputs_shrink_by_one_row_per_head(inputs):
    h_base, ids, lm_head = inputs
    heads = CloverHeads(small_config())
    hidden = heads.head_hidden_states(h_base, ids, lm_head)
    assert [tuple(o.shape) for o in hidden] == [(B, T - 1 - i, H) for i in range(1, K + 1)]
    logits, length_logits = heads(h_base, ids, lm_head)
    assert [tuple(o.shape) for o in logits] == [(B, T - 1 - i, V) for i in range(1, K + 1)]
    assert length_logits is None


def test_head_i_at_position_t_sees_exactly_tokens_t_plus_1_to_t_plus_i(inputs):
    """With the base's hidden states fixed, head i at position t reads tokens x_{t+1}..x_{t+i}
    through the regressive connection, and never x_{t+1+i}, the token it must predict."""
    h_base, ids, lm_head = inputs
    torch.manual_seed(1)
    heads = CloverHeads(small_config())
    heads.decoder.v_proj.weight.data.normal_(0, 0.1)  # so the regressive inputs matter
    base_out = heads.head_hidden_states(h_base, ids, lm_head)
    s = 7
    changed = ids.clone()
    changed[:, s] = (changed[:, s] + 1) % V
    new_out = heads.head_hidden_states(h_base, changed, lm_head)
    for i, (a, b) in enumerate(zip(base_out, new_out), start=1):
        differs = (a - b).abs().amax(dim=(0, 2)) > 1e-6   # per position t
        expected = torch.tensor([t + 1 <= s <= t + i for t in range(a.shape[1])])
        assert torch.equal(differs, expected), (i, differs)


def test_fresh_attention_decoder_returns_its_input():
    torch.manual_seed(0)
    heads = CloverHeads(small_config())
    h, e = torch.randn(5, H), torch.randn(5, H)
    assert torch.equal(heads.decoder(h, e), h)


def test_query_and_key_receive_gradient():
    torch.manual_seed(0)
    heads = CloverHeads(small_config())
    dec = heads.decoder
    h, e = torch.randn(5, H), torch.randn(5, H)
    # From the V = 0 init the first step trains V only; from then on Q and K learn too.
    dec(h, e).pow(2).sum().backward()
    assert dec.v_proj.weight.grad.abs().sum() > 0
    assert dec.q_proj.weight.grad.abs().sum() == 0
    with torch.no_grad():
        dec.v_proj.weight -= 0.1 * dec.v_proj.weight.grad
    dec.zero_grad()
    dec(h, e).pow(2).sum().backward()
    assert dec.q_proj.weight.grad.abs().sum() > 0
    assert dec.k_proj.weight.grad.abs().sum() > 0


def test_augmenting_block_initialised_from_base_reproduces_its_last_layer():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=10000.0)
    base = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, V, (B, T))
    captured = {}
    last = base.model.layers[-1]
    def capture(module, args, kwargs, out):
        captured.update(x=args[0] if args else kwargs["hidden_states"], y=out[0] if isinstance(out, tuple) else out)

    last.register_forward_hook(capture, with_kwargs=True)
    with torch.no_grad():
        base(ids)
    heads = CloverHeads(small_config())
    heads.init_from_base({k.removeprefix("model.layers.1."): v for k, v in base.state_dict().items()
                          if k.startswith("model.layers.1.")}, base.model.norm.weight)
    positions = torch.arange(T).expand(B, T)
    with torch.no_grad():
        ours = heads.augment(captured["x"], positions)
    torch.testing.assert_close(ours, captured["y"], atol=1e-5, rtol=1e-5)


def test_identity_augment_init_starts_every_head_at_the_bases_own_prediction(inputs):
    """'identity' keeps the last layer's weights but adds nothing at first: the augmented state
    points where the base's does, so fresh heads draft the base's next token."""
    h_base, ids, lm_head = inputs
    torch.manual_seed(3)
    layer = {k: v.normal_(0, 0.1) for k, v in CloverHeads(small_config()).augment.state_dict().items()}
    norm_weight = torch.rand(H) + 0.5
    heads = CloverHeads(small_config(augment_init="identity"))
    heads.init_from_base(layer, norm_weight)
    assert torch.equal(heads.augment.self_attn["q_proj"].weight, layer["self_attn.q_proj.weight"])
    h0 = heads.augmented(h_base, torch.arange(T).expand(B, T))
    torch.testing.assert_close(torch.cosine_similarity(h0, h_base, dim=-1), torch.ones(B, T))
    first_head = heads.head_hidden_states(h_base, ids, lm_head)[0]
    assert torch.equal((first_head @ lm_head.T).argmax(-1), (h_base[:, : T - 2] @ lm_head.T).argmax(-1))


def test_draft_chain_matches_teacher_forced_heads_on_its_own_tokens(inputs):
    """The serving chain fed its own greedy tokens equals the training path fed the same tokens."""
    h_base, _, lm_head = inputs
    torch.manual_seed(2)
    heads = CloverHeads(small_config())
    heads.decoder.v_proj.weight.data.normal_(0, 0.1)
    for m in heads.mlps:
        m.linear.weight.data.normal_(0, 0.1)
    h0 = heads.augmented(h_base[:1], torch.arange(T)[None])[0, -1:]   # last position
    first = torch.tensor([5])
    drafts, confidence = heads.draft(h0, first, DenseLmHead(lm_head), K)
    # Rebuild the same chain step by step with the training-time step function.
    h, e = h0, token_embeddings(lm_head, first)
    for i in range(K):
        h, out = heads.step(i, h, e)
        logits = out @ lm_head.T
        tok = logits.argmax(-1)
        assert tok.item() == drafts[0, i].item()
        assert confidence[0, i].item() == pytest.approx(logits.softmax(-1).max().item(), rel=1e-5)
        e = token_embeddings(lm_head, tok)


@pytest.mark.parametrize("regressive,augment", [("mlp", True), ("none", True), ("attention", False)])
def test_ablations_build_and_run(inputs, regressive, augment):
    h_base, ids, lm_head = inputs
    heads = CloverHeads(small_config(regressive=regressive, augmenting_block=augment))
    logits, _ = heads(h_base, ids, lm_head)
    assert len(logits) == K
    assert hasattr(heads, "decoder") == (regressive != "none")
    assert hasattr(heads, "augment") == augment


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="num_heads must be in 1..8, got 9"):
        small_config(num_heads=9)
    with pytest.raises(ValueError, match="regressive must be"):
        small_config(regressive="lstm")
    with pytest.raises(ValueError, match="augment_init must be 'last_layer' or 'identity', got 'zero'"):
        small_config(augment_init="zero")
