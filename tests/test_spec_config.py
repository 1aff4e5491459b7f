"""What users write in speculative_config, as vLLM's own config code sees it (no engine).

These go through `EngineArgs.create_engine_config`, the call `LLM(...)` and `vllm serve`
make before starting any process, so the errors here are the ones users get.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm.engine.arg_utils import EngineArgs

import vllm_clover
from conftest import DEMO_HEADS, ENGINE_DEFAULTS, speculative
from vllm_clover.errors import CheckpointError, SpecConfigError, VllmCloverError, VllmInternalsChanged
from vllm_clover.patches import (
    DRAFTS_ATTR,
    NO_DRAFTS,
    PATCHES,
    PREPARED_ATTR,
    RUNNER_READS,
    Patch,
    check_runner_reads,
    point_mass_on_drafts,
)
from vllm_clover.spec_config import SERVING_ATTR, resolve


def engine_config(base, spec):
    return EngineArgs(model=str(base), speculative_config=spec, **ENGINE_DEFAULTS).create_engine_config()


@pytest.fixture(scope="module", autouse=True)
def plugin_loaded():
    vllm_clover.register()  # what vLLM's plugin loader does in every process


@pytest.fixture
def heads_copy(tmp_path):
    def copy(method):
        dest = tmp_path / method
        shutil.copytree(DEMO_HEADS / method, dest)
        return dest
    return copy


@pytest.mark.parametrize("method,arch,trust", [("clover", "CloverDraftModel", False),
                                               ("clp", "ClpDraftModel", False),
                                               ("clp-trust", "ClpDraftModel", True)])
def test_our_method_names_ride_the_medusa_carrier(demo_base, method, arch, trust):
    config = engine_config(demo_base, speculative(method))
    spec = config.speculative_config
    assert spec.method == "medusa"
    assert spec.num_speculative_tokens == 4
    assert spec.draft_model_config.architectures == [arch]
    assert getattr(spec.draft_model_config.hf_config, SERVING_ATTR) == {
        "method": method.removesuffix("-trust"), "trust_drafts": trust, "hyper_overrides": {},
        "draft_policy": "fixed" if trust else "goodput"}
    # GPUs default to Model Runner V2, where our runner hook does not exist; vLLM falls back
    # to the V1 runner for the features it lists here, and our methods must stay on that list.
    assert "speculative method 'medusa'" in config._get_v2_model_runner_unsupported_features()
    assert config.scheduler_config.async_scheduling is False  # per-request draft lengths need sync


def test_method_can_be_omitted_and_k_defaults_to_the_head_count(demo_base):
    spec = engine_config(demo_base, {"model": str(DEMO_HEADS / "clover")}).speculative_config
    assert spec.method == "medusa" and spec.num_speculative_tokens == 4
    assert getattr(spec.draft_model_config.hf_config, SERVING_ATTR)["method"] == "clover"


def test_medusa_heads_go_to_vllms_own_medusa(demo_base):
    spec = engine_config(demo_base, speculative("medusa")).speculative_config
    assert spec.draft_model_config.architectures == ["MedusaModel"]
    assert not hasattr(spec.draft_model_config.hf_config, SERVING_ATTR)


def test_eagle_drafts_go_to_vllms_own_eagle_checked_first(demo_base, heads_copy):
    spec = engine_config(demo_base, speculative("eagle", k=6)).speculative_config  # EAGLE drafts any K
    assert spec.method == "eagle" and spec.num_speculative_tokens == 6
    assert spec.draft_model_config.architectures == ["EagleLlamaForCausalLM"]
    assert not hasattr(spec.draft_model_config.hf_config, SERVING_ATTR)
    with pytest.raises(SpecConfigError, match=r"method 'clover' needs clover heads, but .* holds eagle heads "
                                              r"\(use method 'eagle'\)"):
        engine_config(demo_base, {**speculative("eagle"), "method": "clover"})
    with pytest.raises(SpecConfigError, match=r"method 'eagle' needs eagle heads, but .* holds clover heads"):
        engine_config(demo_base, {**speculative("clover"), "method": "eagle"})
    heads = heads_copy("eagle")
    config = json.loads((heads / "config.json").read_text())
    config["vllm_clover"]["base"]["hidden_size"] = 576
    (heads / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="trained for another base model: hidden_size"):
        engine_config(demo_base, {"method": "eagle", "model": str(heads)})


def test_specs_that_are_not_ours_pass_through_untouched(demo_base):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert resolve(spec, str(demo_base)) == (spec, None)
    assert engine_config(demo_base, dict(spec)).speculative_config.method == "ngram"


def test_clp_threshold_can_be_set_per_engine(demo_base):
    spec = engine_config(demo_base, {**speculative("clp"), "clp_tau": 0.3}).speculative_config
    assert getattr(spec.draft_model_config.hf_config, SERVING_ATTR)["hyper_overrides"] == {"tau": 0.3}
    with pytest.raises(SpecConfigError, match=r"clp_tau must be a number in \(0, 1\], got 2"):
        engine_config(demo_base, {**speculative("clp"), "clp_tau": 2})
    with pytest.raises(SpecConfigError, match="clp_tau is an option of clp heads, not of clover heads"):
        engine_config(demo_base, {**speculative("clover"), "clp_tau": 0.3})


def test_draft_policy_is_goodput_unless_fixed_is_asked_for(demo_base):
    spec = engine_config(demo_base, {**speculative("clover"), "draft_policy": "fixed"}).speculative_config
    assert getattr(spec.draft_model_config.hf_config, SERVING_ATTR)["draft_policy"] == "fixed"
    with pytest.raises(SpecConfigError, match="draft_policy must be one of 'goodput', 'fixed', got 'always'"):
        engine_config(demo_base, {**speculative("clp"), "draft_policy": "always"})
    with pytest.raises(SpecConfigError, match="draft_policy 'goodput' learns from verified drafts; "
                                              "method 'clp-trust' accepts drafts unverified"):
        engine_config(demo_base, {**speculative("clp-trust"), "draft_policy": "goodput"})
    with pytest.raises(SpecConfigError, match="draft_policy is an option of the plugin's methods "
                                              r"\(clover, clp\), not of medusa heads"):
        engine_config(demo_base, {**speculative("medusa"), "draft_policy": "fixed"})


def test_too_many_speculative_tokens(demo_base):
    with pytest.raises(SpecConfigError, match=r"num_speculative_tokens is 6, but .*clover has 4 draft heads"):
        engine_config(demo_base, speculative("clover", k=6))


def test_method_and_heads_must_agree(demo_base):
    with pytest.raises(SpecConfigError, match=r"method 'clover' needs clover heads, but .* holds clp heads"):
        engine_config(demo_base, {**speculative("clp"), "method": "clover"})


def test_heads_for_another_base(demo_base, heads_copy):
    heads = heads_copy("clover")
    config = json.loads((heads / "config.json").read_text())
    config["vllm_clover"]["base"]["lm_head_sha256"] = "0" * 64
    (heads / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="trained for another base model: lm_head_sha256"):
        engine_config(demo_base, {"method": "clover", "model": str(heads)})


def test_missing_tensor(demo_base, heads_copy):
    from vllm import LLM

    heads = heads_copy("clp")
    tensors = load_file(heads / "model.safetensors")
    del tensors["length.weight"]
    save_file(tensors, heads / "model.safetensors")
    # Through LLM(...) itself: the error comes before any engine process starts.
    with pytest.raises(CheckpointError, match=r"tensor 'length.weight' missing from .*clp/model.safetensors"):
        LLM(model=str(demo_base), speculative_config={"method": "clp", "model": str(heads)}, **ENGINE_DEFAULTS)


def test_truncated_weights_are_one_error_naming_the_file(demo_base, heads_copy):
    heads = heads_copy("clover")
    weights = heads / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"clover/model.safetensors is not a readable safetensors file") as error:
        engine_config(demo_base, {"method": "clover", "model": str(heads)})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text,message", [
    ("{", r"clover/calibration.json is not a calibration table .*JSONDecodeError"),
    ('{"tried": [], "accepted": []}', r"clover/calibration.json is not a calibration table .*KeyError"),
    ('{"confidence_bins": 10, "tried": [[1, 2]], "accepted": [[0, 1]]}',
     r"clover/calibration.json: expected tried and accepted of shape \(4, 10\) .* found \{'tried': \(1, 2\)"),
])
def test_a_bad_calibration_table_is_one_error_naming_the_file(demo_base, heads_copy, text, message):
    heads = heads_copy("clover")
    (heads / "calibration.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        engine_config(demo_base, {"method": "clover", "model": str(heads)})


def test_forcing_model_runner_v2_is_refused(demo_base, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(SpecConfigError, match="unset it"):
        engine_config(demo_base, speculative("clover"))


def test_every_patch_is_applied_once_and_named():
    for patch in PATCHES:
        method = patch.original()
        assert patch.is_applied()
        patch.apply()  # idempotent: applying again does not wrap twice
        assert patch.original() is method
    assert len({patch.name for patch in PATCHES}) == len(PATCHES)


class _Changed:
    def create_speculative_config(self, target_model_config):
        pass


def test_a_changed_vllm_signature_is_refused_by_name():
    patch = Patch("speculative_method_names", f"{__name__}:_Changed.create_speculative_config",
                  ("self", "target_model_config", "target_parallel_config"), lambda original: original)
    with pytest.raises(VllmInternalsChanged, match="'speculative_method_names' was written for vLLM 0.32"):
        patch.apply()


def test_every_runner_member_the_hook_reads_is_checked():
    check_runner_reads()  # vLLM 0.32 has them all (apply_all ran this too)
    gone = (("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "_get_positions_renamed"),)
    with pytest.raises(VllmInternalsChanged, match=r"reads .*GPUModelRunner._get_positions_renamed"):
        check_runner_reads(gone)
    assert ("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "attn_groups") in RUNNER_READS


def test_our_errors_share_one_base():
    for error in (CheckpointError, SpecConfigError, VllmInternalsChanged):
        assert issubclass(error, VllmCloverError)
    assert not issubclass(SpecConfigError, CheckpointError)


def test_cpu_expansion_keeps_float_values():
    from vllm_clover.patches import CPU_WORKER_PATCHES

    expand = CPU_WORKER_PATCHES[0].wrap(None)
    temperature = torch.tensor([0.8, 0.0, 1.3])
    cu_num_tokens = torch.tensor([2, 2, 5])
    expanded = expand(temperature, cu_num_tokens, 5, replace_from=0.0, replace_to=1.0)
    assert expanded.tolist() == pytest.approx([0.8, 0.8, 1.3, 1.3, 1.3])


def test_cpu_top_k_filters_nothing_when_no_row_is_verified():
    from vllm_clover.patches import CPU_WORKER_PATCHES

    calls = []
    top_k = CPU_WORKER_PATCHES[1].wrap(lambda logits, k: calls.append(k) or logits[:, :1])
    no_rows = torch.zeros(0, 7)
    assert top_k(no_rows, torch.zeros(0, dtype=torch.long)) is no_rows and calls == []
    rows = torch.randn(2, 7)
    assert top_k(rows, torch.tensor([3, 3])).shape == (2, 1) and len(calls) == 1


def test_trust_mode_makes_each_draft_the_only_choice():
    logits = torch.randn(5, 7)
    rows, drafts = torch.tensor([0, 1, 3]), torch.tensor([6, 2, 4])
    forced = point_mass_on_drafts(logits, rows, drafts)
    assert forced[rows].argmax(-1).tolist() == drafts.tolist()
    assert forced[rows].softmax(-1).max(-1).values.tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(forced[[2, 4]], logits[[2, 4]])  # bonus rows untouched


def test_drafts_reach_the_scheduler_with_the_sampled_tokens():
    """The worker attaches our runner's drafts to the step's output; the scheduler takes them
    from there and post_step skips its round trip to the worker, and for a step that drafted
    nothing, the update too. Other runners' outputs, and steps whose output carried no
    drafts, keep vLLM's own path."""
    import pickle
    from types import SimpleNamespace

    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    from vllm_clover.vllm_models import HeadsDraftModel

    wrapped = {p.name: p.wrap for p in PATCHES}
    drafts = DraftTokenIds(["a", "b"], [[5, 6], []])
    shared = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})

    class Runner:
        def take_draft_token_ids(self):
            return drafts

    ours = Runner()
    ours.drafter = SimpleNamespace(model=HeadsDraftModel.__new__(HeadsDraftModel))  # a runner drafting with ours
    setattr(ours, PREPARED_ATTR, True)  # _prepare_runner ran at its first step
    sample_tokens = wrapped["drafts_with_sampled_tokens"](lambda runner, grammar_output: shared)
    assert sample_tokens(Runner(), None) is shared  # not one of our runners
    output = pickle.loads(pickle.dumps(sample_tokens(ours, None)))  # as the worker's queue sends it
    assert getattr(output, DRAFTS_ATTR).draft_token_ids == [[5, 6], []] and not hasattr(shared, DRAFTS_ATTR)

    class Scheduler:
        def __init__(self):
            self.updates = []

        def update_draft_token_ids(self, draft_token_ids):
            self.updates.append(draft_token_ids.draft_token_ids)

    class EngineCore:
        scheduler = Scheduler()

    rpcs = []
    update_from_output = wrapped["drafts_delivered"](lambda scheduler, scheduler_output, model_output: "outputs")
    post_step = wrapped["no_draft_rpc"](lambda core, model_executed: rpcs.append(model_executed))
    core = EngineCore()
    assert update_from_output(core.scheduler, None, output) == "outputs"
    post_step(core, True)
    assert core.scheduler.updates == [[[5, 6], []]] and rpcs == []
    update_from_output(core.scheduler, None, shared)  # an output without drafts: vLLM's RPC
    post_step(core, True)
    assert core.scheduler.updates == [[[5, 6], []]] and rpcs == [True]

    drafts = DraftTokenIds(["a", "b"], [[], []])  # a step that drafted nothing
    nothing = pickle.loads(pickle.dumps(sample_tokens(ours, None)))
    assert getattr(nothing, DRAFTS_ATTR) == NO_DRAFTS
    update_from_output(core.scheduler, None, nothing)
    post_step(core, True)
    assert core.scheduler.updates == [[[5, 6], []]] and rpcs == [True]  # neither an update nor the RPC


