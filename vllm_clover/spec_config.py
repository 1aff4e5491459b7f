"""What users write in `speculative_config`, and what vLLM is given instead.

vLLM 0.32 knows no "clover" or "clp" method, and its draft loader, scheduler and runner
only need to see one it already supports. Our checkpoints are `model_type: "medusa"`
directories whose `architectures` name our draft classes, so they travel through vLLM
as `method="medusa"` (the "carrier"): vLLM builds our registered class, keeps
synchronous scheduling (which per-request draft lengths need) and, on GPUs, the V1
model runner that our proposer hook lives in.

    {"method": "clover",    "model": HEADS, "num_speculative_tokens": K}
    {"method": "clp",       "model": HEADS}   verified: output equals plain decoding
    {"method": "clp-trust", "model": HEADS}   the CLP paper's mode: drafts accepted unverified (lossy)
    {"method": "clp", "model": HEADS, "clp_tau": 0.3}   CLP with another threshold than the checkpoint's
    {"model": HEADS} or {"method": "medusa" / "eagle", ...} with our heads: the checkpoint's method
        (Medusa and EAGLE drafts run in vLLM's own proposers; the plugin only checks them)
    {"method": "clover", "model": HEADS, "draft_policy": "fixed"}   always the full budget
        (default "goodput": lengths per request and step that pay for themselves, draft_policy.py;
        clp-trust is always "fixed")

The names and options come from the method table (methods.py).

Everything that can be wrong with a heads directory is checked here, in the process that
builds the config, so it surfaces as one exception from `LLM(...)` / `vllm serve`
instead of a traceback in a worker.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_clover.checkpoint import CONFIG, build_heads_module, load_heads, read_calibration
from vllm_clover.draft_policy import DEFAULT_POLICY, check_policy
from vllm_clover.errors import CheckpointError, SpecConfigError
from vllm_clover.hub import is_hub_id, local_dir
from vllm_clover.methods import (
    BY_NAME,
    SERVING_NAMES,
    VLLM_SERVED,
    DraftMethod,
    all_serving_option_keys,
    serving_overrides,
)

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: the one with a handler

CARRIER = "medusa"
# Where the serving options ride to the workers: an attribute of the draft's hf_config,
# which vLLM pickles into every engine process along with the rest of VllmConfig.
SERVING_ATTR = "vllm_clover_serving"
DRAFT_POLICY = "draft_policy"  # a speculative_config key of every plugin-served method


@dataclass(frozen=True)
class ServingOptions:
    method: str                 # the table entry (methods.TABLE) whose heads are served
    trust_drafts: bool          # accept drafts without verification (CLP paper mode)
    hyper_overrides: dict = field(default_factory=dict)  # from speculative_config, e.g. {"tau": 0.3}
    draft_policy: str = DEFAULT_POLICY  # draft_policy.POLICIES


def our_heads_config(model: object, revision: str | None = None, download_dir: str | None = None) -> dict | None:
    """config.json of a heads directory (a path or a Hub id) written by vllm-clover-train, else
    None. Of a Hub id only config.json is fetched: the model may not be ours at all."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    try:
        directory = local_dir(model, "heads", revision, download_dir, files=(CONFIG,))
    except CheckpointError:
        return None  # not ours to judge; vLLM reports its own error
    if not (directory / CONFIG).is_file():
        return None
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # not ours to judge; vLLM reports its own error
    return config if isinstance(config, dict) and "vllm_clover" in config else None


