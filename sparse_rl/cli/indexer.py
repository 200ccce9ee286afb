"""`sparse-rl indexer train|eval`: warm-up and sparse training of the lightning indexers; their quality."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import (CONFIG, FORCE, GRAD_CLIP, KEEP_CHECKPOINTS, LOG_EVERY, LR_WARMUP, RESUME, SAVE_EVERY, SET,
                                  cli_errors, console, device_option, dtype_option, group,
                                  old_spelling, renamed, seed_option)

app = group("Train the lightning indexers of a sparse model dir.")


@app.command("train")
def train(
    model: Optional[Path] = typer.Argument(None, metavar="MODEL", help="Sparse model dir (from `sparse-rl convert`)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", metavar="DIR", help="Sparse model dir to write [default: none, required]"),
    run_dir: Optional[Path] = typer.Option(None, metavar="DIR", help="Run dir: config, metrics.jsonl, checkpoints [default: OUT.run]"),
    data: Optional[str] = typer.Option(None, help=".jsonl (text|messages), .txt, a datasets dir, or 'synthetic' [default: synthetic]"),
    stage: Optional[str] = typer.Option(None, help="warmup (dense, indexers only) | sparse (LM loss + selected-set KL) [default: warmup]"),
    seq_len: Optional[int] = typer.Option(None, help="Tokens per packed row [default: 1024]"),
    batch_size: Optional[int] = typer.Option(None, help="Rows per process per step [default: 1]"),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps [default: 200]"),
    lr: Optional[float] = typer.Option(None, help="Indexer learning rate [default: 1e-3]"),
    model_lr: Optional[float] = typer.Option(None, help="Model / LoRA learning rate, sparse stage [default: 2e-5]"),
    lr_warmup: Optional[int] = LR_WARMUP,
    finetune: Optional[str] = typer.Option(None, help="Sparse stage: full | lora [default: full]"),
    lora_r: Optional[int] = typer.Option(None, help="LoRA rank [default: 16]"),
    index_topk: Optional[int] = typer.Option(None, "--index-topk",
                                             help="Keys each query attends to, overriding the model's (saved into OUT) [default: the model's]"),
    topk_old: Optional[int] = old_spelling("--topk", "--index-topk"),
    chunk_size: Optional[int] = typer.Option(None, help="Queries per KL chunk, 0 = from a memory budget [default: 0]"),
    kl_impl: Optional[str] = typer.Option(None, help="Warm-up loss: auto (triton on CUDA) | torch (query chunks) | triton (fused kernels) [default: auto]"),
    synthetic_rows: Optional[int] = typer.Option(None, help="Rows generated for --data synthetic [default: 256]"),
    grad_clip: Optional[float] = GRAD_CLIP,
    seed: Optional[int] = seed_option(),
    log_every: Optional[int] = LOG_EVERY,
    save_every: Optional[int] = SAVE_EVERY,
    keep_checkpoints: Optional[int] = KEEP_CHECKPOINTS,
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    backend: Optional[str] = typer.Option(None, help="Sparse ops: auto | torch | triton [default: auto]"),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    resume: bool = RESUME,
    force: bool = FORCE,
) -> None:
    """Train the indexers: stage warmup (KL to dense attention), or stage sparse (LM loss, sparse model).

    Prints a JSON summary on stdout; progress goes to stderr; metrics to RUN_DIR/metrics.jsonl.
    --force replaces OUT and starts the run dir over.
    Multi-GPU (data parallel): `accelerate launch --multi_gpu --num_processes N -m sparse_rl.cli.main indexer train ...`.
    """
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.sparse.train.trainer import IndexerTrainConfig, run

        index_topk = renamed(index_topk, topk_old, "--topk", "--index-topk")
        overrides = dict(model=str(model) if model else None, out=str(out) if out else None,
                         run_dir=str(run_dir) if run_dir else None, data=data, stage=stage, seq_len=seq_len,
                         batch_size=batch_size, steps=steps, lr=lr, model_lr=model_lr, lr_warmup=lr_warmup,
                         finetune=finetune, lora_r=lora_r, topk=index_topk, chunk_size=chunk_size, kl_impl=kl_impl, seed=seed,
                         synthetic_rows=synthetic_rows, grad_clip=grad_clip, log_every=log_every,
                         save_every=save_every, keep_checkpoints=keep_checkpoints, device=device, dtype=dtype, backend=backend)
        cfg = load_config(IndexerTrainConfig, config, overrides, sets=set_)
        summary = run(cfg, resume=resume, force=force, console=console)
        from accelerate import PartialState

        if PartialState().is_main_process:
            last = summary["last"]
            recall = last.get("attn_recall")
            console.print(f"[green]wrote[/] {summary['out']}  ({summary['steps']} steps, kl {last.get('kl', float('nan')):.4f}"
                          + (f", attn_recall {recall:.3f}" if recall is not None else "") + ")")
            typer.echo(json.dumps(summary))


@app.command("eval")
def eval_(
    model: Optional[Path] = typer.Argument(None, metavar="MODEL", help="Sparse model dir."),
    data: Optional[str] = typer.Option(None, help=".jsonl, .txt, a datasets dir, or 'synthetic' [default: synthetic]"),
    seq_len: Optional[int] = typer.Option(None, help="Tokens per row [default: 1024]"),
    rows: Optional[int] = typer.Option(None, help="Rows evaluated [default: 8]"),
    seed: Optional[int] = seed_option(12345),
    index_topk: Optional[int] = typer.Option(None, "--index-topk",
                                             help="Evaluate with this many keys per query instead of the model's [default: the model's]"),
    topk_old: Optional[int] = old_spelling("--topk", "--index-topk"),
    lm_loss: Optional[bool] = typer.Option(None, "--lm-loss/--no-lm-loss", help="Also LM loss dense vs sparse [default: on]"),
    granularities: Optional[bool] = typer.Option(None, "--granularities/--no-granularities", help="Also recall at key blocks 1/4/16/64 x query groups 1/4/16, same token budget [default: on]"),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Indexer quality on held-out rows: KL to dense attention, attn_recall of its top-k selection, the
    oracle recall (best possible k keys), per layer, and the LM loss dense vs sparse. JSON on stdout."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.sparse.train.trainer import IndexerEvalConfig, run_eval

        index_topk = renamed(index_topk, topk_old, "--topk", "--index-topk")
        cfg = load_config(IndexerEvalConfig, config, dict(model=str(model) if model else None, data=data,
                                                          seq_len=seq_len, rows=rows, seed=seed, topk=index_topk,
                                                          lm_loss=lm_loss, granularities=granularities, device=device,
                                                          dtype=dtype), sets=set_)
        with console.status("evaluating the indexer"):
            res = run_eval(cfg)
        console.print(f"kl {res['kl']:.4f}  attn_recall {res['attn_recall']:.3f}  (oracle {res['oracle_recall']:.3f}, "
                      f"k={res['topk']}, L={res['seq_len']})")
        for row in res.get("granularity", []):
            console.print(f"  key_block {row['key_block']:>2}  query_group {row['query_group']:>2}  "
                          f"attn_recall {row['attn_recall']:.3f}  oracle {row['oracle_recall']:.3f}")
        typer.echo(json.dumps(res))