def test_steps_without_drafts_prepare_inputs_like_plain_decoding():
    """Our runners prepare a step with no scheduled drafts as an engine without speculation
    does (vLLM's branch on `speculative_config is None`), and have their speculative config
    back after it, also when preparing fails; steps with drafts, other runners, hybrid targets
    and requests under a thinking budget keep vLLM's speculative branch."""
    from types import SimpleNamespace

    from vllm_clover.vllm_models import HeadsDraftModel

    def prepare(runner, scheduler_output, num_scheduled_tokens):
        if num_scheduled_tokens == "fail":
            raise ValueError("preparing failed")
        return runner.speculative_config

    prepare_inputs = {p.name: p.wrap for p in PATCHES}["plain_inputs_without_drafts"](prepare)
    no_budget = SimpleNamespace(thinking_budget_state_holder=None)
    budget = SimpleNamespace(thinking_budget_state_holder=SimpleNamespace(has_tracked_requests=lambda: True))
    ours, spec = HeadsDraftModel.__new__(HeadsDraftModel), object()

    def runner(model=ours, hybrid=False, sampling_metadata=no_budget):
        return SimpleNamespace(drafter=SimpleNamespace(model=model), speculative_config=spec,
                               model_config=SimpleNamespace(is_hybrid=hybrid),
                               input_batch=SimpleNamespace(sampling_metadata=sampling_metadata))

    no_drafts = SimpleNamespace(scheduled_spec_decode_tokens={})
    drafts = SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6]})
    plain = runner()
    assert prepare_inputs(plain, no_drafts, None) is None and plain.speculative_config is spec
    with pytest.raises(ValueError, match="preparing failed"):
        prepare_inputs(plain, no_drafts, "fail")
    assert plain.speculative_config is spec
    assert prepare_inputs(runner(), drafts, None) is spec
    assert prepare_inputs(runner(model=object()), no_drafts, None) is spec  # vLLM's own drafters
    assert prepare_inputs(runner(hybrid=True), no_drafts, None) is spec
    assert prepare_inputs(runner(sampling_metadata=budget), no_drafts, None) is spec


