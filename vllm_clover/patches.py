"""Every change vllm-clover makes to vLLM internals, in one table.

vLLM 0.32 has no proposer registry, so the plugin wraps eight private methods, skips three
costs of vLLM's spec-decode path that our engines need not pay, and works around four
vLLM bugs. Each change is a no-op for anything that is not ours:
other methods, models and checkpoints run exactly as without the plugin. All were
written against vLLM 0.32 (`version.SUPPORTED_VLLM`, checked before any is applied), and
each checks at apply time that the wrapped function still has the parameters it was
written for, so a vLLM change fails at start-up with the patch's name rather than
mid-generation. All but the last two are applied by `register()` in every vLLM process;
the last two in a CPU worker that drafts with one of our models, before its first sample.

  speculative_method_names  EngineArgs.create_speculative_config
      vLLM's SpeculativeConfig.method is a closed Literal. Rewrite "clover" / "clp" /
      "clp-trust" to the "medusa" carrier after validating the heads directory
      (spec_config.py), and hand the serving options to the workers.
  draft_with_clover_heads   GPUModelRunner.propose_draft_token_ids  (CPUModelRunner inherits)
      vLLM's medusa branch gives its proposer one hidden state per request and wants a
      fixed [B, K] tensor. Clover needs the sampled token, every scheduled token's hidden
      state and its own KV cache; CLP returns a length per request. Route our draft models
      to proposer.propose; everything else goes to vLLM's code.
  draft_near_max_model_len  GPUModelRunner._input_fits_in_drafter
      vLLM skips the draft step of the whole batch when any request is within K tokens of
      max_model_len, since its drafters write KV at draft positions. Ours write KV only for
      the step's tokens (Clover's augmenting block), which must happen every step or later
      drafts read stale entries; so for our models the step always runs, and proposer.py
      cuts that request's drafts to the room it has left.
  warm_up_draft_model       GPUModelRunner.profile_run  (CPUModelRunner's compile warm-up runs it)
      vLLM 0.32's runner never calls MedusaProposer.dummy_run, so a medusa-carried draft
      model first runs on the first request. After the runner's own profile run, make that
      dummy call for our models: a compiled augmenting block compiles at start-up, as the
      target does, instead of stalling the first request.
  drafts_with_sampled_tokens  GPUModelRunner.sample_tokens
  drafts_delivered          Scheduler.update_from_output
  no_draft_rpc              EngineCore.post_step
      vLLM's engine core fetches each step's drafts from the worker with a separate RPC
      (`take_draft_token_ids`, in post_step) after the one that returned the sampled
      tokens: a third round trip through the worker's message queue every step (py-spy:
      ~6% of a speculative engine core's time, demo base at batch 16). For runners that
      draft with our models, attach the drafts to the step's ModelRunnerOutput; the
      scheduler keeps what arrived, and post_step hands it to update_draft_token_ids as
      vLLM would, without the RPC; a step that drafted nothing attaches NO_DRAFTS and hands
      nothing (the scheduler emptied each request's drafts when it scheduled it). Outputs
      without our attribute take vLLM's path.
      The first wrapper also prepares a runner of ours before it first samples: the trust
      flag (trust_clp_drafts) and the CPU fixes (the last two entries), so both touch only
      our engines.
  trust_clp_drafts          RejectionSampler.forward
      CLP's paper mode accepts the predicted span without verification. For a runner
      serving "clp-trust", make the target's verification distribution at each draft
      position a point mass on the draft token, so vLLM's own sampler accepts it, and
      samples the bonus token as usual. Lossy by design; opt-in only.
  greedy_verification       RejectionSampler.forward
      With every request greedy, vLLM 0.32 verifies drafts by copying the logits rows twice
      over (a float32 copy of the target rows kept for logprobs that no request asked for,
      the bonus rows gathered and copied again for the same reason) before taking each row's
      argmax: 3.6 ms a step at batch 64 on the demo base with K = 4 drafts, against 0.2 ms
      for a plain step's sampling. For runners drafting with our models, when nothing but
      the argmax can decide a token (all greedy; no logprobs, penalties, bad words, allowed
      token ids, active min_tokens or logit_bias, thinking budget or custom logits processor;
      not CLP's trusted drafts), take one argmax over all rows and hand vLLM's own greedy
      kernel the same target and bonus tokens it would have computed: the same tokens, the
      same output. Anything else takes vLLM's path.
  plain_inputs_without_drafts  GPUModelRunner._prepare_inputs
      vLLM 0.32 prepares every step of a speculative engine for verification, also steps in
      which no request has a draft: per-request draft counts, logits indices and the
      rejection sampler's metadata (`_calc_spec_decode_metadata`, a few dozen numpy and
      torch calls), then `_sample` verifies zero drafts. Under load the goodput policy
      drafts nothing in nearly every step, and the demo base's steps are 3-20 ms. For
      runners drafting with our models, a step with no scheduled drafts takes the branch an
      engine without speculation takes (logits at each request's last token, no spec-decode
      metadata), so it is sampled plainly too. Not for hybrid targets, whose recurrent
      layers read a zero-draft decode row as a speculative one, nor under a thinking budget
      (below).
  plain_sampling_without_drafts  GPUModelRunner._sample
      vLLM 0.32 samples every step of a speculative engine through its rejection sampler,
      also steps in which no request has a draft (the first step after a prompt; every
      step while the goodput policy drafts nothing, i.e. under load). Those steps pay for
      nothing they use: the sampler keeps a float32 copy of every row's logits for
      logprobs (`max_num_logprobs=-1`) and runs the verification kernels on zero drafts:
      2.5 ms a step at batch 64 on SmolLM2 (vocabulary 49,152) against 0.6 ms for vLLM's
      plain sampler. For runners drafting with our models, sample such a step with the
      plain sampler, as an engine without speculation would: same logits rows (one per
      request), same processors and penalties (no request carries draft tokens), same
      generators. Steps with drafts, and steps with requests under a thinking budget
      (whose state counts the rejection sampler's two calls), keep vLLM's path. With
      plain_inputs_without_drafts, this is left to hybrid targets' steps.
  medusa_token_map          Medusa.load_weights  (vLLM's MedusaModel architecture)
      vLLM's Medusa can score a reduced vocabulary (`truncated_vocab_size` + a `token_map`
      tensor), but 0.32 turns the loaded token map into a parameter without reporting it
      as loaded, so every such checkpoint fails ("weights were not initialized from
      checkpoint: {'token_map'}"). Report it. Checkpoints without a token map are untouched;
      this is what lets the Medusa baseline use the same draft vocabulary as our heads.
  cpu_seeded_prefill_chunks  GPUModelRunner.sample_tokens  (our runners, CPU generators only)
      A request whose prompt is prefilled in several chunks samples a token after every
      chunk and discards all but the last; for a seeded request vLLM 0.32 then rewinds its
      generator with `set_offset`, which a CPU generator does not have ("CPU Generator does
      not use offset"): the engine dies. Speculative steps leave prompts less of the token
      budget, so more of them are chunked (the soak met it in its first minute; plain
      decoding dies the same way, README "Reliability"). Sample those discarded tokens
      without the request's generator, so it is neither advanced (the seed's stream stays
      what it would be unchunked, as vLLM's rewind intends) nor rewound.
  cpu_expand_float_params   rejection_sampler.expand_batch_to_tokens  (CPU workers of our engines)
      vLLM 0.32's C++ fallback for the Triton `expand_kernel` casts its output to int64 and
      writes into that copy, so per-token temperatures (and top-p) used to verify drafts
      stay uninitialised memory: at temperature > 0 every spec-decode method on the CPU
      build samples from a wrong distribution (tests/test_lossless.py shows it for
      vLLM's own Medusa). Replace it with the same expansion in plain torch.
  cpu_top_k_without_drafts  topk_topp_sampler.apply_top_k_only  (CPU workers of our engines)
      vLLM 0.32 verifies every step of a speculative engine, also steps in which no request
      has drafts: the rejection sampler then filters zero draft positions, and on CPU, when
      some request samples with top_k and none with top_p, `k.max()` of an empty tensor
      kills the engine (the soak met it before plain_sampling_without_drafts, which now
      keeps such steps away from the rejection sampler unless a thinking budget is in
      use). Filter nothing when there is nothing to filter.

Besides the wrapped functions, the runner hook reads runner members that are not vLLM's
public API (`RUNNER_READS`, e.g. `GPUModelRunner._get_positions`); `apply_all` checks
each, so a vLLM that renamed one fails at start-up with that member's name.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vllm_clover.errors import VllmInternalsChanged
from vllm_clover.version import SUPPORTED_VLLM

MARKER = "__vllm_clover_patch__"
# Set on vLLM's RejectionSampler of a runner whose drafts are trusted (by the runner hook).
TRUST_DRAFTS_ATTR = "vllm_clover_trust_drafts"
# Set on vLLM's RejectionSampler of a runner drafting with our models (patch greedy_verification).
OURS_ATTR = "vllm_clover_drafts_ours"
PREPARED_ATTR = "vllm_clover_prepared"  # on a runner the hook has prepared (`_prepare_runner`)
# On a ModelRunnerOutput: the step's DraftTokenIds; then on the scheduler until post_step.
DRAFTS_ATTR = "vllm_clover_draft_token_ids"
# In DRAFTS_ATTR's place when no request got a draft: the scheduler then has nothing to take
# (it emptied each scheduled request's drafts when it scheduled them, Scheduler.schedule),
# and handing it an empty list per request costs a lookup and a validation per request.
NO_DRAFTS = "no drafts"


def _resolve(target: str):
    """"module:Class.attr" -> (the object holding attr, "attr")."""
    module, path = target.split(":")
    owner = importlib.import_module(module)
    *classes, attribute = path.split(".")
    for cls in classes:
        owner = getattr(owner, cls)
    return owner, attribute


@dataclass(frozen=True)
class Patch:
    name: str
    target: str                    # "module:function" or "module:Class.method"
    parameters: tuple[str, ...]    # the signature the wrapper was written against
    wrap: Callable[[Callable], Callable]
    vllm: str = SUPPORTED_VLLM

    def _owner_and_attribute(self):
        return _resolve(self.target)

    def original(self) -> Callable:
        return getattr(*self._owner_and_attribute())

    def is_applied(self) -> bool:
        """Whether this patch wraps the target, outermost or under another patch's wrapper
        (two patches wrap GPUModelRunner.sample_tokens)."""
        function = self.original()
        while function is not None:
            if getattr(function, MARKER, None) == self.name:
                return True
            function = getattr(function, "__wrapped__", None)
        return False

    def apply(self) -> None:
        if self.is_applied():
            return
        owner, attribute = self._owner_and_attribute()
        original = getattr(owner, attribute)
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
            resolved, options = spec_config.resolve(spec, target_model_config.model, target_model_config.revision,
                                                      self.download_dir)
            if options is not None:
                self.speculative_config = resolved
        speculative_config = original(self, target_model_config, target_parallel_config)
        if options is not None:
            spec_config.attach(speculative_config, options)
        return speculative_config

    return create_speculative_config


def _heads_model(runner):
    """The runner's draft model if it is one of ours (HeadsDraftModel), else None: every
    runner-side patch does its work only then. Imported here, not at module level, so that
    loading the plugin does not import vLLM's model code."""
    from vllm_clover.vllm_models import HeadsDraftModel

    model = getattr(getattr(runner, "drafter", None), "model", None)
    return model if isinstance(model, HeadsDraftModel) else None


