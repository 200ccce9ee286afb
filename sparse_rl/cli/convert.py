"""`sparse-rl convert IN OUT`: add an indexer (or block selector) to a dense checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import (CONFIG, FORCE, INDEX_DIM, INDEX_DTYPE, INDEX_HEADS, SET, cli_errors, console, ints,
                                  old_spelling, renamed, seed_option)


def command(
    src: Path = typer.Argument(..., metavar="IN", help="Dense HF model dir (llama, qwen2, qwen3, mistral)."),
    out: Path = typer.Argument(..., metavar="OUT", help="Sparse model dir to write."),
    selector: Optional[str] = typer.Option(None, help="indexer (DSA lightning indexer) | block (training-free) [default: indexer]"),
    index_topk: Optional[int] = typer.Option(None, "--index-topk",
                                             help="Keys each query attends to, sinks and window included (DSA's index_topk) [default: 2048]"),
    topk_old: Optional[int] = old_spelling("--topk", "--index-topk"),
    index_heads: Optional[int] = INDEX_HEADS,
    index_dim: Optional[int] = INDEX_DIM,
    rope_dim: Optional[int] = typer.Option(None, help="RoPE'd dims of d_I [default: min(32, index dim, head dim)]"),
    sink: Optional[int] = typer.Option(None, help="First tokens always kept [default: 4]"),
    window: Optional[int] = typer.Option(None, help="Most recent tokens always kept [default: 64]"),
    dense_layers: Optional[str] = typer.Option(None, help="Layers kept dense, e.g. 0,1 or none [default: 0,1]"),
    block_size: Optional[int] = typer.Option(None, help="Block selector: keys per block [default: 64]"),
    topk_blocks: Optional[int] = typer.Option(None, help="Block selector: blocks kept per query [default: 32]"),
    sink_blocks: Optional[int] = typer.Option(None, help="Block selector: first blocks always kept [default: 1]"),
    recent_blocks: Optional[int] = typer.Option(None, help="Block selector: last blocks always kept [default: 2]"),
    key_block: Optional[int] = typer.Option(None, help="Indexer: select keys in aligned blocks of N tokens (1 = token-level; 4, 16, 64 = page-level) [default: 1]"),
    query_group: Optional[int] = typer.Option(None, help="Indexer: G consecutive queries share one selection (1 = per query) [default: 1]"),
    block_score: Optional[str] = typer.Option(None, help="Indexer: a key block's score, max | mean over its tokens [default: max]"),
    index_dtype: Optional[str] = INDEX_DTYPE,
    seed: Optional[int] = seed_option(),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    force: bool = FORCE,
) -> None:
    """Turn a dense checkpoint into a sparse model dir (base weights copied untouched)."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.sparse.convert import ConvertConfig, convert

        index_topk = renamed(index_topk, topk_old, "--topk", "--index-topk")
        flags = dict(selector=selector, topk=index_topk, index_heads=index_heads, index_dim=index_dim, rope_dim=rope_dim,
                     sink=sink, window=window, dense_layers=ints("--dense-layers", dense_layers),
                     block_size=block_size, topk_blocks=topk_blocks, sink_blocks=sink_blocks,
                     recent_blocks=recent_blocks, key_block=key_block, query_group=query_group,
                     block_score=block_score, index_dtype=index_dtype)
        overrides = {f"sparse.{k}": v for k, v in flags.items()}
        overrides["seed"] = seed
        cfg = load_config(ConvertConfig, config, overrides, sets=set_)
        summary = convert(src, out, cfg, force=force)
        gran = (f", key blocks of {summary['key_block']}, query groups of {summary['query_group']}"
                if summary["selector"] == "indexer" else "")
        console.print(f"[green]wrote[/] {out}  (selector {summary['selector']}, {summary['budget']} keys/query{gran}, "
                      f"{len(summary['sparse_layers'])} sparse layers)")
        typer.echo(json.dumps(summary))
