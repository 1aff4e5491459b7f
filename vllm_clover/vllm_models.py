"""Clover and CLP draft models as vLLM builds them: `CloverDraftModel`, `ClpDraftModel`.

vLLM's MedusaProposer constructs these through the model registry (the heads' config.json
names them in `architectures`) and loads model.safetensors into them. The math is the
vLLM-free modules in clover.py / clp.py; this file only adapts them to vLLM:

- Clover's Augmenting Block is vLLM's own Llama decoder layer, built from the *target's*
  config: it is a copy of the base's layer shape, so it shards under tensor parallelism
  exactly as the base does, and its attention is a vLLM `Attention` whose paged KV cache
  lives in the target's KV group (same block tables, prefix cache and preemption). Its
  name holds one integer, the index after the target's last layer, as vLLM's KV binding
  requires.
- The base's LM head is used through `VllmLmHead`, never copied: its rows come from the
  vocab-sharded weight (all-reduced under TP) and logits from the target's
  `compute_logits` (all-gathered), so every rank drafts the same tokens.

The runner hook (proposer.py) calls `propose`, not `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import torch
import torch.nn as nn

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

from vllm_clover.checkpoint import WEIGHTS, CheckpointError, check_tensors
from vllm_clover.clover import CloverConfig, CloverHeads
from vllm_clover.clp import ClpHeads
from vllm_clover.patches import apply_for_our_draft_model
from vllm_clover.spec_config import ServingOptions, serving_options


@dataclass
class DraftBatch:
    """What a draft model sees in one engine step (built by proposer.draft_batch).

    hidden_states / positions cover every token the target just ran (prefill chunks,
    decodes and rejected drafts alike); the other fields cover only the rows that get
    drafts, i.e. requests that sampled a token this step.
    """

    hidden_states: torch.Tensor   # [N, H] the target's last hidden states (after its final norm)
    positions: torch.Tensor       # [N]
    last_index: torch.Tensor      # [R] row of hidden_states at each request's last accepted token
    next_token: torch.Tensor      # [R] the token the target just produced for it
    max_len: list[int]            # [R] draft budget per request; proposers may return fewer


class VllmLmHead:
    """The target's LM head behind the `LmHead` interface of layers.py."""

    def __init__(self, target: nn.Module):
        self.target = target

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        # ParallelLMHead refuses forward(); the embedding lookup of its base class does the
        # masked per-shard lookup and the all-reduce.
        return VocabParallelEmbedding.forward(self.target.lm_head, token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


class DraftModel(nn.Module):
    """What the runner hook recognises. Subclasses map checkpoint tensors and draft."""

    # Attention layers that need this step's metadata and KV slots while drafting.
    kv_layer_names: tuple[str, ...] = ()

    def __init__(self, vllm_config, prefix: str = ""):
        super().__init__()
        apply_for_our_draft_model()
        draft = vllm_config.speculative_config.draft_model_config
        self.heads_dir = Path(draft.model)
        self.hyper: dict = draft.hf_config.vllm_clover["hyper"]
        self.options: ServingOptions = serving_options(draft.hf_config)
        self._target: list[nn.Module] = []  # a list, so the target is not a submodule of ours

    def bind_target(self, target: nn.Module) -> None:
        if not self._target:
            self._target.append(target)
            self.lm_head = VllmLmHead(target)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Only MedusaProposer.dummy_run calls this (memory profiling); drafting is `propose`."""
        return hidden_states

    def checkpoint_shapes(self) -> dict[str, torch.Size]:
        raise NotImplementedError

    def load_checked(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tensors = dict(weights)
        check_tensors(self.heads_dir, tensors, self.checkpoint_shapes())
        loaded = self.load_checked(tensors)
        missing = {name for name, _ in self.named_parameters()} - loaded
        if missing:
            raise CheckpointError(f"{self.heads_dir / WEIGHTS} left parameters unset: {sorted(missing)[:5]}")
        return loaded

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        raise NotImplementedError


def _module_shapes(module: nn.Module) -> dict[str, torch.Size]:
    return {name: t.shape for name, t in module.state_dict().items()}


def _copy_into(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> set[str]:
    params = dict(module.named_parameters())
    for name, param in params.items():
        param.data.copy_(tensors[name])
    return {maybe_prefix(prefix, name) for name in params}


class CloverDraftModel(DraftModel):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config, prefix)
        config = CloverConfig(**self.hyper)
        self.config = config
        # The regressive chain (decoder + K MLPs) is clover.py's module as it is.
        self.chain = CloverHeads(replace(config, augmenting_block=False))
        if config.augmenting_block:
            target = vllm_config.model_config.hf_config
            index = target.num_hidden_layers
            self.augment = LlamaDecoderLayer(vllm_config, prefix=maybe_prefix(prefix, f"clover.layers.{index}"),
                                             config=target)
            self.augment_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.kv_layer_names = (self.augment.self_attn.attn.layer_name,)

    def checkpoint_shapes(self) -> dict[str, torch.Size]:
        with torch.device("meta"):
            return _module_shapes(CloverHeads(self.config))

    def load_checked(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        chain = {k: v for k, v in tensors.items() if not k.startswith("augment")}
        loaded = _copy_into(self.chain, chain, "chain")
        if self.config.augmenting_block:
            # HF names (q_proj, k_proj, ...) -> vLLM's fused qkv_proj / gate_up_proj shards.
            layer = ((k.removeprefix("augment."), v) for k, v in tensors.items() if k.startswith("augment."))
            done = AutoWeightsLoader(self.augment).load_weights(layer, mapper=LlamaModel.hf_to_vllm_mapper)
            loaded |= {f"augment.{name}" for name in done}
            self.augment_norm.weight.data.copy_(tensors["augment_norm.weight"])
            loaded.add("augment_norm.weight")
        return loaded

    def augmented(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """h_0 at every scheduled token; also writes the block's KV for later steps."""
        if not self.config.augmenting_block:
            return hidden_states
        out, residual = self.augment(positions, hidden_states, None)
        return self.augment_norm(out, residual)[0]

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        # Every scheduled token goes through the block, drafting or not (prefill chunks
        # too), so its KV cache holds every position later drafts attend to.
        h0 = self.augmented(batch.hidden_states, batch.positions)
        if not batch.max_len:
            return []
        drafts = self.chain.draft(h0[batch.last_index], batch.next_token, self.lm_head, max(batch.max_len))
        return [row[:n] for row, n in zip(drafts.tolist(), batch.max_len)]


class ClpDraftModel(DraftModel):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config, prefix)
        hidden_size = vllm_config.speculative_config.draft_model_config.hf_config.hidden_size
        tau = self.options.clp_tau if self.options.clp_tau is not None else self.hyper["tau"]
        self.heads = ClpHeads(self.hyper["num_heads"], hidden_size, tau=tau)

    def checkpoint_shapes(self) -> dict[str, torch.Size]:
        return _module_shapes(self.heads)

    def load_checked(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        return _copy_into(self.heads, tensors, "heads")

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        if not batch.max_len:
            return []
        h = batch.hidden_states[batch.last_index]
        lengths = [min(n, budget) for n, budget in zip(self.heads.draft_lengths(h).tolist(), batch.max_len)]
        if max(lengths) == 0:
            return [[] for _ in lengths]
        drafts = self.heads.draft(h, self.lm_head, max(lengths))
        return [row[:n] for row, n in zip(drafts.tolist(), lengths)]
