"""The method table: everything that differs between draft methods, one record each.

The trainer, the checkpoint format, the speculative_config names, vLLM's model registry
and the benchmarks all read `TABLE`; nothing else branches on a method's name. Adding a
method is one module with its heads (implementing `DraftHeads`) and one entry here.

vLLM-free: importing this module imports torch and our heads modules, never vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

import torch

from vllm_clover.clover import CloverHeads
from vllm_clover.clp import ClpHeads
from vllm_clover.draft_policy import GoodputPolicy
from vllm_clover.eagle import EagleDraft
from vllm_clover.errors import CheckpointError, SpecConfigError
from vllm_clover.layers import LmHead, MakeScorer
from vllm_clover.medusa import MedusaHeads


class HeadOutputs(NamedTuple):
    """What every heads module's forward returns in training (a plain tuple of these fields
    in this order, the last ones optional)."""

    logits: list[torch.Tensor]                  # per draft head i (1-based): [B, T-1-i, V] (N with a
    #                                             draft vocabulary), labelled by layers.head_labels(labels, i)
    length_logits: torch.Tensor | None = None   # CLP's length predictor: [B, T, K+1]
    feature_loss: torch.Tensor | None = None    # EAGLE's weighted feature regression per position [B, T-2]


class FrozenBaseView(Protocol):
    """What heads take from the base model when they are first built (training/base.py)."""

    config: Any                  # the base's Hugging Face config
    lm_head_weight: torch.Tensor

    def last_layer_state(self) -> dict[str, torch.Tensor]: ...

    def final_norm_weight(self) -> torch.Tensor: ...


class DraftHeads(Protocol):
    """The interface of a method's vLLM-free heads module (clover.py, clp.py, medusa.py)."""

    num_heads: int

    @classmethod
    def from_base(cls, base: FrozenBaseView, num_heads: int, hyper: dict,
                  draft_vocab: torch.Tensor | None = None) -> DraftHeads:
        """Fresh heads for training, initialised from the base where the method says so; with
        `draft_vocab` (token ids, for methods whose table entry allows it) they score only those."""

    @classmethod
    def from_checkpoint(cls, config: dict) -> DraftHeads:
        """Empty heads of the shape a checkpoint's config.json describes."""

    def checkpoint_hyper(self) -> dict:
        """config.json's vllm_clover.hyper: what `from_checkpoint` needs besides the base's sizes."""

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """model.safetensors: the tensor names the serving side loads."""

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def vllm_config(self) -> dict:
        """config.json keys that vLLM's own draft model reads: extra to the medusa-typed config,
        or the whole config when the table entry says `medusa_typed=False`."""

    def forward(self, h_base: torch.Tensor, input_ids: torch.Tensor, lm_head_weight: torch.Tensor,
                embed_weight: torch.Tensor | None = None) -> HeadOutputs:
        """Training: all heads at all positions, teacher-forced (see clover.py's shift).
        `embed_weight`: the base's input embedding, for drafts that read it (EAGLE)."""

    def parameters_read_per_step(self, hidden_size: int, vocab_size: int) -> int:
        """Weights one draft step reads, the base's LM-head rows it scores included: what bounds
        a draft step at small batches, to compare with the target's own parameters."""

    def output_head(self, lm_head: LmHead, make_scorer: MakeScorer | None = None) -> LmHead:
        """Serving (plugin-served methods only): the LM head to draft through, built once from
        the base's (a draft-vocabulary view of it, scored by `make_scorer(rows)` if given, or
        the head itself)."""

    def draft_confidence(self, logits: list[torch.Tensor], length_logits: torch.Tensor | None,
                         positions: int) -> torch.Tensor:
        """Training (plugin-served methods only), from HeadOutputs' logits and length_logits:
        each draft's confidence as the goodput policy reads it when serving, at the first
        `positions` positions: [B, positions, K]. Held-out
        acceptance per confidence is the policy's prior (draft_policy.calibration_counts)."""

    def draft_depth(self, budgets: list[int], policy: GoodputPolicy | None = None) -> int:
        """Serving (plugin-served methods only), before the draft states are built: at most
        how many tokens any row drafts this step; 0 skips building them and `propose`."""

    def propose(self, h: torch.Tensor, next_token: torch.Tensor, lm_head: LmHead, budgets: list[int],
                policy: GoodputPolicy | None = None) -> list[list[int]]:
        """Serving (plugin-served methods only): up to budgets[r] draft tokens for row r.
        h [R, H] is the (augmented) hidden state at each request's last accepted token,
        next_token [R] the token the target just sampled there, lm_head `output_head(...)`;
        `policy` (draft_policy.py) chooses the lengths, None keeps the method's own rule."""


@dataclass(frozen=True)
class TrainOption:
    """A method-specific flag of `vllm-clover-train METHOD`, stored as hyper[hyper_key]."""

    flag: str
    hyper_key: str
    argparse: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ServingOption:
    """A key users may add to speculative_config for this method; `check` returns the value
    to use or raises ValueError saying what is wrong. It overrides hyper[hyper_key]."""

    key: str
    hyper_key: str
    check: Callable[[Any], Any]


