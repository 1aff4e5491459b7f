"""`vllm-clover-train`: train Clover, CLP or Medusa heads on a frozen base, or evaluate them.

    vllm-clover-train clover --base-model BASE --data train.jsonl --out heads/clover --num-heads 4
    vllm-clover-train distill --base-model BASE --data prompts.jsonl --out distilled.jsonl
    vllm-clover-train eval   --heads heads/clover --base-model BASE --data heldout.jsonl --out eval.json

Multi-process data parallel: `torchrun --nproc-per-node N -m vllm_clover_training.cli clover ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_clover_training.data import DataError


def _train_parser(sub, method: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(method, help=help)
    p.add_argument("--base-model", type=Path, required=True, help="frozen base: a local HF checkpoint dir")
    p.add_argument("--data", type=Path, nargs="+", required=True, help="JSONL: text, messages or conversations")
    p.add_argument("--out", type=Path, required=True, help="heads checkpoint directory to write")
    p.add_argument("--num-heads", type=int, default=4, help="K, draft tokens per step (1..8)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512, help="tokens per packed training window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--resume", action="store_true", help="continue the unfinished run in OUT.work/")
    p.add_argument("--eval-data", type=Path, nargs="*", default=[], help="held-out JSONL scored at the end")
    p.add_argument("--self-distill", action="store_true",
                   help="train on the base's own greedy continuations of the data's prompts (vLLM)")
    p.add_argument("--distill-prompt-tokens", type=int, default=64)
    p.add_argument("--distill-new-tokens", type=int, default=256)
    p.add_argument("--head-weight-decay", type=float, default=1.0,
                   help="weight head i's loss by this**(i-1) (the authors' Clover-2 use 0.7)")
    p.add_argument("--save-every", type=int, default=50, help="steps between resumable states")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-clover-train", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    clover = _train_parser(sub, "clover", "Clover heads (regressive attention decoder)")
    clover.add_argument("--no-augmenting-block", action="store_true", help="ablation: no augmenting block")
    clover.add_argument("--regressive", choices=["attention", "mlp", "none"], default="attention",
                        help="ablation: regressive block (mlp = MLP on concat(h, e); none = no regressive input)")
    clover.add_argument("--decoder-heads", type=int, default=4, help="gate heads of the attention decoder")
    clp = _train_parser(sub, "clp", "CLP heads and collocation-length predictor")
    clp.add_argument("--tau", type=float, default=0.5, help="threshold used when no --eval-data picks one")
    _train_parser(sub, "medusa", "Medusa heads in vLLM's own format (baseline)")
    ds = sub.add_parser("distill", help="write the base's greedy continuations of the data's prompts as JSONL")
    ds.add_argument("--base-model", type=Path, required=True)
    ds.add_argument("--data", type=Path, nargs="+", required=True)
    ds.add_argument("--out", type=Path, required=True, help='JSONL of {"text": prompt + continuation}')
    ds.add_argument("--distill-prompt-tokens", type=int, default=64)
    ds.add_argument("--distill-new-tokens", type=int, default=256)
    ds.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ev = sub.add_parser("eval", help="per-head top-1/top-5 accuracy of a heads checkpoint")
    ev.add_argument("--heads", type=Path, required=True)
    ev.add_argument("--base-model", type=Path, required=True)
    ev.add_argument("--data", type=Path, nargs="+", required=True)
    ev.add_argument("--out", type=Path, required=True)
    ev.add_argument("--max-len", type=int, default=512)
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    return parser


def method_hyper(args) -> dict:
    if args.command == "clover":
        return {"augmenting_block": not args.no_augmenting_block, "regressive": args.regressive,
                "decoder_heads": args.decoder_heads}
    if args.command == "clp":
        return {"tau": args.tau}
    return {}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from vllm_clover.checkpoint import CheckpointError

    try:
        if args.command == "distill":
            from vllm_clover_training.distill import distill_jsonl

            result = distill_jsonl(args.base_model, args.data, args.out, args.distill_prompt_tokens,
                                   args.distill_new_tokens, args.dtype)
        elif args.command == "eval":
            from vllm_clover_training.evaluate import evaluate_checkpoint

            result = evaluate_checkpoint(args.heads, args.base_model, args.data, args.out,
                                         args.max_len, args.batch_size, args.dtype)
        else:
            from vllm_clover_training.train_heads import TrainArgs, train

            fields = TrainArgs.__dataclass_fields__
            result = train(TrainArgs(method=args.command, hyper=method_hyper(args),
                                     command=["vllm-clover-train", *(argv or sys.argv[1:])],
                                     **{k: v for k, v in vars(args).items() if k in fields and k != "command"}))
    except (DataError, CheckpointError, ValueError) as e:
        raise SystemExit(f"vllm-clover-train: error: {e}") from None
    if result:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