def _draft_with_clover_heads(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        from vllm_clover import proposer

        model = _heads_model(self)
        if model is None:
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                            common_attn_metadata, slot_mappings)
        self._draft_probs = None       # as the original does: our drafts are greedy (one-hot)
        self._draft_prob_req_ids = None
        return proposer.propose(self, model, scheduler_output, sampled_token_ids, hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings)

    return propose_draft_token_ids


def _prepare_runner(runner, model) -> None:
    """Once per runner, before it samples anything (patch drafts_with_sampled_tokens): flag
    trusted drafts for the sampler patch, and fix the CPU build's sampling bugs. Both only
    ever touch runners that draft with our models."""
    if getattr(runner, PREPARED_ATTR, False):
        return
    setattr(runner, PREPARED_ATTR, True)
    setattr(runner.rejection_sampler, OURS_ATTR, True)
    if model.options.trust_drafts:
        setattr(runner.rejection_sampler, TRUST_DRAFTS_ATTR, True)
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:  # with Triton, vLLM's own kernel runs and is correct
        for patch in CPU_WORKER_PATCHES:
            patch.apply()


def _draft_near_max_model_len(original):
    def _input_fits_in_drafter(self, common_attn_metadata):
        if _heads_model(self) is not None:
            return common_attn_metadata is not None
        return original(self, common_attn_metadata)

    return _input_fits_in_drafter


