"""`sparse-rl demo`: the whole chain on a tiny model, offline, on a CPU, in a few minutes.

Each step writes its output into the run dir and is skipped when that output already exists, so
an interrupted demo resumes where it stopped. The steps call the same functions the stage
commands call; the demo grows as stages land.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from sparse_rl.cli.common import console


@dataclass
class DemoConfig:
    arch: str = "qwen2"
    size: str = "tiny"
    seed: int = 0
    seq_len: int = 128
    topks: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128])
    n_texts: int = 8


@dataclass
class Step:
    name: str
    output: str  # path relative to the run dir whose existence marks the step done
    fn: Callable[[Path, DemoConfig], dict]


def _init(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.modelinit import ModelInitConfig, init_model

    return init_model(run / "model", ModelInitConfig(arch=cfg.arch, size=cfg.size, seed=cfg.seed))


def _convert(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert

    sc = SparseConfig(topk=max(cfg.topks), index_heads=4, index_dim=32, sink=2, window=4, dense_layers=[0, 1])
    return convert(run / "model", run / "sparse", ConvertConfig(sparse=sc, seed=cfg.seed))


def agreement_table(model_dir: Path, texts: list[str], seq_len: int, topks: list[int]) -> list[dict]:
    """Dense vs sparse next-token agreement and mean token KL(dense || sparse) at each top-k."""
    from sparse_rl.sparse.loader import load_model, load_tokenizer, set_attention
    from sparse_rl.sparse.patch import decoder_layers

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, attention="dense")
    ids = [tok(t)["input_ids"][:seq_len] for t in texts]
    ids = torch.tensor([x for x in ids if len(x) == seq_len])
    with torch.no_grad():
        dense = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    rows = []
    set_attention(model, "sparse")
    for k in topks:
        for layer in decoder_layers(model):
            if getattr(layer.self_attn, "srl", None) is not None:
                layer.self_attn.srl.cfg.topk = k
        with torch.no_grad():
            sparse = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        agree = (sparse.argmax(-1) == dense.argmax(-1)).float().mean().item()
        kl = (dense.exp() * (dense - sparse)).sum(-1).mean().item()
        rows.append({"topk": k, "keys_read": min(1.0, k / seq_len), "top1_agreement": agree, "token_kl": kl})
    return rows


def _agreement(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.corpus import builtin_text

    texts = [" ".join(builtin_text(40, seed=cfg.seed + 100 + i)) for i in range(cfg.n_texts)]
    rows = agreement_table(run / "sparse", texts, cfg.seq_len, cfg.topks)
    from sparse_rl.io import atomic_write_json

    atomic_write_json(run / "agreement.json", rows)
    return {"rows": rows}


STEPS: list[Step] = [
    Step("model init", "model", _init),
    Step("convert", "sparse", _convert),
    Step("dense vs sparse agreement", "agreement.json", _agreement),
]


def run_demo(run: Path, cfg: DemoConfig) -> dict:
    run.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    summary: dict = {"run_dir": str(run), "steps": []}
    for step in STEPS:
        t0 = time.perf_counter()
        if (run / step.output).exists():
            console.print(f"[dim]skip[/] {step.name} (found {step.output})")
            summary["steps"].append({"step": step.name, "status": "skipped"})
            continue
        with console.status(f"{step.name} ..."):
            info = step.fn(run, cfg)
        dt = time.perf_counter() - t0
        console.print(f"[green]done[/] {step.name} ({dt:.1f}s)")
        summary["steps"].append({"step": step.name, "status": "done", "seconds": round(dt, 2)})
    summary["agreement"] = json.loads((run / "agreement.json").read_text())
    return summary


def print_summary(summary: dict) -> None:
    from rich.table import Table

    table = Table(title="dense vs sparse (tiny model, random indexer)")
    for col in ("top-k", "keys read", "top-1 agreement", "token KL"):
        table.add_column(col, justify="right")
    for r in summary["agreement"]:
        table.add_row(str(r["topk"]), f"{r['keys_read']:.0%}", f"{r['top1_agreement']:.3f}", f"{r['token_kl']:.4f}")
    console.print(table)
