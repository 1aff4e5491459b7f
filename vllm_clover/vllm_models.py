"""Our heads as vLLM builds them: `HeadsDraftModel`, registered under every plugin-served
method's architecture name (methods.TABLE: CloverDraftModel, ClpDraftModel).

vLLM's MedusaProposer constructs it through the model registry (the heads' config.json
names the architecture) and loads model.safetensors into it. The math is the method's
vLLM-free heads module (clover.py, clp.py) as it is; this file only adapts it to vLLM:

- An augmenting block (Clover's) is vLLM's own Llama decoder layer, built from the
  *target's* config: it has the base's layer shape, so it shards under tensor parallelism
  exactly as the base does, and its attention is a vLLM `Attention` whose paged KV cache
  lives in the target's KV group (same block tables, prefix cache and preemption). Its
  name holds one integer, the index after the target's last layer, as vLLM's KV binding
  requires. The heads module is built without its own copy of the block.
- The base's LM head is used through `VllmLmHead`, never copied: its rows come from the
  vocab-sharded weight (all-reduced under TP) and logits from the target's
  `compute_logits` (all-gathered, and on CPUs vLLM's prepacked GEMM), so every rank drafts
  the same tokens. A draft vocabulary's N rows are gathered once and scored locally.

The runner hook (proposer.py) calls `propose`, not `forward`.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn
from vllm import _custom_ops as ops
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_tp_group
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.platforms import current_platform

from vllm_clover.checkpoint import WEIGHTS, check_tensors, checkpoint_shapes, read_calibration
from vllm_clover.draft_batch import DraftBatch
from vllm_clover.draft_policy import DraftStats, GoodputPolicy, SharedDecisions
from vllm_clover.errors import CheckpointError
from vllm_clover.layers import MakeScorer, top1_of
from vllm_clover.methods import BY_NAME
from vllm_clover.spec_config import ServingOptions, serving_options

# Most tokens of augmenting-block KV writes put off (DeferredKvWrites) before they are written.
DEFERRED_KV_TOKENS = 1024

# Checkpoint tensor names of an augmenting block (TorchLlamaDecoderLayer + norm, clover.py).
AUGMENT, AUGMENT_NORM = "augment.", "augment_norm.weight"


def cpu_draft_vocab_scorer(target_dtype: torch.dtype) -> MakeScorer | None:
    """On CPUs, score a draft vocabulary with vLLM's own prepacked oneDNN GEMM (what the
    target's layers run), in bf16 for an fp32 target where the CPU has native bf16 matmuls;
    elsewhere None (a plain matmul). Measured on SmolLM2 (fp32, one worker core): the four
    scorings of its 8k-row draft vocabulary took 7.1 of Clover's 12.8 ms draft step; one
    scoring on one core: plain fp32 matmul 1.00 ms, oneDNN fp32 0.48, oneDNN bf16 0.20."""
    if not (current_platform.is_cpu() and ops._supports_onednn):
        return None
    bf16 = target_dtype == torch.float32 and torch.ops.mkldnn._is_mkldnn_bf16_supported()

    def make_scorer(rows: torch.Tensor):
        packed = rows.to(torch.bfloat16) if bf16 else rows
        handler = ops.create_onednn_mm(packed.t(), 32)
        return lambda hidden: ops.onednn_mm(handler, hidden.to(packed.dtype).reshape(-1, packed.shape[1]),
                                            None).reshape(*hidden.shape[:-1], packed.shape[0])

    return make_scorer


def cpu_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x weight^T + bias, through a oneDNN GEMM prepacked once where vLLM's CPU build has
    one (what its own linear layers run), else a plain matmul."""
    if not (current_platform.is_cpu() and ops._supports_onednn):
        return lambda x: torch.nn.functional.linear(x, weight, bias)
    handler = ops.create_onednn_mm(weight.t(), 32)
    return lambda x: ops.onednn_mm(handler, x, bias)


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

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).argmax(-1)

    def top1(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return top1_of(self.logits(hidden))


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden_states": 0})  # the number of tokens
class AugmentingBlock(nn.Module):
    """Clover's augmenting block as vLLM runs it: vLLM's Llama decoder layer in the target's
    shape, then a norm, in two parts. Every scheduled token's KV must be written (later
    drafts attend to it), but drafts start from one row per request: `forward` runs the
    layer up to its attention for every token, which writes their KV, and `finish` runs the
    rest (output projection, MLP, norms) only at the rows drafts start from (at batch 16
    verifying 4 drafts each, 16 rows of 80; for a prefill chunk, one). A step that drafts
    nothing writes the KV alone (`write_kv`). vLLM compiles `forward` as it compiles the
    target (torch.compile, split around the attention op, dynamic in the number of tokens)
    unless the engine runs eager; `finish` and `write_kv` run vLLM's ops eagerly."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        target = vllm_config.model_config.hf_config
        # One integer in the layer's name, the index after the target's last layer: vLLM's
        # KV-cache binding parses it.
        self.layer = LlamaDecoderLayer(vllm_config, prefix=maybe_prefix(prefix, f"layers.{target.num_hidden_layers}"),
                                       config=target)
        self.norm = RMSNorm(target.hidden_size, eps=target.rms_norm_eps)
        self.kv_projection: Callable[[torch.Tensor], torch.Tensor] | None = None  # `keep_kv_projection`

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Every token -> its attention output before the output projection; writes its KV."""
        return self.layer.self_attn.attn(*self.rotated_qkv(positions, hidden_states))

    def rotated_qkv(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layer's input norm, q/k/v projection and rotary embedding: (q, k, v)."""
        attn = self.layer.self_attn
        qkv, _ = attn.qkv_proj(self.layer.input_layernorm(hidden_states))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        return q, k, v

    def write_kv(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """Every token's KV, without attending: a step that drafts nothing needs no outputs.
        Eager, as `finish`: a few small ops, then the attention backend's own cache write."""
        attn = self.layer.self_attn
        if attn.attn.attn_backend.forward_includes_kv_cache_update:  # a backend that writes only while attending
            self(positions, hidden_states)
            return
        k, v = self.rotated_kv_with_kernels(positions, hidden_states) if self.kernels_fit(hidden_states) else \
            self.rotated_qkv(positions, hidden_states)[1:]
        shape = (-1, attn.attn.num_kv_heads, attn.attn.head_size)
        unified_kv_cache_update(k.view(shape), v.view(shape), attn.attn.layer_name)

    def kernels_fit(self, hidden_states: torch.Tensor) -> bool:
        """Whether `rotated_kv_with_kernels` computes what `rotated_qkv` does: on CPUs, with the
        plain rotary embedding (a scaled one computes its own) in the activations' dtype, and
        the k and v rows of an unquantized projection kept (`keep_kv_projection`)."""
        rope = self.layer.self_attn.rotary_emb
        return current_platform.is_cpu() and type(rope).forward_native is RotaryEmbedding.forward_native \
            and rope.cos_sin_cache.dtype == hidden_states.dtype and self.kv_projection is not None

    def keep_kv_projection(self) -> None:
        """The k and v rows of this rank's qkv projection as a linear map of their own, taken
        once the weights are loaded and before vLLM's CPU linear layers pack them away: the
        KV-only write projects to k and v alone (q is half the demo base's qkv rows, and its
        projection 0.16 of a 0.65 ms write at batch 64). None for a quantized projection."""
        qkv, attn = self.layer.self_attn.qkv_proj, self.layer.self_attn
        self.kv_projection = None
        if isinstance(qkv.quant_method, UnquantizedLinearMethod) and qkv.weight.dim() == 2:
            bias = None if qkv.bias is None else qkv.bias.data[attn.q_size:].clone()
            self.kv_projection = cpu_linear(qkv.weight.data[attn.q_size:].clone(), bias)

    def rotated_kv_with_kernels(self, positions: torch.Tensor,
                                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotated_qkv`'s k and v through vLLM's own norm and rotary kernels, projected to k
        and v alone (`keep_kv_projection`), k alone rotated. The engine runs those layers in
        their PyTorch-native forms, which its compiled graphs fuse; run eagerly here, on the
        demo base at batch 64 they took 0.85 ms of the 1.5 ms write (the norm 0.22, rotating
        q and k 0.63), the kernels ~0.01 each."""
        attn, norm, rope = self.layer.self_attn, self.layer.input_layernorm, self.layer.self_attn.rotary_emb
        normed = torch.empty_like(hidden_states)
        ops.rms_norm(normed, hidden_states, norm.weight, norm.variance_epsilon)
        k, v = self.kv_projection(normed).split([attn.kv_size, attn.kv_size], dim=-1)
        ops.rotary_embedding(positions, k, None, rope.head_size, rope.cos_sin_cache, rope.is_neox_style)  # in place
        return k, v

    def finish(self, attention: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Some rows' attention outputs and block inputs -> their h_0 (LlamaDecoderLayer's
        residual path, then the block's norm)."""
        layer = self.layer
        out, _ = layer.self_attn.o_proj(attention)
        out, residual = layer.post_attention_layernorm(out, hidden_states)
        # LlamaMLP's steps with the activation's plain-PyTorch form: called outside a compiled
        # graph, vLLM's SiluAndMul would torch.compile itself on first use, and again for a
        # new row count while serving.
        gate_up, _ = layer.mlp.gate_up_proj(out)
        out, _ = layer.mlp.down_proj(SiluAndMul.forward_native(gate_up))
        return self.norm(out, residual)[0]


class HeadsDraftModel(nn.Module):
    """Any plugin-served method's heads (methods.TABLE), as the runner hook recognises them."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        draft = vllm_config.speculative_config.draft_model_config
        self.heads_dir = Path(draft.model)
        self.options: ServingOptions = serving_options(draft.hf_config)
        self.method = BY_NAME[self.options.method]
        ours = draft.hf_config.vllm_clover
        hyper = {**ours["hyper"], **self.options.hyper_overrides}
        config = {"hidden_size": draft.hf_config.hidden_size, "vocab_size": draft.hf_config.vocab_size,
                  "num_heads": draft.hf_config.num_heads, "vllm_clover": {**ours, "hyper": hyper}}
        with torch.device("meta"):  # the full module only tells which tensors the file must hold
            self.expected_shapes = checkpoint_shapes(self.method.heads.from_checkpoint(config))
        self.with_augmenting_block = self.method.has_augmenting_block(hyper)
        if self.with_augmenting_block:
            hyper = {**hyper, self.method.augmenting_kv: False}
            self.augment = AugmentingBlock(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "clover"))
        self.heads = self.method.heads.from_checkpoint({**config, "vllm_clover": {**ours, "hyper": hyper}})
        # Attention layers that need this step's metadata and KV slots while drafting.
        self.kv_layer_names: tuple[str, ...] = (
            (self.augment.layer.self_attn.attn.layer_name,) if self.with_augmenting_block else ())
        self.deferred_kv = DeferredKvWrites()
        # Whether a step that drafts nothing may put its augmenting-block KV off: there is a
        # block, and its attention backend writes KV apart from attending.
        self.defers_kv_writes = self.with_augmenting_block and \
            not self.augment.layer.self_attn.attn.attn_backend.forward_includes_kv_cache_update
        self.vllm_config = vllm_config
        self._target: list[nn.Module] = []  # a list, so the target is not a submodule of ours
        self.target_dtype = vllm_config.model_config.dtype
        num_heads = self.heads.num_heads
        self.draft_policy = self.options.draft_policy
        self.policy = (GoodputPolicy(num_heads, calibration=read_calibration(self.heads_dir, num_heads))
                       if self.draft_policy == "goodput" else None)
        if self.policy is not None and vllm_config.parallel_config.tensor_parallel_size > 1:
            # Every rank times its own steps, so ranks could choose different depths, and the
            # heads' collectives would then wait for each other forever: rank 0 decides.
            tensor_parallel = get_tp_group()
            self.policy = SharedDecisions(self.policy, lambda decision: tensor_parallel.broadcast_object(decision))
        self.stats = DraftStats(num_heads)
        self.stats_logged: tuple[float, dict] | None = None  # (when, stats) of the last log line

    def bind_target(self, target: nn.Module) -> None:
        if not self._target:
            self._target.append(target)
            # A draft vocabulary's rows are gathered once, here.
            self.lm_head = self.heads.output_head(VllmLmHead(target), cpu_draft_vocab_scorer(self.target_dtype))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """MedusaProposer.dummy_run's call (patch warm_up_draft_model makes it at start-up):
        a dummy pass through the augmenting block at every row, so a compiled block compiles
        then and its activations count in memory profiling. Drafting is `propose`."""
        positions = torch.zeros(hidden_states.shape[0], dtype=torch.long, device=hidden_states.device)
        return self.start_states(self.write_augmenting_kv(hidden_states, positions), hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tensors = dict(weights)
        check_tensors(self.heads_dir, tensors, self.expected_shapes)
        self.heads.load_checkpoint_tensors({k: v for k, v in tensors.items() if not k.startswith("augment")})
        loaded = {f"heads.{name}" for name, _ in self.heads.named_parameters()}
        if self.with_augmenting_block:
            # HF names (q_proj, k_proj, ...) -> vLLM's fused qkv_proj / gate_up_proj shards.
            layer = ((k.removeprefix(AUGMENT), v) for k, v in tensors.items() if k.startswith(AUGMENT))
            done = AutoWeightsLoader(self.augment.layer).load_weights(layer, mapper=LlamaModel.hf_to_vllm_mapper)
            loaded |= {f"augment.layer.{name}" for name in done}
            self.augment.norm.weight.data.copy_(tensors[AUGMENT_NORM])
            self.augment.keep_kv_projection()
            loaded.add("augment.norm.weight")
        missing = {name for name, _ in self.named_parameters()} - loaded
        if missing:
            raise CheckpointError(f"{self.heads_dir / WEIGHTS} left parameters unset: {sorted(missing)[:5]}")
        return loaded

    def write_augmenting_kv(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                            attend: bool = True) -> torch.Tensor | None:
        """Every scheduled token's KV in the augmenting block's cache, drafting or not
        (prefill chunks too), so it holds every position later drafts attend to; with
        `attend`, their attention outputs too, for `start_states`. None without a block or
        without `attend`."""
        if not self.with_augmenting_block:
            return None
        if not attend:
            self.augment.write_kv(positions, hidden_states)
            return None
        return self.augment(positions, hidden_states)

    def start_states(self, attention: torch.Tensor | None, hidden_states: torch.Tensor,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
        """The states drafts start from at `rows` (all if None): h_0 for Clover, the target's
        own hidden states for heads without an augmenting block."""
        if rows is not None:
            hidden_states = hidden_states[rows]
        if attention is None:
            return hidden_states
        return self.augment.finish(attention if rows is None else attention[rows], hidden_states)

    def propose(self, batch: DraftBatch, attending: Callable[[], AbstractContextManager],
                kv_slots: torch.Tensor | None) -> list[list[int]]:
        """Up to each budget's drafts per row. `attending()`: the forward context in which the
        augmenting block attends at this step's slots, `kv_slots`; a step that drafts nothing
        only puts its KV writes off (`DeferredKvWrites`)."""
        depth = self.heads.draft_depth(batch.budgets, self.policy) if batch.budgets else 0
        attention = self.keep_step_kv(batch.hidden_states, batch.positions, attending, kv_slots, attend=depth > 0)
        if not batch.budgets:
            return []
        if depth == 0:
            drafts = [[] for _ in batch.budgets]
        else:
            start = time.perf_counter()
            h = self.start_states(attention, batch.hidden_states, batch.last_index)
            drafts = self.heads.propose(h, batch.next_token, self.lm_head, [min(n, depth) for n in batch.budgets],
                                        self.policy)
            if self.policy is not None:
                self.policy.heads_timed(time.perf_counter() - start)
        self.stats.record([len(d) for d in drafts], "rule" if self.policy is None else self.policy.decided_by)
        return drafts

    def keep_step_kv(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                     attending: Callable[[], AbstractContextManager], kv_slots: torch.Tensor | None,
                     attend: bool) -> torch.Tensor | None:
        """The step's augmenting-block KV, put off where nothing attends this step and the
        backend allows it, else written (with the attention outputs if `attend`, for
        `start_states`); nothing without a block."""
        if not self.with_augmenting_block:
            return None
        if not attend and self.defers_kv_writes:
            self.defer_augmenting_kv(hidden_states, positions, kv_slots)
            return None
        self.write_deferred_kv()
        with attending():
            return self.write_augmenting_kv(hidden_states, positions, attend=attend)

    def defer_augmenting_kv(self, hidden_states: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.deferred_kv.add(hidden_states, positions, slots)
        if self.deferred_kv.tokens >= DEFERRED_KV_TOKENS:
            self.write_deferred_kv()

    def write_deferred_kv(self) -> None:
        """The deferred steps' KV in one write, before anything attends to it."""
        deferred = self.deferred_kv.take()
        if deferred is None:
            return
        start, (hidden_states, positions, slots) = time.perf_counter(), deferred
        with set_forward_context(None, self.vllm_config, slot_mapping={self.kv_layer_names[0]: slots}):
            self.write_augmenting_kv(hidden_states, positions, attend=False)
        if self.policy is not None:
            self.policy.deferred_work_timed(time.perf_counter() - start)


class DeferredKvWrites:
    """Augmenting-block KV of steps whose heads drafted nothing, not written yet.

    Under load the policy drafts in few steps, and each step's write on its own cost the
    demo base 0.26 ms at batch 4 (a 3.3 ms step) and 0.65 ms at batch 64, mostly the fixed
    cost of a dozen small ops; written many steps at once, it is paid once. Kept in step
    order, and written before the block next attends, only the latest write to each slot: where
    a slot changed hands in between (a request finished or was preempted and its block reused,
    or a cached prefix block evicted) the later step's KV is what stays, as if each had been
    written at once (one write with a slot twice would leave it to the kernel's threads which
    one lands). Copies: vLLM reuses its step buffers."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.tokens = 0

    def add(self, hidden_states: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        n = len(hidden_states)
        self.parts.append((hidden_states.clone(), positions[:n].clone(), slots[:n].clone()))
        self.tokens += n

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(hidden states, positions, slots) of every deferred token, in step order; none left."""
        if not self.parts:
            return None
        parts, self.parts, self.tokens = self.parts, [], 0
        hidden_states, positions, slots = (torch.cat(column) for column in zip(*parts))
        latest = latest_per_slot(slots)
        if latest is None:
            return hidden_states, positions, slots
        return hidden_states[latest], positions[latest], slots[latest]


def latest_per_slot(slots: torch.Tensor) -> torch.Tensor | None:
    """The index of each slot's last occurrence in `slots`, or None where none repeats."""
    unique, inverse = torch.unique(slots, return_inverse=True)
    if len(unique) == len(slots):
        return None
    order = torch.arange(len(slots), device=slots.device)
    return torch.zeros_like(unique).scatter_reduce_(0, inverse, order, "amax", include_self=False)