def _warm_up_draft_model(original):
    def profile_run(self, randomize_inputs=False):
        original(self, randomize_inputs)
        if _heads_model(self) is not None:
            self.drafter.dummy_run(self.max_num_tokens)

    return profile_run


def _drafts_with_sampled_tokens(original):
    def sample_tokens(self, grammar_output):
        from vllm.v1.outputs import ModelRunnerOutput

        model = _heads_model(self)
        if model is None:
            return original(self, grammar_output)
        _prepare_runner(self, model)
        output = original(self, grammar_output)
        if type(output) is ModelRunnerOutput:
            drafts = self.take_draft_token_ids()
            if drafts is not None:
                output = copy.copy(output)  # never tag an output vLLM shares (e.g. its empty one)
                setattr(output, DRAFTS_ATTR, drafts if any(drafts.draft_token_ids) else NO_DRAFTS)
        return output

    return sample_tokens


def _drafts_delivered(original):
    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        drafts = getattr(model_runner_output, DRAFTS_ATTR, None)
        if drafts is not None:
            setattr(self, DRAFTS_ATTR, drafts)
        return outputs

    return update_from_output


def _no_draft_rpc(original):
    def post_step(self, model_executed):
        drafts = getattr(self.scheduler, DRAFTS_ATTR, None)
        if drafts is None:
            return original(self, model_executed)
        setattr(self.scheduler, DRAFTS_ATTR, None)
        if drafts != NO_DRAFTS:
            self.scheduler.update_draft_token_ids(drafts)

    return post_step