def test_steps_without_drafts_sample_like_plain_decoding():
    """Our runners sample a step in which no request has a draft with vLLM's plain sampler
    (no spec-decode metadata), as an engine without speculation would; steps with drafts,
    other runners and requests under a thinking budget keep the rejection sampler."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_clover.vllm_models import HeadsDraftModel

    sample = {p.name: p.wrap for p in PATCHES}["plain_sampling_without_drafts"](
        lambda runner, logits, spec_decode_metadata: spec_decode_metadata)
    no_budget = SimpleNamespace(thinking_budget_state_holder=None)
    budget = SimpleNamespace(thinking_budget_state_holder=SimpleNamespace(has_tracked_requests=lambda: True))

    def runner(model, sampling_metadata=no_budget):
        return SimpleNamespace(drafter=SimpleNamespace(model=model),
                               input_batch=SimpleNamespace(sampling_metadata=sampling_metadata))

    ours = HeadsDraftModel.__new__(HeadsDraftModel)
    no_drafts = SpecDecodeMetadata.make_dummy([[], []], device=torch.device("cpu"))
    drafts = SpecDecodeMetadata.make_dummy([[5, 6], []], device=torch.device("cpu"))
    assert sample(runner(ours), None, no_drafts) is None
    assert sample(runner(ours), None, drafts) is drafts
    assert sample(runner(object()), None, no_drafts) is no_drafts  # vLLM's own drafters
    assert sample(runner(ours, budget), None, no_drafts) is no_drafts
    assert sample(runner(ours), None, None) is None  # a step vLLM already samples plainly


@pytest.mark.parametrize("vocab", [4096, 49152, 1000, 32000, 151936])
def test_the_two_stage_argmax_is_torchs_ties_and_nans_included(vocab):
    from vllm_clover.patches import first_argmax

    logits = torch.randn(40, vocab, generator=torch.Generator().manual_seed(vocab))
    top = logits.max() + 1
    logits[0, [5, vocab - 3]] = top            # a tie across chunks: the first index
    logits[1, [vocab // 2, vocab // 2 + 1]] = top  # a tie inside a chunk
    logits[2, :] = 0.0                          # every token tied: index 0
    logits[3, 7], logits[3, vocab - 1] = float("nan"), top  # a NaN counts as the largest
    logits[4, [vocab - 2, 9]] = float("nan")    # the first NaN
    assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(first_argmax(logits[:, : vocab // 2]), logits[:, : vocab // 2].argmax(dim=-1))  # not contiguous


def test_greedy_verification_takes_the_tokens_vllms_rejection_sampler_takes():
    """Our runners' rejection sampler, all requests greedy, verifies on one argmax over the
    logits rows and gives vLLM's own output token for token: drafts that match the target's
    argmax accepted up to the first that does not, the bonus token after a fully accepted
    run, placeholders after a rejection; ties go to the first index, as vLLM's do. A request
    with logprobs, or an active logit_bias, keeps vLLM's path."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_clover.patches import OURS_ATTR, argmax_decides

    current_platform.register_triton_kernel_overrides()  # what a CPU worker does: vLLM's C++ kernels
    vocab, rng = 64, torch.Generator().manual_seed(0)
    drafts = [[3, 9, 1], [], [7], [2, 2, 2, 2]]  # logits rows: each request's drafts, then its bonus row
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.tensor([3, 9, 1, 7, 2, 2, 2, 2], dtype=torch.int32), num_draft_tokens=[3, 0, 1, 4],
        cu_num_draft_tokens=torch.tensor([3, 3, 4, 8], dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor([4, 5, 7, 12], dtype=torch.int32),
        target_logits_indices=torch.tensor([0, 1, 2, 5, 7, 8, 9, 10], dtype=torch.int32),
        bonus_logits_indices=torch.tensor([3, 4, 6, 11], dtype=torch.int32), logits_indices=torch.arange(12))
    logits = torch.randn(sum(map(len, drafts)) + len(drafts), vocab, generator=rng)
    logits[0, 3] = logits[1, 9] = 10.0               # request 0: two accepted, the third rejected
    logits[5, 7] = 10.0                              # request 2: accepted, then its bonus token
    logits[7:11, 2] = 10.0                           # request 3: all four accepted,
    logits[11, :] = 0.0                              # and its bonus row a tie: index 0
    bias = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)

    def sampling(**changes) -> SamplingMetadata:
        fields = dict(temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
                      max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                      frequency_penalties=torch.zeros(4), presence_penalties=torch.zeros(4),
                      repetition_penalties=torch.ones(4), output_token_ids=[[] for _ in drafts],
                      allowed_token_ids_mask=None, bad_words_token_ids={},
                      logitsprocs=LogitsProcessors([bias]), spec_token_ids=drafts)
        return SamplingMetadata(**{**fields, **changes})

    vllms, ours = RejectionSampler(Sampler()), RejectionSampler(Sampler())
    setattr(ours, OURS_ATTR, True)
    expected = vllms(metadata, None, logits.clone(), sampling()).sampled_token_ids  # no flag: vLLM's path
    forward = {p.name: p.wrap for p in PATCHES}["greedy_verification"](lambda *args: "vLLM's path")
    assert torch.equal(forward(ours, metadata, None, logits.clone(), sampling()).sampled_token_ids, expected)
    assert forward(vllms, metadata, None, logits, sampling()) == "vLLM's path"  # not our runner's
    assert forward(ours, metadata, None, logits, sampling(max_num_logprobs=0)) == "vLLM's path"
    assert expected.tolist() == [[3, 9, int(logits[2].argmax()), -1, -1], [int(logits[4].argmax()), -1, -1, -1, -1],
                                 [7, int(logits[6].argmax()), -1, -1, -1], [2, 2, 2, 2, 0]]
    bias.biases = {0: {5: 1.0}}
    assert not argmax_decides(ours, sampling())
    assert not argmax_decides(SimpleNamespace(synthetic_mode=False), sampling(all_greedy=False, all_random=True))
