"""The SFT loop: packed rows -> token-mean cross-entropy on target tokens -> AdamW, on one or more
processes (`Dist`: torchrun / accelerate launch, data parallel, gradients averaged).

Loss: the sum of the target tokens' negative log-likelihoods over all processes' rows divided by
the global target count (TRL's default normalisation: every target token weighs the same, however
the rows are split). Each process scales its share by `grad_scale` so `reduce_grads`' average is
that sum. A next-token target that starts another document (its position id is 0) is dropped, so
a packed row never trains the end of one document to predict the next.

Run dir (`sparse_rl.runs`): config.yaml, metrics.jsonl, checkpoints/step-N (trainable tensors,
optimizer + scheduler, RNG states, meta with the data cursor); `--resume` continues exactly.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.schedule import lr_schedule
from sparse_rl.sft.config import FIXED_ON_RESUME, SFTConfig
from sparse_rl.sft.data import IGNORE

ADAPTER_DIR = "adapter"


def targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token targets `[B, T-1]`: labels shifted left, -100 where the next token opens a document."""
    tgt = batch["labels"][:, 1:].clone()
    tgt[batch["position_ids"][:, 1:] == 0] = IGNORE
    return tgt


def token_nll_sum(model, batch: dict[str, torch.Tensor], autocast: str = "no") -> tuple[torch.Tensor, int]:
    """(sum of target-token NLL, number of targets) for one packed batch `[B, T]`; no attention mask is
    given, so transformers derives the block-diagonal causal mask from the position ids. autocast
    "bf16": the forward runs under bf16 autocast (the loss is still taken on float32 logits)."""
    dev = batch["input_ids"].device.type
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast == "bf16"):
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    tgt = targets(batch)
    logits = out.logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                            ignore_index=IGNORE, reduction="sum")
    return nll, int((tgt != IGNORE).sum())


def _prepare_run_dir(cfg: SFTConfig, run_dir: Path, resume: bool, force: bool):
    from sparse_rl.config import load_config, to_dict
    from sparse_rl.runs import latest, list_checkpoints

    found = latest(run_dir) if resume else None
    if found is not None:
        saved_file = run_dir / "config.yaml"
        if saved_file.is_file():
            saved, now = to_dict(load_config(SFTConfig, saved_file)), to_dict(cfg)
            for key in FIXED_ON_RESUME:
                if saved[key] != now[key]:
                    raise UsageError(f"--resume: {key} is {now[key]!r} but the run in {run_dir} used {saved[key]!r} "
                                     "(keep it, or start a new run dir)")
        return found[1]
    busy = run_dir.exists() and ((run_dir / "metrics.jsonl").exists() or list_checkpoints(run_dir))
    if busy and not (force or resume):
        raise UsageError(f"--run-dir {run_dir}: holds a run already (pass --resume to continue it or --force to "
                         "start over)")
    for name in ("metrics.jsonl", "config.yaml", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return None


def _agree(pg, fn):
    """Run `fn` on rank 0 and share its result or its error with every process (none hangs)."""
    res, err = None, None
    if pg.main:
        try:
            res = fn()
        except SparseRLError as e:
            err = (type(e).__name__, str(e))
    res, err = pg.broadcast((res, err))
    if err is not None:
        raise (UsageError if err[0] == "UsageError" else SparseRLError)(err[1])
    return res


def _wrap_lora(model, cfg: SFTConfig):
    from peft import LoraConfig, get_peft_model

    model.requires_grad_(False)
    try:
        return get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                                target_modules=list(cfg.lora_targets)))
    except ValueError as e:
        raise UsageError(f"--lora-targets {cfg.lora_targets}: {str(e).splitlines()[0][:160]}") from None


