"""Every change vllm-clover makes to vLLM internals, in one table.

vLLM 0.32 has no proposer registry, so the plugin wraps three private methods, and it
works around one vLLM CPU bug. Each change is a no-op for anything that is not ours:
other methods, models and checkpoints run exactly as without the plugin. All were
written against vLLM 0.32 (`version.SUPPORTED_VLLM`, checked before any is applied), and
each checks at apply time that the wrapped function still has the parameters it was
written for, so a vLLM change fails at start-up with the patch's name rather than
mid-generation. The first three are applied by `register()` in every vLLM process; the
last only in a CPU worker that builds one of our draft models.

  speculative_method_names  EngineArgs.create_speculative_config
      vLLM's SpeculativeConfig.method is a closed Literal. Rewrite "clover" / "clp" /
      "clp-trust" to the "medusa" carrier after validating the heads directory
      (spec_config.py), and hand the serving options to the workers.
  draft_with_clover_heads   GPUModelRunner.propose_draft_token_ids  (CPUModelRunner inherits)
      vLLM's medusa branch gives its proposer one hidden state per request and wants a
      fixed [B, K] tensor. Clover needs the sampled token, every scheduled token's hidden
      state and its own KV cache; CLP returns a length per request. Route our draft models
      to proposer.propose; everything else goes to vLLM's code.
  trust_clp_drafts          RejectionSampler.forward
      CLP's paper mode accepts the predicted span without verification. For a runner
      serving "clp-trust", make the target's verification distribution at each draft
      position a point mass on the draft token, so vLLM's own sampler accepts it, and
      samples the bonus token as usual. Lossy by design; opt-in only.
  cpu_expand_float_params   rejection_sampler.expand_batch_to_tokens  (CPU workers of our engines)
      vLLM 0.32's C++ fallback for the Triton `expand_kernel` casts its output to int64 and
      writes into that copy, so per-token temperatures (and top-p) used to verify drafts
      stay uninitialised memory: at temperature > 0 every spec-decode method on the CPU
      build samples from a wrong distribution (tests/test_lossless.py shows it for
      vLLM's own Medusa). Replace it with the same expansion in plain torch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from vllm_clover.version import SUPPORTED_VLLM

MARKER = "__vllm_clover_patch__"


class VllmInternalsChanged(RuntimeError):
    pass


@dataclass(frozen=True)
class Patch:
    name: str
    target: str                    # "module:function" or "module:Class.method"
    parameters: tuple[str, ...]    # the signature the wrapper was written against
    wrap: Callable[[Callable], Callable]
    vllm: str = SUPPORTED_VLLM

    def _owner_and_attribute(self):
        module, path = self.target.split(":")
        owner = importlib.import_module(module)
        *classes, attribute = path.split(".")
        for cls in classes:
            owner = getattr(owner, cls)
        return owner, attribute

    def original(self) -> Callable:
        return getattr(*self._owner_and_attribute())

    def apply(self) -> None:
        owner, attribute = self._owner_and_attribute()
        original = getattr(owner, attribute)
        if getattr(original, MARKER, None) == self.name:
            return
        found = tuple(inspect.signature(original).parameters)
        if found != self.parameters:
            raise VllmInternalsChanged(
                f"vllm-clover patch {self.name!r} was written for vLLM {self.vllm}'s "
                f"{self.target}{self.parameters}, but this vLLM has {found}")
        wrapper = functools.wraps(original)(self.wrap(original))
        setattr(wrapper, MARKER, self.name)
        setattr(owner, attribute, wrapper)


def _speculative_method_names(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        from vllm_clover import spec_config

        options = None
        if isinstance(self.speculative_config, dict):
            spec = {k.replace("-", "_"): v for k, v in self.speculative_config.items()}
            resolved, options = spec_config.resolve(spec, target_model_config.model)
            if options is not None:
                self.speculative_config = resolved
        speculative_config = original(self, target_model_config, target_parallel_config)
        if options is not None:
            spec_config.attach(speculative_config, options)
        return speculative_config

    return create_speculative_config


def _draft_with_clover_heads(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        from vllm_clover import proposer
        from vllm_clover.vllm_models import DraftModel

        model = getattr(getattr(self, "drafter", None), "model", None)
        if not isinstance(model, DraftModel):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                            common_attn_metadata, slot_mappings)
        self._draft_probs = None       # as the original does: our drafts are greedy (one-hot)
        self._draft_prob_req_ids = None
        return proposer.propose(self, model, scheduler_output, sampled_token_ids, hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings)

    return propose_draft_token_ids


def _trust_clp_drafts(original):
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        from vllm_clover.proposer import TRUST_DRAFTS_ATTR

        if getattr(self, TRUST_DRAFTS_ATTR, False):
            logits = point_mass_on_drafts(logits, metadata.target_logits_indices, metadata.draft_token_ids)
        return original(self, metadata, draft_probs, logits, sampling_metadata)

    return forward


def point_mass_on_drafts(logits, draft_rows, draft_token_ids):
    """A copy of `logits` whose rows at draft positions allow only the draft token: greedy
    verification takes it (argmax) and random verification accepts it (p = 1)."""
    forced = logits.clone()
    forced[draft_rows] = float("-inf")
    forced[draft_rows, draft_token_ids.long()] = 0.0
    return forced


def _cpu_expand_float_params(original):
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    return expand_batch_to_tokens


PATCHES = (
    Patch("speculative_method_names", "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
          ("self", "target_model_config", "target_parallel_config"), _speculative_method_names),
    Patch("draft_with_clover_heads", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
          ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
           "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
           "slot_mappings"), _draft_with_clover_heads),
    Patch("trust_clp_drafts", "vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
          ("self", "metadata", "draft_probs", "logits", "sampling_metadata"), _trust_clp_drafts),
)
CPU_WORKER_PATCHES = (
    Patch("cpu_expand_float_params", "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens",
          ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"), _cpu_expand_float_params),
)


def apply_all() -> None:
    for patch in PATCHES:
        patch.apply()


def apply_for_our_draft_model() -> None:
    """Called where one of our draft models is built (an engine's worker process)."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:  # with Triton, vLLM's own kernel runs and is correct
        for patch in CPU_WORKER_PATCHES:
            patch.apply()