@dataclass(frozen=True)
class DraftMethod:
    name: str                            # config.json's vllm_clover.method and the CLI subcommand
    heads: type                          # implements DraftHeads
    description: str
    # What vLLM's model registry builds for these heads: one of ours (registered to
    # vllm_models.HeadsDraftModel, run by our runner hook) or vLLM's own (e.g. MedusaModel).
    architecture: str
    served_by_plugin: bool
    # config.json is medusa-typed (vLLM's draft loader routes it to `architecture`); False: the
    # heads' vllm_config() is the whole config (EAGLE: a one-layer Llama vLLM renames itself).
    medusa_typed: bool = True
    # The speculative_config method under which vLLM's own proposer serves these heads.
    vllm_method: str | None = None
    # speculative_config "method" names that serve these heads -> whether drafts are
    # accepted without verification (lossy; only CLP's paper mode).
    serving_names: dict[str, bool] = field(default_factory=dict)
    serving_options: tuple[ServingOption, ...] = ()
    train_options: tuple[TrainOption, ...] = ()
    # The hyper key that, when true, says the heads open with an augmenting decoder layer
    # over every token: in vLLM it runs as vLLM's own layer with a paged KV cache.
    augmenting_kv: str | None = None
    # The length threshold (hyper "tau") is chosen on the eval data at the end of training.
    length_predictor: bool = False
    # The heads may score a reduced draft vocabulary (`--draft-vocab-size`, layers.DraftVocabulary).
    draft_vocab: bool = False

    def has_augmenting_block(self, hyper: dict) -> bool:
        return self.augmenting_kv is not None and bool(hyper.get(self.augmenting_kv))


def _clp_tau(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"clp_tau must be a number in (0, 1], got {value!r}")
    return float(value)


TABLE: tuple[DraftMethod, ...] = (
    DraftMethod(
        name="clover", heads=CloverHeads, description="Clover heads (regressive attention decoder)",
        architecture="CloverDraftModel", served_by_plugin=True, serving_names={"clover": False},
        train_options=(
            TrainOption("--no-augmenting-block", "augmenting_block",
                        dict(action="store_false", help="ablation: no augmenting block")),
            TrainOption("--augment-init", "augment_init",
                        dict(choices=["last_layer", "identity"], default="last_layer",
                             help="augmenting block's start: the base's last layer (paper), or that "
                                  "layer with its output projections zeroed (passes the base's state)")),
            TrainOption("--regressive", "regressive",
                        dict(choices=["attention", "mlp", "none"], default="attention",
                             help="ablation: regressive block (mlp = MLP on concat(h, e); none = no "
                                  "regressive input)")),
            TrainOption("--decoder-heads", "decoder_heads",
                        dict(type=int, default=4, help="gate heads of the attention decoder")),
        ),
        augmenting_kv="augmenting_block", draft_vocab=True,
    ),
    DraftMethod(
        name="clp", heads=ClpHeads, description="CLP heads and collocation-length predictor",
        architecture="ClpDraftModel", served_by_plugin=True, serving_names={"clp": False, "clp-trust": True},
        serving_options=(ServingOption("clp_tau", "tau", _clp_tau),),
        train_options=(TrainOption("--tau", "tau", dict(type=float, default=0.5,
                                                        help="threshold used when no --eval-data picks one")),),
        length_predictor=True, draft_vocab=True,
    ),
    DraftMethod(
        name="medusa", heads=MedusaHeads, description="Medusa heads in vLLM's own format (baseline)",
        architecture="MedusaModel", served_by_plugin=False, vllm_method="medusa", draft_vocab=True,
    ),
    DraftMethod(
        name="eagle", heads=EagleDraft, description="EAGLE-1 draft for vLLM's own EAGLE proposer (the peer)",
        architecture="EagleLlamaForCausalLM", served_by_plugin=False, medusa_typed=False, vllm_method="eagle",
        train_options=(TrainOption("--feature-noise", "feature_noise",
                                   dict(type=float, default=0.2, help="width of the uniform noise added to "
                                        "the base's features in training (the authors' 0.2)")),),
    ),
)
BY_NAME = {m.name: m for m in TABLE}
# speculative_config method name -> (the method whose heads it serves, drafts trusted)
SERVING_NAMES = {name: (m, trust) for m in TABLE for name, trust in m.serving_names.items()}
# speculative_config method name -> the method whose heads vLLM's own proposer serves under it
VLLM_SERVED = {m.vllm_method: m for m in TABLE if m.vllm_method}


def method_named(name: str, where: str = "") -> DraftMethod:
    """The table entry for a checkpoint's method; `where` names the file for the error."""
    if name not in BY_NAME:
        raise CheckpointError(f"{where or 'heads'}: unknown method {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def serving_overrides(method: DraftMethod, spec: dict) -> dict:
    """hyper overrides from the speculative_config keys this method accepts."""
    overrides = {}
    for option in method.serving_options:
        if option.key in spec:
            try:
                overrides[option.hyper_key] = option.check(spec[option.key])
            except ValueError as e:
                raise SpecConfigError(str(e)) from None
    return overrides


def all_serving_option_keys() -> set[str]:
    """Every key any method adds to speculative_config (vLLM's own config forbids unknown keys)."""
    return {option.key for m in TABLE for option in m.serving_options}
