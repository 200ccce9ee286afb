"""`sparse-rl bench attention|decode`: kernel speed against dense SDPA (and FlexAttention) in one run.

Prints a markdown table to stdout, writes the full results as JSON with `--out`. Thin: the work is
in `sparse_rl.bench.attention` / `bench_decode`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import (CONFIG, FORCE, INDEX_DIM, INDEX_DTYPE, INDEX_HEADS, SET, cli_errors, compile_option,
                                  console, device_option, group, ints, old_spelling, refuse_existing, renamed)

app = group("Speed benchmarks (markdown table to stdout, JSON with --out).")


def _finish(res: dict, table: str, out: Optional[Path]) -> None:
    from sparse_rl.io import atomic_write_json

    res["markdown"] = table
    if out is not None:
        atomic_write_json(out, res)
        console.print(f"[green]wrote[/] {out}")
    typer.echo(table)


_common = dict(
    heads=typer.Option(None, help="Query heads [default: 32]"),
    kv_heads=typer.Option(None, help="KV heads [default: 8]"),
    head_dim=typer.Option(None, help="Head dim [default: 128]"),
    index_topk=typer.Option(None, "--index-topk", help="Keys each query attends to [default: 2048]"),
    topk_old=old_spelling("--topk", "--index-topk"),
    index_heads=INDEX_HEADS,
    index_dim=INDEX_DIM,
    out=typer.Option(None, "--out", "-o", metavar="FILE", help="Write the results as JSON here [default: none]"),
)


@app.command("attention")
def attention(
    seqlens: Optional[str] = typer.Option(None, help="Sequence lengths, e.g. 8K,32K [default: 8K,16K,32K,64K,128K]"),
    backward_seqlens: Optional[str] = typer.Option(None, help="Lengths also timed forward+backward [default: 32K]"),
    heads: Optional[int] = _common["heads"], kv_heads: Optional[int] = _common["kv_heads"],
    head_dim: Optional[int] = _common["head_dim"], index_topk: Optional[int] = _common["index_topk"],
    topk_old: Optional[int] = _common["topk_old"],
    index_heads: Optional[int] = _common["index_heads"], index_dim: Optional[int] = _common["index_dim"],
    batch: Optional[int] = typer.Option(None, help="Batch [default: 1]"),
    flex: Optional[bool] = typer.Option(None, "--flex/--no-flex", help="Time FlexAttention block-sparse [default: on]"),
    check: Optional[bool] = typer.Option(None, "--check/--no-check", help="Compare with the fp32 reference [default: on]"),
    dtype: Optional[str] = typer.Option(None, help="bfloat16 | float16 | float32 [default: bfloat16]"),
    rep_ms: Optional[int] = typer.Option(None, help="Timing budget per measurement, ms [default: 100]"),
    granular: Optional[str] = typer.Option(None, help="Granular prefill rows, kb<N> / g<N> / kb<N>g<M> or none "
                                           "[default: kb16,g16]"),
    device: Optional[str] = device_option(),
    config: Optional[Path] = CONFIG, set_: Optional[list[str]] = SET,
    out: Optional[Path] = _common["out"], force: bool = FORCE,
) -> None:
    """Sparse prefill (indexer + top-k + attention), fwd+bwd, FlexAttention block-sparse vs dense SDPA.
    On a CPU the kernels need TRITON_INTERPRET=1."""
    with cli_errors():
        from sparse_rl.config import load_config

        refuse_existing(force, out=out)
        index_topk = renamed(index_topk, topk_old, "--topk", "--index-topk")
        from sparse_rl.bench.attention import BenchAttentionConfig, markdown_attention, run_attention_bench

        cfg = load_config(BenchAttentionConfig, config, dict(
            seqlens=ints("--seqlens", seqlens, positive=True),
            backward_seqlens=ints("--backward-seqlens", backward_seqlens, positive=True),
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, topk=index_topk, index_heads=index_heads,
            index_dim=index_dim, batch=batch, flex=flex, check=check, dtype=dtype, rep_ms=rep_ms, device=device,
            granular=None if granular is None else [x for x in granular.split(",") if x.strip() not in ("", "none")]),
            sets=set_)
        res = run_attention_bench(cfg, log=lambda m: console.print(f"[dim]{m}[/]"))
        _finish(res, markdown_attention(res), out)


@app.command("decode")
def decode(
    contexts: Optional[str] = typer.Option(None, help="Context lengths, e.g. 32K,128K [default: 32K,128K]"),
    batch: Optional[int] = typer.Option(None, help="Sequences decoded together [default: 32]"),
    heads: Optional[int] = _common["heads"], kv_heads: Optional[int] = _common["kv_heads"],
    head_dim: Optional[int] = _common["head_dim"], index_topk: Optional[int] = _common["index_topk"],
    topk_old: Optional[int] = _common["topk_old"],
    index_heads: Optional[int] = _common["index_heads"], index_dim: Optional[int] = _common["index_dim"],
    splits: Optional[str] = typer.Option(None, help="Also time these split-K counts, e.g. 1,2,4,8 [default: none]"),
    check: Optional[bool] = typer.Option(None, "--check/--no-check", help="Compare with the fp32 reference [default: on]"),
    dtype: Optional[str] = typer.Option(None, help="bfloat16 | float16 | float32 [default: bfloat16]"),
    rep_ms: Optional[int] = typer.Option(None, help="Timing budget per measurement, ms [default: 100]"),
    device: Optional[str] = device_option(),
    config: Optional[Path] = CONFIG, set_: Optional[list[str]] = SET,
    out: Optional[Path] = _common["out"], force: bool = FORCE,
) -> None:
    """One sparse decode step (indexer + top-k + sparse attention) vs one dense SDPA decode step.
    On a CPU the kernels need TRITON_INTERPRET=1."""
    with cli_errors():
        from sparse_rl.config import load_config

        refuse_existing(force, out=out)
        index_topk = renamed(index_topk, topk_old, "--topk", "--index-topk")
        from sparse_rl.bench.decode import BenchDecodeConfig, markdown_decode, run_decode_bench

        cfg = load_config(BenchDecodeConfig, config, dict(
            contexts=ints("--contexts", contexts, positive=True), batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            topk=index_topk, index_heads=index_heads, index_dim=index_dim, splits=ints("--splits", splits, positive=True),
            check=check, dtype=dtype, rep_ms=rep_ms, device=device), sets=set_)
        res = run_decode_bench(cfg, log=lambda m: console.print(f"[dim]{m}[/]"))
        _finish(res, markdown_decode(res), out)


@app.command("rollout")
def rollout(
    shape: Optional[str] = typer.Option(None, help="Model shape, random weights: qwen3-4b | qwen3-8b | qwen2-0.5b | tiny | "
                                                    "tiny-qwen3 [default: qwen2-0.5b]"),
    batch: Optional[int] = typer.Option(None, help="Engine vs HF generate: sequences [default: 64]"),
    prompt_len: Optional[int] = typer.Option(None, help="Engine vs HF generate: prompt tokens [default: 128]"),
    new_tokens: Optional[int] = typer.Option(None, help="Engine vs HF generate: new tokens [default: 512]"),
    hf: Optional[bool] = typer.Option(None, "--hf/--no-hf", help="Time HF generate [default: on]"),
    hf_new_tokens: Optional[int] = typer.Option(None, help="New tokens for the HF run, 0 = --new-tokens [default: 0]"),
    eager: Optional[bool] = typer.Option(None, "--eager/--no-eager", help="Also time the engine without CUDA graphs [default: on]"),
    compile: Optional[bool] = compile_option(),
    long_new_tokens: Optional[str] = typer.Option(None, help="Sparse vs dense: generation lengths, e.g. 8K,16K or none [default: 8K,16K]"),
    long_batch: Optional[int] = typer.Option(None, help="Sparse vs dense: sequences [default: 16]"),
    index_topk: Optional[int] = _common["index_topk"], topk_old: Optional[int] = _common["topk_old"],
    long_batches: Optional[str] = typer.Option(None, help="Sparse vs dense: sequences per generation length, e.g. "
                                                          "32,16 [default: --long-batch for every length]"),
    long_prompt_len: Optional[int] = typer.Option(None, help="Sparse vs dense: prompt tokens [default: 128]"),
    whole: Optional[str] = typer.Option(None, help="Long generations: measure | integrate (step times over the "
                                                   "contexts) | auto (measure if it fits --whole-budget-s) "
                                                   "[default: measure]"),
    whole_budget_s: Optional[float] = typer.Option(None, help="--whole auto: longest whole generation measured, "
                                                              "seconds [default: 90]"),
    step_contexts: Optional[str] = typer.Option(None, help="One-step rows at these contexts, e.g. 2K,16K "
                                                           "[default: none]"),
    step_batch: Optional[int] = typer.Option(None, help="Sequences in the one-step rows [default: 32]"),
    latency_contexts: Optional[str] = typer.Option(None, help="One-step rows at batch 1, e.g. 2K [default: none]"),
    decode_select: Optional[str] = typer.Option(None, help="Indexer decode select after the score pass: fine | auto | "
                                                           "chunked | row | split | bits | bsearch | sync | cuda (same keys; cuda: a CUDA "
                                                           "block or cluster a row, NVRTC-compiled; fine where it "
                                                           "cannot build) [default: cuda]"),
    score_block: Optional[int] = typer.Option(None, help="Keys a step of the decode score pass, a power of two (0: the "
                                                         "select's own; sync has no separate pass and keeps its "
                                                         "own) [default: 64]"),
    decode_long: Optional[str] = typer.Option(None, help="--decode-select auto past 8192 keys: chunked | row | split | "
                                                         "fine | bits | bsearch [default: chunked]"),
    sync_min_batch: Optional[int] = typer.Option(None, help="Batches of at least this many sequences take the sync "
                                                            "select whatever --decode-select says (0: never) "
                                                            "[default: 0]"),
    qkv_pad: Optional[int] = typer.Option(None, help="Fused q/k/v(+indexer) weight padded to a multiple of this many "
                                                     "output columns [default: 64]"),
    pdl: Optional[bool] = typer.Option(None, "--pdl/--no-pdl", help="Programmatic dependent launch of the decode "
                                       "step's Triton kernels (Hopper+; off elsewhere) [default: the engine's]"),
    select_streams: Optional[int] = typer.Option(None, help="The sparse layers' select + attention in this many row "
                                                            "groups, each on its own CUDA stream [default: 1]"),
    step_timing: Optional[str] = typer.Option(None, help="Step rows (and the integrated generations' points): synced "
                                                         "(each step on an idle device, median of 20) | queued (20 "
                                                         "steps back to back, as a generation runs them) "
                                                         "[default: synced]"),
    index_heads: Optional[int] = _common["index_heads"], index_dim: Optional[int] = _common["index_dim"],
    index_dtype: Optional[str] = INDEX_DTYPE,
    dtype: Optional[str] = typer.Option(None, help="bfloat16 | float16 | float32 [default: bfloat16]"),
    device: Optional[str] = device_option(),
    config: Optional[Path] = CONFIG, set_: Optional[list[str]] = SET,
    out: Optional[Path] = _common["out"], force: bool = FORCE,
) -> None:
    """Rollout engine tokens/s vs HF generate (dense), one-step rows beside their memory floor, and sparse vs
    dense mode for long generations (measured, or integrated from step times where they would not fit)."""
    with cli_errors():
        from sparse_rl.config import load_config

        refuse_existing(force, out=out)
        index_topk = renamed(index_topk, topk_old, "--topk", "--index-topk")
        from sparse_rl.bench.rollout import BenchRolloutConfig, markdown_rollout, run_rollout_bench

        longs = ints("--long-new-tokens", long_new_tokens, positive=True)
        cfg = load_config(BenchRolloutConfig, config, dict(
            shape=shape, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, hf=hf, hf_new_tokens=hf_new_tokens,
            eager=eager, long_new_tokens=longs, long_batch=long_batch, long_batches=ints("--long-batches", long_batches),
            long_prompt_len=long_prompt_len, whole=whole, whole_budget_s=whole_budget_s,
            step_contexts=ints("--step-contexts", step_contexts), step_batch=step_batch,
            latency_contexts=ints("--latency-contexts", latency_contexts), topk=index_topk, index_heads=index_heads,
            index_dim=index_dim, index_dtype=index_dtype, dtype=dtype, device=device, compile=compile,
            decode_select=decode_select,
            decode_long=decode_long, score_block=score_block, sync_min_batch=sync_min_batch, qkv_pad=qkv_pad, pdl=pdl,
            select_streams=select_streams, step_timing=step_timing), sets=set_)
        res = run_rollout_bench(cfg, log=lambda m: console.print(f"[dim]{m}[/]"))
        _finish(res, markdown_rollout(res), out)