def run(cfg: SFTConfig, resume: bool = False, force: bool = False, console=None) -> dict:
    """Train; write `cfg.out` (and the run dir). Returns a summary dict."""
    from sparse_rl import runs
    from sparse_rl.distributed import Dist
    from sparse_rl.io import append_jsonl, atomic_dir, atomic_write_json, writing
    from sparse_rl.sft.data import Rows, pack, read_documents
    from sparse_rl.sft.progress import progress_bar
    from sparse_rl.sparse.loader import check_model_dir, load_model, load_tokenizer, save_model, sparse_config_of
    from sparse_rl.sparse.train import checkpoint

    if not cfg.model:
        raise UsageError("MODEL: give the model dir to train (argument or 'model:' in the recipe)")
    if not cfg.data:
        raise UsageError("--data: give the training JSONL (flag or 'data:' in the recipe)")
    if not cfg.out:
        raise UsageError("--out: give the output model dir (flag or 'out:' in the recipe)")
    out = Path(cfg.out)
    run_dir = Path(cfg.run_dir) if cfg.run_dir else out.with_name(out.name + ".run")
    check_model_dir(cfg.model, "MODEL")
    if out.exists() and not force:
        raise UsageError(f"--out {out}: exists already (pass --force to overwrite)")

    pg = Dist(cfg.device)
    device, world, rank, main = str(pg.device), pg.world, pg.rank, pg.main
    say = (lambda msg: console.print(f"[yellow]{msg}")) if console is not None else (lambda msg: None)
    ckpt = _agree(pg, lambda: str(c) if (c := _prepare_run_dir(cfg, run_dir, resume, force)) else None)
    if main:
        runs.clean_orphans(run_dir, outputs=(out,), log=say)
    torch.manual_seed(cfg.seed)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # float32 weights train with tf32 matmuls

    tokenizer = load_tokenizer(cfg.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    docs = read_documents(cfg.data, tokenizer, cfg.loss_on)
    tensors, dropped = pack(docs, cfg.seq_len, pad)
    if dropped == len(docs):
        raise SparseRLError(f"--data {cfg.data}: every record is longer than --seq-len {cfg.seq_len} tokens")
    if dropped and main:
        say(f"skipped {dropped} of {len(docs)} records longer than --seq-len {cfg.seq_len}")
    rows = Rows(tensors, cfg.seed)
    total = cfg.steps or max(1, math.ceil(cfg.epochs * rows.n / (cfg.batch_size * world)))

    model = load_model(cfg.model, attention="dense", device=device, dtype=cfg.dtype)
    sc = sparse_config_of(cfg.model)
    if cfg.finetune == "lora":
        model = _wrap_lora(model, cfg)
    else:
        model.requires_grad_(True)
    model.train()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    params = list(named.values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    sched = lr_schedule(opt, cfg.lr_warmup, total, cfg.min_lr_ratio)

    step, cursor = checkpoint.begin_run(run_dir, ckpt, cfg, named, opt, sched, device, main, say)

    B = cfg.batch_size
    metrics_file = run_dir / runs.METRICS
    last: dict = runs.last_metrics(run_dir, step) if main and ckpt is not None else {}
    with progress_bar(console, main, "sft", total, step) as bar:
        while step < total:
            t0 = time.perf_counter()
            batch = {k: v.to(device) for k, v in rows.batch(cursor, B * world).items()}
            batch = {k: v[rank::world] for k, v in batch.items()}
            n_local = int((targets(batch) != IGNORE).sum())
            n_global = pg.sum([float(n_local)])[0]
            nll, _ = token_nll_sum(model, batch, cfg.mixed_precision)
            (nll * (pg.grad_scale / max(1.0, n_global))).backward()
            pg.reduce_grads(params)
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf")))
            loss = pg.sum([float(nll.detach())])[0] / max(1.0, n_global)
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                raise SparseRLError(f"step {step + 1}: non-finite loss or gradient (loss {loss}, grad norm {gnorm}); "
                                    f"lower --lr; checkpoints are in {run_dir}")
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            cursor += B * world
            step += 1
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm, "target_tokens": int(n_global),
                   "tokens_per_s": B * world * cfg.seq_len / dt, "step_time_s": dt, "epoch": cursor / rows.n}
            if device.startswith("cuda"):
                rec["max_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            last = rec
            if main and (step % cfg.log_every == 0 or step == total):
                append_jsonl(metrics_file, rec)
            bar(step, f"loss {loss:.4f}")
            if step % cfg.save_every == 0 or step == total:
                if main:
                    checkpoint.save(run_dir, step, named, opt, sched,
                                    {"cursor": cursor, "world": world, "time": time.time()}, keep=cfg.keep_checkpoints)
                pg.barrier()

    summary = {"out": str(out), "run_dir": str(run_dir), "steps": step, "processes": world, "rows": rows.n,
               "records": len(docs), "dropped_long": dropped, "finetune": cfg.finetune, "last": last}
    if main:
        with atomic_dir(out, force=force, flag="--out") as tmp, writing(out, "--out"):
            if cfg.finetune == "lora":
                model.save_pretrained(tmp / ADAPTER_DIR)  # the adapter alone (peft format)
                model = model.merge_and_unload()
            save_model(model, tmp, tokenizer, sc)
        atomic_write_json(run_dir / "summary.json", summary)
    pg.close()
    return summary
