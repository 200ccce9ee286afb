"""The `sparse-rl indexer train` loop: dense warm-up, then (optionally) sparse-mode training.

Stage `warmup`: the model runs dense under `no_grad` and is frozen; only the indexers train, on
`warmup_kl` (KL to the head-summed dense attention over all causal keys). The dense queries and
keys are taken where they already exist: during the step the model's attention implementation is
switched to "sparse_rl_capture", a thin registered function that hands (q, k) after RoPE/GQA
projection, plus the layer input the patch's pre-hook stashed, to a callback and then delegates to
the normal "sparse_rl" function (so the forward itself is unchanged). The callback runs the indexer
with gradients and back-propagates each layer's loss immediately, chunk by chunk, so nothing of a
layer outlives its attention call: peak memory is the frozen forward plus one chunk's block.
The LM head is skipped (the decoder stack alone runs): its logits are not needed.

Stage `sparse`: the model runs sparse and trains on the LM loss (all weights, or a LoRA adapter
through peft); the patch's `recorder` hook hands each layer's selected indices and sparse
log-sum-exp to a callback that trains the indexer on `selected_kl` (KL over the selected set),
again back-propagated on the spot. The indexer's inputs are detached and it selects under
`no_grad`, so the two losses never share a gradient path.

Data parallel: processes are started by `accelerate launch` (or run alone); every process takes its
rows of the global batch, and the gradients of the trainable parameters are averaged with one
all-reduce per step before the optimizer steps (the per-layer backward inside the forward is
incompatible with the DistributedDataParallel wrapper's reducer, which expects one backward after
the forward). Rank 0 writes metrics, checkpoints and the output model.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.schedule import lr_schedule

STAGES = ("warmup", "sparse")
FINETUNE = ("full", "lora")
# Config keys that must not change when a run is resumed.
FIXED_ON_RESUME = ("model", "data", "stage", "seq_len", "seed", "finetune", "lora_r", "lora_alpha", "lora_targets",
                   "topk", "synthetic_rows", "dtype")


@dataclass
class IndexerTrainConfig:
    """`sparse-rl indexer train` options (YAML recipe keys = flag names with underscores).

    model / out / run_dir: input sparse model dir, output sparse model dir, run dir (config.yaml,
        metrics.jsonl, checkpoints/; default "<out>.run").
    data: a .jsonl (text | messages), a .txt, a `datasets` save_to_disk directory, or "synthetic".
    stage: "warmup" (dense, frozen model, indexers only) | "sparse" (sparse model on the LM loss,
        indexers on the selected-set KL).
    seq_len / batch_size: packed row length; rows per process per step.
    lr: indexer learning rate; model_lr: model (or LoRA) learning rate in the sparse stage.
    lr_warmup / min_lr_ratio: linear LR warm-up steps, then cosine decay to min_lr_ratio * lr.
    finetune: sparse stage: "full" (all weights) | "lora" (peft adapter on lora_targets, merged at the end).
    topk: override the model's top-k (saved into the output's sparse_config.json).
    chunk_size: queries per loss chunk (0 = from a memory budget).
    kl_impl: warm-up loss implementation: "auto" (triton on CUDA, torch elsewhere) | "torch" (query
        chunks) | "triton" (fused kernels; agree with torch on an H200, where a warm-up step between
        log steps took 3.3x a dense forward at 8K and 32K: results/2026-11-29-h200-indexer-speed.md).
    synthetic_rows: rows generated for data=synthetic.
    """

    model: str = ""
    out: str = ""
    run_dir: str = ""
    data: str = "synthetic"
    stage: str = "warmup"
    seq_len: int = 1024
    batch_size: int = 1
    steps: int = 200
    lr: float = 1e-3
    model_lr: float = 2e-5
    lr_warmup: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    finetune: str = "full"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    topk: int | None = None
    chunk_size: int = 0
    kl_impl: str = "auto"
    synthetic_rows: int = 256
    seed: int = 0
    log_every: int = 1
    save_every: int = 100
    keep_checkpoints: int = 2
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"

    def __post_init__(self):
        if self.stage not in STAGES:
            raise UsageError(f"--stage {self.stage}: expected warmup or sparse")
        if self.kl_impl not in ("auto", "torch", "triton"):
            raise UsageError(f"--kl-impl {self.kl_impl}: expected auto, torch or triton")
        if self.finetune not in FINETUNE:
            raise UsageError(f"--finetune {self.finetune}: expected full or lora")
        for name in ("seq_len", "batch_size", "steps", "log_every", "save_every", "synthetic_rows", "lora_r"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        for name in ("lr", "model_lr", "weight_decay", "grad_clip", "lr_warmup", "chunk_size", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UsageError(f"--min-lr-ratio {self.min_lr_ratio}: must be in [0, 1]")
        if self.topk is not None and self.topk < 1:
            raise UsageError(f"--index-topk must be >= 1 (got {self.topk})")


# ---------------------------------------------------------------------------------------------
# the run


def _prepare_run_dir(cfg: IndexerTrainConfig, run_dir: Path, resume: bool, force: bool):
    """Validate the run dir against resume/force; returns the checkpoint to resume from (or None)."""
    from sparse_rl.config import load_config, to_dict
    from sparse_rl.runs import latest, list_checkpoints

    found = latest(run_dir) if resume else None
    ckpt = found[1] if found else None
    if ckpt is not None:
        saved_file = run_dir / "config.yaml"
        if saved_file.is_file():
            saved = to_dict(load_config(IndexerTrainConfig, saved_file))
            now = to_dict(cfg)
            for key in FIXED_ON_RESUME:
                if saved[key] != now[key]:
                    raise UsageError(f"--resume: {key} is {now[key]!r} but the run in {run_dir} used {saved[key]!r} "
                                     "(keep it, or start a new run dir)")
        return ckpt
    busy = run_dir.exists() and ((run_dir / "metrics.jsonl").exists() or list_checkpoints(run_dir))
    if busy and not (force or resume):  # --resume without a checkpoint yet: nothing to continue, start over
        raise UsageError(f"--run-dir {run_dir}: holds a run already (pass --resume to continue it or --force to "
                         "start over)")
    return None


def _reset_run_dir(run_dir: Path) -> None:
    """Remove what a run writes (and nothing else: the dir may hold the user's own files)."""
    for name in ("metrics.jsonl", "config.yaml", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def run(cfg: IndexerTrainConfig, resume: bool = False, force: bool = False, console=None) -> dict:
    """Train the indexers (and, in the sparse stage, the model); write `cfg.out`. Returns a summary."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from sparse_rl import runs
    from sparse_rl.distributed import Dist
    from sparse_rl.io import append_jsonl, atomic_dir, atomic_write_json, writing
    from sparse_rl.sparse.loader import check_model_dir, load_model, load_tokenizer, save_model, set_attention
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.train import checkpoint
    from sparse_rl.sparse.train.data import build_data
    from sparse_rl.sparse.layer import set_topk
    from sparse_rl.sparse.train.hooks import (AttentionWithLse, StepStats, indexed_attention, sparse_forward,
                                              warmup_forward)

    if not cfg.model:
        raise UsageError("MODEL: give the sparse model dir to train (argument or 'model:' in the recipe)")
    if not cfg.out:
        raise UsageError("--out: give the output model dir (flag or 'out:' in the recipe)")
    out = Path(cfg.out)
    run_dir = Path(cfg.run_dir) if cfg.run_dir else out.with_name(out.name + ".run")
    check_model_dir(cfg.model, "MODEL")
    sc = SparseConfig.load(cfg.model)
    if sc is None:
        raise SparseRLError(f"MODEL {cfg.model}: not a sparse model dir (run `sparse-rl convert` first)")
    if sc.selector != "indexer":
        raise SparseRLError(f"MODEL {cfg.model}: its selector is '{sc.selector}', which has nothing to train "
                            "(convert with --selector indexer)")
    if out.exists() and not force:
        raise UsageError(f"--out {out}: exists already (pass --force to overwrite)")
    if cfg.topk is not None:
        sc = dataclasses.replace(sc, topk=cfg.topk)  # re-validated (sink + window <= topk)

    pg = Dist(cfg.device)
    device = str(pg.device)
    world, rank, main = pg.world, pg.rank, pg.main
    ckpt, err = None, None
    if main:
        try:
            ckpt = _prepare_run_dir(cfg, run_dir, resume, force)
        except SparseRLError as e:
            err = e
    # rank 0 decides; every process stops on its error instead of hanging in a collective
    box = pg.broadcast((str(ckpt) if ckpt else None, None if err is None else (type(err).__name__, str(err))))
    ckpt = Path(box[0]) if box[0] else None
    if box[1] is not None and err is None:
        kind, msg = box[1]
        err = (UsageError if kind == "UsageError" else SparseRLError)(msg)
    if err is not None:
        raise err
    say = (lambda msg: console.print(f"[yellow]{msg}")) if console is not None else None
    if main:
        runs.clean_orphans(run_dir, outputs=(out,), log=say)
    if main and ckpt is None and run_dir.exists():
        _reset_run_dir(run_dir)  # allowed by _prepare_run_dir: empty, --force, or --resume with no checkpoint
    if cfg.kl_impl == "auto":  # the fused kernels on CUDA (2-3x faster on an H200), the query-chunked torch path else
        cfg.kl_impl = "triton" if device.startswith("cuda") else "torch"
    if cfg.kl_impl == "triton" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError("--kl-impl triton: needs a CUDA device (or TRITON_INTERPRET=1 on the CPU); use torch")
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # the KL target's fp32 matmuls run in tf32
    torch.manual_seed(cfg.seed)

    tokenizer = load_tokenizer(cfg.model)
    data = build_data(cfg.data, tokenizer, cfg.seq_len, cfg.seed, cfg.synthetic_rows)
    model = load_model(cfg.model, attention="dense", device=device, dtype=cfg.dtype, backend=cfg.backend)
    set_topk(model, sc.topk)
    if not indexed_attention(model):
        raise SparseRLError(f"MODEL {cfg.model}: every layer is dense (dense_layers); no indexer to train")
    model.requires_grad_(False)
    if cfg.stage == "sparse":
        if cfg.finetune == "lora":
            from peft import LoraConfig, get_peft_model

            try:
                model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                                         target_modules=list(cfg.lora_targets)))
            except ValueError as e:
                raise UsageError(f"--lora-targets {cfg.lora_targets}: {str(e).splitlines()[0][:160]}") from None
        else:
            model.requires_grad_(True)
        set_attention(model, "sparse", cfg.backend)
        model.train()
    idx_params = [p for m in indexed_attention(model) for p in m.indexer.parameters()]
    for p in idx_params:
        p.requires_grad_(True)
    idx_ids = {id(p) for p in idx_params}
    model_params = [p for p in model.parameters() if p.requires_grad and id(p) not in idx_ids]
    groups = [{"params": idx_params, "lr": cfg.lr}]
    if model_params:
        groups.append({"params": model_params, "lr": cfg.model_lr})
    opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    sched = lr_schedule(opt, cfg.lr_warmup, cfg.steps, cfg.min_lr_ratio)
    named_trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}

    step, cursor = checkpoint.begin_run(run_dir, ckpt, cfg, named_trainable, opt, sched, device, main, say)

    n_layers = len(indexed_attention(model))
    B, L = cfg.batch_size, cfg.seq_len
    grad_scale = 1.0 / (n_layers * B * L)  # the loss is the mean KL over layers and queries
    metrics_file = run_dir / runs.METRICS
    # a run killed after its last checkpoint resumes at the end: its final record is the summary's
    last: dict = runs.last_metrics(run_dir, step) if main and ckpt is not None else {}
    lse_attention = AttentionWithLse()  # its kernel choice, made on the first step, holds for the run
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console,
                        disable=not main or console is None, transient=False)
    with progress:
        task = progress.add_task(f"indexer {cfg.stage}", total=cfg.steps, completed=step, info="")
        while step < cfg.steps:
            t_start = time.perf_counter()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            rows = data.rows(cursor, B * world)[rank::world].to(device)
            stats = StepStats(device)
            log_now = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps
            if cfg.stage == "warmup":
                warmup_forward(model, rows, stats, grad_scale, cfg.chunk_size or None, cfg.kl_impl, log_now,
                               lse_attention=lse_attention)
            else:
                loss = sparse_forward(model, rows, stats, grad_scale, log_now, cfg.chunk_size or None)
                loss.backward()
                stats.v[4] += loss.detach().double()
            params = [p for p in model.parameters() if p.requires_grad]
            if world > 1:
                pg.reduce_grads(params)  # averaged: the loss is this process's mean
                pg.all_sum_(stats.v)
                stats.v[4] /= world
            gnorm = {}
            for name, group in (("indexer", idx_params), ("model", model_params)):
                if group:
                    gnorm[name] = float(torch.nn.utils.clip_grad_norm_(group, cfg.grad_clip or float("inf")))
            lrs = [g["lr"] for g in opt.param_groups]
            _check_finite(step + 1, stats.v, gnorm, run_dir)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            _check_finite(step + 1, None, {n: float(_nonfinite(g)) for n, g in (("indexer", idx_params),
                                                                              ("model", model_params)) if g}, run_dir,
                          what="the updated weights")
            cursor += B * world
            step += 1
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t_start
            v = stats.v.tolist()
            kl = v[0] / max(1.0, v[1])
            rec = {"step": step, "stage": cfg.stage, "loss": kl if cfg.stage == "warmup" else v[4], "kl": kl,
                   "attn_recall": (v[2] / v[3]) if v[3] else None, "lr": lrs[0], "tokens_per_s": B * world * L / dt,
                   "step_time_s": dt, "grad_norm": gnorm.get("indexer")}
            if cfg.stage == "sparse":
                rec["lm_loss"], rec["model_lr"], rec["model_grad_norm"] = v[4], lrs[-1], gnorm.get("model")
            if device.startswith("cuda"):
                rec["max_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            last = rec
            if main and log_now:
                append_jsonl(metrics_file, rec)
                recall = f" recall {rec['attn_recall']:.3f}" if rec["attn_recall"] is not None else ""
                lm = f" lm {rec['lm_loss']:.3f}" if cfg.stage == "sparse" else ""
                progress.update(task, info=f"kl {kl:.4f}{recall}{lm}")
            progress.update(task, completed=step)
            if step % cfg.save_every == 0 or step == cfg.steps:
                if main:
                    checkpoint.save(run_dir, step, {n: p for n, p in named_trainable.items()}, opt, sched,
                                    {"cursor": cursor, "stage": cfg.stage, "world": world, "time": time.time()},
                                    keep=cfg.keep_checkpoints)
                pg.barrier()

    summary = {"out": str(out), "run_dir": str(run_dir), "stage": cfg.stage, "steps": step, "processes": world,
               "topk": sc.topk, "sparse_layers": n_layers, "last": last}
    if main:
        if cfg.stage == "sparse" and cfg.finetune == "lora":
            model = model.merge_and_unload()
        set_attention(model, "dense")
        with atomic_dir(out, force=force, flag="--out") as tmp, writing(out, "--out"):
            save_model(model, tmp, tokenizer, sc)
        atomic_write_json(run_dir / "summary.json", summary)
    pg.close()  # barrier, then an explicit teardown: gloo's threads die at interpreter exit otherwise (SIGABRT)
    return summary


def _nonfinite(params: list[torch.Tensor]) -> torch.Tensor:
    """0.0 if every element of `params` is finite, else inf (one reduction per tensor, one sync)."""
    bad = torch.stack([~torch.isfinite(p.detach()).all() for p in params]).any()
    return torch.where(bad, float("inf"), 0.0)


def _check_finite(step: int, stats, gnorm: dict, run_dir: Path, what: str = "the loss or its gradient") -> None:
    """Stop before a non-finite value reaches the weights, a checkpoint or --out (GRPO stops the same way).
    Every process sees the same reduced values, so all of them stop together."""
    values = list(gnorm.values()) + ([] if stats is None else stats[[0, 4]].tolist())  # kl sum, lm loss
    if all(math.isfinite(v) for v in values):
        return
    from sparse_rl.runs import latest

    found = latest(run_dir)
    where = f"the last good checkpoint is {found[1]}" if found else "no checkpoint was saved yet"
    raise SparseRLError(f"step {step}: {what} is NaN/inf; the run stopped, {where} and nothing was written to "
                        "--out (lower --lr, set --grad-clip, or use --dtype float32)")


@dataclass
class IndexerEvalConfig:
    """`sparse-rl indexer eval` options: indexer quality of MODEL on `rows` held-out rows of `data`.

    seed: data seed (for `synthetic`, pick one the training run did not use: rows depend on it).
    topk: evaluate at this k instead of the model's (e.g. L/8).
    granularities: also report recall at every key block x query group the top-k allows (`hooks.evaluate`).
    """

    model: str = ""
    data: str = "synthetic"
    seq_len: int = 1024
    rows: int = 8
    seed: int = 12345
    topk: int | None = None
    chunk_size: int = 0
    lm_loss: bool = True
    granularities: bool = True
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"

    def __post_init__(self):
        for name in ("seq_len", "rows"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.topk is not None and self.topk < 1:
            raise UsageError(f"--index-topk must be >= 1 (got {self.topk})")


def run_eval(cfg: IndexerEvalConfig) -> dict:
    """KL, attn_recall, oracle recall (per layer and mean) and LM loss dense vs sparse; see `hooks.evaluate`."""
    from sparse_rl.devices import resolve_device
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.loader import check_model_dir, load_model, load_tokenizer
    from sparse_rl.sparse.train.data import build_data
    from sparse_rl.sparse.layer import set_topk
    from sparse_rl.sparse.train.hooks import evaluate

    if not cfg.model:
        raise UsageError("MODEL: give the sparse model dir to evaluate")
    check_model_dir(cfg.model, "MODEL")
    sc = SparseConfig.load(cfg.model)
    if sc is None or sc.selector != "indexer":
        raise SparseRLError(f"MODEL {cfg.model}: not a sparse model dir with an indexer (run `sparse-rl convert`)")
    if cfg.topk is not None:
        sc = dataclasses.replace(sc, topk=cfg.topk)
    device = resolve_device(cfg.device)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    tok = load_tokenizer(cfg.model)
    data = build_data(cfg.data, tok, cfg.seq_len, cfg.seed, synthetic_n=cfg.rows)
    rows = data.rows(0, min(cfg.rows, len(data))).to(device)
    model = load_model(cfg.model, attention="dense", device=device, dtype=cfg.dtype, backend=cfg.backend)
    set_topk(model, sc.topk)
    res = evaluate(model, rows, chunk=cfg.chunk_size or None, lm_loss=cfg.lm_loss, granularities=cfg.granularities)
    return {"model": cfg.model, "data": cfg.data, "rows": int(rows.shape[0]), "seq_len": cfg.seq_len,
            "topk": sc.topk, **res}