def resolve(spec: dict, target_model: str, target_revision: str | None = None,
            download_dir: str | None = None) -> tuple[dict, ServingOptions | None]:
    """(the dict to hand vLLM, our serving options or None when our plugin does not serve it).

    Specs that are not ours are returned untouched, so vLLM behaves exactly as without
    the plugin for every other method and checkpoint. Heads and base given as Hub ids are
    fetched (or found in the cache) here, and vLLM is handed the heads' local snapshot: the
    files it serves are the ones checked.
    """
    name, revision = spec.get("method"), spec.get("revision")
    if name not in SERVING_NAMES and not (name in (None, *VLLM_SERVED)
                                          and our_heads_config(spec.get("model"), revision, download_dir)):
        return spec, None
    option_keys = all_serving_option_keys() | {DRAFT_POLICY}
    ours = {key: spec[key] for key in option_keys if key in spec}
    spec = {key: value for key, value in spec.items() if key not in option_keys}
    heads_dir = spec.get("model")
    if not heads_dir:
        raise SpecConfigError(f'speculative_config method {name!r} needs "model": a heads directory '
                              "written by vllm-clover-train")
    heads_dir = local_dir(heads_dir, "heads", revision, download_dir)
    base_dir = base_directory(target_model, target_revision, download_dir)
    config, tensors = load_heads(heads_dir, base_dir)
    method = BY_NAME[config["vllm_clover"]["method"]]
    wanted = heads_wanted(name)
    if wanted is not None and wanted is not method:
        use = method.vllm_method or method.name
        raise SpecConfigError(f"speculative_config method {name!r} needs {wanted.name} heads, but "
                              f"{heads_dir / CONFIG} holds {method.name} heads (use method {use!r})")
    build_heads_module(heads_dir, config, tensors)  # every tensor present, with its shape
    if method.served_by_plugin:
        read_calibration(heads_dir, config["num_heads"])  # the goodput policy's prior, if any
    check_num_speculative_tokens(spec, config, heads_dir)
    policy_given = DRAFT_POLICY in ours
    policy = ours.pop(DRAFT_POLICY, DEFAULT_POLICY)
    overrides = option_overrides(ours, method)
    if not method.served_by_plugin:
        if policy_given:
            raise SpecConfigError(f"{DRAFT_POLICY} is an option of the plugin's methods "
                                  f"({', '.join(m.name for m in BY_NAME.values() if m.served_by_plugin)}), "
                                  f"not of {method.name} heads, which vLLM's own proposer serves")
        return {**spec, "method": method.vllm_method}, None  # vLLM's own proposer runs them (Medusa, EAGLE)
    trust = SERVING_NAMES[name][1] if name in SERVING_NAMES else False
    policy = serving_policy(policy, policy_given, trust, name)
    check_runner()
    return {**spec, "model": str(heads_dir), "method": CARRIER}, ServingOptions(method.name, trust, overrides, policy)


def base_directory(target_model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The base's local directory, to check the heads against; None where vLLM loads the base
    from something else (a GGUF file, ModelScope): then vLLM's own errors speak for it."""
    if Path(target_model).is_dir():
        return Path(target_model)
    if not is_hub_id(target_model):
        return None
    try:
        return local_dir(target_model, "base model", revision, download_dir)
    except CheckpointError as e:
        logger.warning("vllm-clover: heads not checked against the base model: %s", e)
        return None


def heads_wanted(name: str | None) -> DraftMethod | None:
    """The method whose heads a speculative_config method name serves; None for any of ours:
    no name, or the medusa carrier, which vLLM's own processes hand back with any of our heads."""
    if name in SERVING_NAMES:
        return SERVING_NAMES[name][0]
    return VLLM_SERVED.get(name) if name != CARRIER else None


def serving_policy(policy: object, given: bool, trust: bool, name: str | None) -> str:
    """The draft_policy an engine runs. Unverified drafts are always "accepted", so the goodput
    policy would learn that every draft pays and draft K unchecked tokens at any load: trusted
    methods keep their own rule (the CLP paper's threshold) and refuse "goodput"."""
    try:
        policy = check_policy(policy)
    except ValueError as e:
        raise SpecConfigError(str(e)) from None
    if trust and given and policy == "goodput":
        raise SpecConfigError(f"draft_policy 'goodput' learns from verified drafts; method {name!r} accepts "
                              "drafts unverified, use 'fixed' (its default)")
    return "fixed" if trust else policy


def option_overrides(ours: dict, method: DraftMethod) -> dict:
    accepted = {option.key for option in method.serving_options}
    for key in sorted(set(ours) - accepted):
        owners = [m.name for m in BY_NAME.values() if key in {o.key for o in m.serving_options}]
        raise SpecConfigError(f"{key} is an option of {' / '.join(owners)} heads, not of {method.name} heads")
    return serving_overrides(method, ours)


def check_num_speculative_tokens(spec: dict, config: dict, heads_dir: Path) -> None:
    k, heads = spec.get("num_speculative_tokens"), config.get("num_heads")  # EAGLE drafts any K: no num_heads
    if k is not None and heads is not None and not 1 <= k <= heads:
        raise SpecConfigError(f"num_speculative_tokens is {k}, but {heads_dir} has {heads} draft heads "
                              f"(n_predict in {heads_dir / CONFIG}); use 1..{heads}")


def check_runner() -> None:
    """Our proposer hooks the V1 model runner. vLLM picks it for medusa-carried methods
    unless the user forces Model Runner V2, which would fail later without saying why."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise SpecConfigError("vllm-clover's proposers run in vLLM's V1 model runner, but "
                              "VLLM_USE_V2_MODEL_RUNNER forces Model Runner V2; unset it")


def attach(speculative_config, options: ServingOptions) -> None:
    """Hand the options to the draft model, in whatever process builds it."""
    setattr(speculative_config.draft_model_config.hf_config, SERVING_ATTR, asdict(options))


def serving_options(draft_hf_config) -> ServingOptions:
    found = getattr(draft_hf_config, SERVING_ATTR, None)
    if found is None:  # a medusa-typed spec that bypassed `resolve` (no vllm_clover in config.json)
        return ServingOptions(draft_hf_config.vllm_clover["method"], trust_drafts=False)
    return ServingOptions(**found)
