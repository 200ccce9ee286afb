"""`sparse-rl convert IN OUT`: add an indexer (or block selector) to a dense checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import cli_errors, console
from sparse_rl.errors import UsageError


def parse_int_list(value: str | None, flag: str) -> list[int] | None:
    if value is None:
        return None
    if value.strip().lower() in ("", "none"):
        return []
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {value!r}: expected comma-separated layer numbers, e.g. 0,1 (or 'none')") from None


def command(
    src: Path = typer.Argument(..., metavar="IN", help="Dense HF model dir (llama, qwen2, qwen3, mistral)."),
    out: Path = typer.Argument(..., metavar="OUT", help="Sparse model dir to write."),
    selector: Optional[str] = typer.Option(None, help="indexer (DSA lightning indexer) | block (training-free) [default: indexer]"),
    topk: Optional[int] = typer.Option(None, help="Keys per query, sinks and window included [default: 2048]"),
    index_heads: Optional[int] = typer.Option(None, help="Indexer heads H_I [default: 4]"),
    index_dim: Optional[int] = typer.Option(None, help="Indexer dim d_I [default: 64]"),
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
    seed: Optional[int] = typer.Option(None, help="Indexer init seed [default: 0]"),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML recipe (keys: sparse.*, seed)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
) -> None:
    """Turn a dense checkpoint into a sparse model dir (base weights copied untouched)."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.sparse.convert import ConvertConfig, convert

        flags = dict(selector=selector, topk=topk, index_heads=index_heads, index_dim=index_dim, rope_dim=rope_dim,
                     sink=sink, window=window, dense_layers=parse_int_list(dense_layers, "--dense-layers"),
                     block_size=block_size, topk_blocks=topk_blocks, sink_blocks=sink_blocks,
                     recent_blocks=recent_blocks, key_block=key_block, query_group=query_group,
                     block_score=block_score)
        overrides = {f"sparse.{k}": v for k, v in flags.items()}
        overrides["seed"] = seed
        cfg = load_config(ConvertConfig, config, overrides)
        summary = convert(src, out, cfg, force=force)
        gran = (f", key blocks of {summary['key_block']}, query groups of {summary['query_group']}"
                if summary["selector"] == "indexer" else "")
        console.print(f"[green]wrote[/] {out}  (selector {summary['selector']}, {summary['budget']} keys/query{gran}, "
                      f"{len(summary['sparse_layers'])} sparse layers)")
        typer.echo(json.dumps(summary))