def _trust_clp_drafts(original):
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
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


def _greedy_verification(original):
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if getattr(self, OURS_ATTR, False) and argmax_decides(self, sampling_metadata):
            return verify_greedily(metadata, logits)
        return original(self, metadata, draft_probs, logits, sampling_metadata)

    return forward


def argmax_decides(rejection_sampler, sampling_metadata) -> bool:
    """Whether vLLM's rejection sampler would take every target and bonus token this step as
    its logits row's argmax, and return nothing else (no logprobs)."""
    return (sampling_metadata.all_greedy and sampling_metadata.max_num_logprobs is None
            and not sampling_metadata.logprob_token_ids and sampling_metadata.no_penalties
            and not sampling_metadata.bad_words_token_ids and sampling_metadata.allowed_token_ids_mask is None
            and not rejection_sampler.synthetic_mode and not getattr(rejection_sampler, TRUST_DRAFTS_ATTR, False)
            and not _thinking_budget_in_use(sampling_metadata)
            and all(map(_inactive, sampling_metadata.logitsprocs.non_argmax_invariant)))


def _inactive(processor) -> bool:
    """Whether a logits processor that can change an argmax leaves every row as it is this
    step: vLLM's min_tokens and logit_bias with no request using them; any other, never."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    if isinstance(processor, MinTokensLogitsProcessor):
        return not processor.min_toks
    if isinstance(processor, LogitBiasLogitsProcessor):
        return not processor.biases
    return False


def verify_greedily(metadata, logits: torch.Tensor):
    """vLLM's greedy verification (rejection_sample with all_greedy) on one argmax over every
    logits row: the target argmax at each draft position and the bonus token, in the dtypes
    RejectionSampler.forward hands its greedy kernel (a bf16 row's argmax is its float32
    copy's: the cast is exact, ties go to the first index alike)."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, _rejection_greedy_sample

    argmax = first_argmax(logits)
    output = torch.full((len(metadata.num_draft_tokens), metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                        dtype=torch.int32, device=logits.device)
    bonus = argmax[metadata.bonus_logits_indices].to(torch.int32).unsqueeze(-1)
    _rejection_greedy_sample(output, metadata.cu_num_draft_tokens, metadata.draft_token_ids,
                             argmax[metadata.target_logits_indices], bonus, None, metadata.max_spec_len, None, None)
    return SamplerOutput(sampled_token_ids=output, logprobs_tensors=None)


ARGMAX_CHUNK = 1024  # tokens per chunk of `first_argmax`'s first stage


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index of its largest value as torch's (a NaN counts as
    the largest), in two stages where the vocabulary holds two ARGMAX_CHUNK-token chunks or
    more: each chunk's max (the tokens past the last whole chunk form one more, shorter),
    then the argmax inside the first chunk holding the row's.

    torch's CPU argmax runs ~10x slower than a max over the same rows (one thread, 320 rows of
    SmolLM2's 49,152 tokens: 38 ms against 3.6; two stages 5.5), and verification takes one
    over K + 1 rows a request: SmolLM2's Clover with K = 4 spent 38 ms a step sampling at
    batch 64 (README, greedy verification)."""
    rows, vocab = logits.shape
    whole = vocab // ARGMAX_CHUNK
    if whole < 2 or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    chunks = logits[:, : whole * ARGMAX_CHUNK].view(rows, whole, ARGMAX_CHUNK)
    maxima = chunks.amax(dim=-1)
    tail = logits[:, whole * ARGMAX_CHUNK:]
    if tail.shape[-1]:  # last among the chunks, so a tie with a whole chunk goes to that one
        maxima = torch.cat([maxima, tail.amax(dim=-1, keepdim=True)], dim=-1)
    best = maxima.argmax(dim=-1)
    in_whole = best.clamp(max=whole - 1)
    index = in_whole * ARGMAX_CHUNK + chunks[torch.arange(rows, device=logits.device), in_whole].argmax(dim=-1)
    if tail.shape[-1]:
        index = torch.where(best == whole, whole * ARGMAX_CHUNK + tail.argmax(dim=-1), index)
    return index


def _plain_inputs_without_drafts(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if (scheduler_output.scheduled_spec_decode_tokens or _heads_model(self) is None
                or self.model_config.is_hybrid or _thinking_budget_in_use(self.input_batch.sampling_metadata)):
            return original(self, scheduler_output, num_scheduled_tokens)
        # The method takes its branch on `self.speculative_config is not None` and reads it
        # nowhere else; the runner's attention metadata and draft step, after it, see it.
        speculative_config, self.speculative_config = self.speculative_config, None
        try:
            return original(self, scheduler_output, num_scheduled_tokens)
        finally:
            self.speculative_config = speculative_config

    return _prepare_inputs


def _plain_sampling_without_drafts(original):
    def _sample(self, logits, spec_decode_metadata):
        if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                and _heads_model(self) is not None
                and not _thinking_budget_in_use(self.input_batch.sampling_metadata)):
            spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    return _sample


def _thinking_budget_in_use(sampling_metadata) -> bool:
    holder = sampling_metadata.thinking_budget_state_holder
    return holder is not None and holder.has_tracked_requests()


def _medusa_token_map(original):
    def load_weights(self, weights):
        loaded = original(self, weights)
        if getattr(self, "token_map", None) is not None:
            loaded.add("token_map")
        return loaded

    return load_weights


def _cpu_expand_float_params(original):
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    return expand_batch_to_tokens


def _cpu_top_k_without_drafts(original):
    def apply_top_k_only(logits, k):
        return logits if k.numel() == 0 else original(logits, k)

    return apply_top_k_only


def _cpu_seeded_prefill_chunks(original):
    def sample_tokens(self, grammar_output):
        generators = self.input_batch.generators
        if not generators or _heads_model(self) is None:
            return original(self, grammar_output)
        discarded = np.flatnonzero(self.discard_request_mask.np[: self.input_batch.num_reqs]).tolist()
        held = {i: generators.pop(i) for i in discarded if i in generators and generators[i].device.type == "cpu"}
        try:
            return original(self, grammar_output)
        finally:
            generators.update(held)

    return sample_tokens


PATCHES = (
    Patch("speculative_method_names", "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
          ("self", "target_model_config", "target_parallel_config"), _speculative_method_names),
    Patch("draft_with_clover_heads", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
          ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
           "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
           "slot_mappings"), _draft_with_clover_heads),
    Patch("draft_near_max_model_len", "vllm.v1.worker.gpu_model_runner:GPUModelRunner._input_fits_in_drafter",
          ("self", "common_attn_metadata"), _draft_near_max_model_len),
    Patch("warm_up_draft_model", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_run",
          ("self", "randomize_inputs"), _warm_up_draft_model),
    Patch("drafts_with_sampled_tokens", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
          ("self", "grammar_output"), _drafts_with_sampled_tokens),
    Patch("drafts_delivered", "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
          ("self", "scheduler_output", "model_runner_output"), _drafts_delivered),
    Patch("no_draft_rpc", "vllm.v1.engine.core:EngineCore.post_step", ("self", "model_executed"), _no_draft_rpc),
    Patch("trust_clp_drafts", "vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
          ("self", "metadata", "draft_probs", "logits", "sampling_metadata"), _trust_clp_drafts),
    Patch("greedy_verification", "vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
          ("self", "metadata", "draft_probs", "logits", "sampling_metadata"), _greedy_verification),
    Patch("plain_inputs_without_drafts", "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
          ("self", "scheduler_output", "num_scheduled_tokens"), _plain_inputs_without_drafts),
    Patch("plain_sampling_without_drafts", "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
          ("self", "logits", "spec_decode_metadata"), _plain_sampling_without_drafts),
    Patch("medusa_token_map", "vllm.model_executor.models.medusa:Medusa.load_weights",
          ("self", "weights"), _medusa_token_map),
    Patch("cpu_seeded_prefill_chunks", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
          ("self", "grammar_output"), _cpu_seeded_prefill_chunks),
)
CPU_WORKER_PATCHES = (
    Patch("cpu_expand_float_params", "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens",
          ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"), _cpu_expand_float_params),
    Patch("cpu_top_k_without_drafts", "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_only",
          ("logits", "k"), _cpu_top_k_without_drafts),
)


# (class, member) the runner hook (proposer.py, `_draft_with_clover_heads`) and the draft
# delivery read beyond the wrapped signatures: private runner state, the step metadata's
# fields, the engine core's scheduler.
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
RUNNER_READS = (
    (RUNNER, "_get_positions"), (RUNNER, "attn_groups"), (RUNNER, "rejection_sampler"), (RUNNER, "drafter"),
    (RUNNER, "get_model"), (RUNNER, "vllm_config"), (RUNNER, "_draft_probs"), (RUNNER, "_draft_prob_req_ids"),
    (RUNNER, "max_num_tokens"), (RUNNER, "max_model_len"), (RUNNER, "input_batch"), (RUNNER, "take_draft_token_ids"),
    (RUNNER, "discard_request_mask"), (RUNNER, "speculative_config"), (RUNNER, "model_config"),
    ("vllm.config.model:ModelConfig", "is_hybrid"), ("vllm.v1.worker.gpu_input_batch:InputBatch", "req_ids"),
    ("vllm.v1.worker.gpu_input_batch:InputBatch", "generators"),
    ("vllm.v1.worker.gpu_input_batch:InputBatch", "num_reqs"), ("vllm.v1.engine.core:EngineCore", "scheduler"),
    ("vllm.v1.core.sched.scheduler:Scheduler", "update_draft_token_ids"),
    ("vllm.v1.spec_decode.medusa:MedusaProposer", "dummy_run"),
    ("vllm.v1.worker.utils:AttentionGroup", "layer_names"), ("vllm.v1.worker.utils:AttentionGroup", "build_metadata"),
    ("vllm.v1.attention.backend:CommonAttentionMetadata", "query_start_loc_cpu"),
    ("vllm.v1.attention.backend:CommonAttentionMetadata", "num_actual_tokens"),
    ("vllm.v1.attention.backend:CommonAttentionMetadata", "max_seq_len"),
    ("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "num_draft_tokens"),
    ("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "target_logits_indices"),
    ("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "draft_token_ids"),
    ("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "max_spec_len"),
    ("vllm.v1.sample.metadata:SamplingMetadata", "thinking_budget_state_holder"),
    ("vllm.v1.core.sched.output:SchedulerOutput", "num_spec_tokens_to_schedule"),
    ("vllm.v1.core.sched.output:SchedulerOutput", "scheduled_spec_decode_tokens"),
    ("vllm.v1.spec_decode.medusa:MedusaProposer", "model"),
    # greedy_verification
    ("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "bonus_logits_indices"),
    ("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "cu_num_draft_tokens"),
    ("vllm.v1.sample.rejection_sampler:RejectionSampler", "synthetic_mode"),
    *(("vllm.v1.sample.metadata:SamplingMetadata", field) for field in (
        "all_greedy", "max_num_logprobs", "logprob_token_ids", "no_penalties", "bad_words_token_ids",
        "allowed_token_ids_mask", "logitsprocs")),
    ("vllm.v1.sample.logits_processor.state:LogitsProcessors", "non_argmax_invariant"),
    ("vllm.v1.sample.logits_processor.builtin:MinTokensLogitsProcessor", "min_toks"),
    ("vllm.v1.sample.logits_processor.builtin:LogitBiasLogitsProcessor", "biases"),
)


def has_member(cls: type, name: str) -> bool:
    """A class attribute or method, a dataclass field, or an attribute its code assigns on self."""
    if hasattr(cls, name) or (dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}):
        return True
    return re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=", inspect.getsource(cls)) is not None


def check_runner_reads(reads: tuple[tuple[str, str], ...] = RUNNER_READS) -> None:
    for target, name in reads:
        owner, attribute = _resolve(target)
        cls = getattr(owner, attribute)
        if not has_member(cls, name):
            raise VllmInternalsChanged(f"vllm-clover reads {target}.{name}, written for vLLM {SUPPORTED_VLLM}, "
                                       "but this vLLM has no such member")


def apply_all() -> None:
    check_runner_reads()
    for patch in PATCHES:
        patch.apply()
