"""`sparse-rl demo`: the whole chain on a tiny model, offline, on a CPU, in a few minutes.

model init -> synth math tasks -> convert -> LM pre-training on the synthetic retrieval source
(sparse stage with k = L, i.e. dense) -> indexer warm-up at k = L/8 -> indexer eval (attn_recall,
LM loss dense vs sparse) -> dense-vs-sparse agreement before/after warm-up -> generate (dense and
sparse) -> eval math -> a few GRPO steps with sparse rollouts and LoRA distillation.

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

from sparse_rl.console import console


@dataclass
class DemoConfig:
    arch: str = "qwen2"
    size: str = "tiny"
    seed: int = 0
    seq_len: int = 256
    topks: list[int] = field(default_factory=lambda: [16, 32, 64, 256])
    n_texts: int = 8
    n_tasks: int = 32
    n_eval: int = 8
    pretrain_steps: int = 150
    warmup_steps: int = 60
    max_new_tokens: int = 24
    grpo_steps: int = 3


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

    sc = SparseConfig(topk=cfg.seq_len // 8, index_heads=4, index_dim=32, sink=2, window=4, dense_layers=[0])
    return convert(run / "model", run / "sparse", ConvertConfig(sparse=sc, seed=cfg.seed))


def agreement_table(model_dir: Path, texts: list[str], seq_len: int, topks: list[int]) -> list[dict]:
    """Dense vs sparse next-token agreement and mean token KL(dense || sparse) at each top-k."""
    from sparse_rl.sparse.loader import load_model, load_tokenizer, set_attention
    from sparse_rl.sparse.layer import set_topk

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, attention="dense")
    ids = [tok(t)["input_ids"][:seq_len] for t in texts]
    ids = torch.tensor([x for x in ids if len(x) == seq_len])
    with torch.no_grad():
        dense = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    rows = []
    set_attention(model, "sparse")
    for k in topks:
        set_topk(model, k)
        with torch.no_grad():
            sparse = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        agree = (sparse.argmax(-1) == dense.argmax(-1)).float().mean().item()
        kl = (dense.exp() * (dense - sparse)).sum(-1).mean().item()
        rows.append({"topk": k, "keys_read": min(1.0, k / seq_len), "top1_agreement": agree, "token_kl": kl})
    return rows


def _texts(cfg: DemoConfig) -> list[str]:
    from sparse_rl.corpus import builtin_text

    return [" ".join(builtin_text(40, seed=cfg.seed + 100 + i)) for i in range(cfg.n_texts)]


def _agreement(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.io import atomic_write_json

    before = agreement_table(run / "pretrained", _texts(cfg), cfg.seq_len, cfg.topks)
    after = agreement_table(run / "indexer", _texts(cfg), cfg.seq_len, cfg.topks)
    rows = [dict(b, top1_after_warmup=a["top1_agreement"], token_kl_after_warmup=a["token_kl"])
            for b, a in zip(before, after)]
    atomic_write_json(run / "agreement.json", rows)
    return {"rows": rows}


def _synth(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.io import write_jsonl
    from sparse_rl.synth.pipeline import SynthMathConfig, run_math

    tasks, stats = run_math(SynthMathConfig(n=cfg.n_tasks, seed=cfg.seed, families=["arith", "word"],
                                            min_level=1, max_level=1))
    held, _ = run_math(SynthMathConfig(n=cfg.n_eval, seed=cfg.seed + 1, families=["arith"], min_level=1,
                                       max_level=1))
    write_jsonl(run / "eval_tasks.jsonl", held)
    write_jsonl(run / "tasks.jsonl", tasks)
    return {"tasks": len(tasks), "eval_tasks": len(held)}


def _train(run: Path, cfg: DemoConfig, stage: str, src: str, out: str, steps: int, **kw) -> dict:
    from sparse_rl.sparse.train.trainer import IndexerTrainConfig, run as train

    return train(IndexerTrainConfig(model=str(run / src), out=str(run / out), run_dir=str(run / f"{out}.run"),
                                    data="synthetic", stage=stage, seq_len=cfg.seq_len, batch_size=4, steps=steps,
                                    synthetic_rows=256, seed=cfg.seed, device="cpu", save_every=steps, **kw),
                 force=True, console=console)


def _pretrain(run: Path, cfg: DemoConfig) -> dict:
    # A random model has no attention structure for an indexer to learn: first a short LM training on
    # the synthetic retrieval source, in sparse mode with k = L (exactly dense attention).
    return _train(run, cfg, "sparse", "sparse", "pretrained", cfg.pretrain_steps, topk=cfg.seq_len, model_lr=3e-3,
                  lr=0.0)


def _warmup(run: Path, cfg: DemoConfig) -> dict:
    return _train(run, cfg, "warmup", "pretrained", "indexer", cfg.warmup_steps, topk=cfg.seq_len // 8, lr=3e-3)


def _recall(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.io import atomic_write_json
    from sparse_rl.sparse.train.trainer import IndexerEvalConfig, run_eval

    res = {}
    for name in ("pretrained", "indexer"):
        res[name] = run_eval(IndexerEvalConfig(model=str(run / name), seq_len=cfg.seq_len, rows=8,
                                               topk=cfg.seq_len // 8, device="cpu"))
    atomic_write_json(run / "indexer_eval.json", res)
    return res


def _generate(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.rl.rollout.generate import GenerateConfig, run_generate

    out = {}
    for mode in ("dense", "sparse"):
        gcfg = GenerateConfig(attention=mode, temperature=0.0, max_new_tokens=cfg.max_new_tokens, device="cpu",
                              logprobs=True)
        out[mode] = run_generate(run / "indexer", run / "eval_tasks.jsonl", run / f"completions_{mode}.jsonl", gcfg)
    return out


def _grpo(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.rl.grpo.config import (CheckpointConfig, DataConfig, DistillConfig, GRPOConfig, OptimConfig,
                                          RolloutConfig)
    from sparse_rl.rl.grpo.trainer import run as grpo

    gcfg = GRPOConfig(model=str(run / "indexer"), out=str(run / "grpo"), steps=cfg.grpo_steps, seed=cfg.seed,
                      device="cpu", plot_every=cfg.grpo_steps,
                      data=DataConfig(tasks=str(run / "tasks.jsonl"), prompts_per_step=4),
                      rollout=RolloutConfig(mode="sparse+distill", samples=4, keep=2, max_new_tokens=cfg.max_new_tokens),
                      optim=OptimConfig(lr=1e-4, micro_batch=8), distill=DistillConfig(lora_r=4, lora_alpha=8, lr=1e-3),
                      checkpoint=CheckpointConfig(every=cfg.grpo_steps))
    return grpo(gcfg)


def _eval(run: Path, cfg: DemoConfig) -> dict:
    from sparse_rl.eval.math_eval import MathEvalConfig, run as eval_math
    from sparse_rl.io import atomic_write_json

    res = {}
    for mode in ("dense", "sparse"):
        summary, _ = eval_math(MathEvalConfig(problems=str(run / "eval_tasks.jsonl"),
                                              score=str(run / f"completions_{mode}.jsonl")))
        res[mode] = summary
    atomic_write_json(run / "eval_math.json", res)
    return res


STEPS: list[Step] = [
    Step("model init", "model", _init),
    Step("synth math tasks", "tasks.jsonl", _synth),
    Step("convert", "sparse", _convert),
    Step("LM pre-training (sparse stage, k = L)", "pretrained", _pretrain),
    Step("indexer warm-up (k = L/8)", "indexer", _warmup),
    Step("indexer eval", "indexer_eval.json", _recall),
    Step("dense vs sparse agreement", "agreement.json", _agreement),
    Step("generate dense + sparse", "completions_sparse.jsonl", _generate),
    Step("eval math", "eval_math.json", _eval),
    Step("grpo sparse+distill", "grpo/metrics.jsonl", _grpo),
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
    ev = json.loads((run / "indexer_eval.json").read_text())
    summary["indexer_eval"] = {k: {m: v[m] for m in ("attn_recall", "oracle_recall", "kl", "lm_loss_dense",
                                                     "lm_loss_sparse")} for k, v in ev.items()}
    evals = json.loads((run / "eval_math.json").read_text())
    summary["eval_math"] = {m: evals[m].get("accuracy") for m in evals}
    lines = (run / "grpo" / "metrics.jsonl").read_text().splitlines()
    summary["grpo"] = [json.loads(x) for x in lines]
    return summary


def print_summary(summary: dict) -> None:
    from rich.table import Table

    table = Table(title="dense vs sparse next-token agreement (tiny model)")
    for col in ("top-k", "keys read", "top-1, random indexer", "top-1, after warm-up", "KL, random", "KL, warm-up"):
        table.add_column(col, justify="right")
    for r in summary["agreement"]:
        table.add_row(str(r["topk"]), f"{r['keys_read']:.0%}", f"{r['top1_agreement']:.3f}",
                      f"{r['top1_after_warmup']:.3f}", f"{max(0.0, r['token_kl']):.4f}",
                      f"{max(0.0, r['token_kl_after_warmup']):.4f}")
    console.print(table)
    steps = Table(title="grpo, sparse rollouts + LoRA distillation (a few steps; the tiny model never saw math)")
    cols = [("step", "step"), ("reward", "reward"), ("mismatch KL", "mismatch_kl"), ("p5 min(1,pi/mu)", "mismatch_p5_ratio"),
            ("rollout tok/s", "rollout_tokens_per_s")]
    for name, _ in cols:
        steps.add_column(name, justify="right")
    for rec in summary["grpo"]:
        steps.add_row(*[_fmt(rec.get(key)) for _, key in cols])
    console.print(steps)
    acc = summary.get("eval_math", {})
    ev = summary.get("indexer_eval", {})
    if ev:
        console.print(f"indexer at k = L/8: attn_recall {ev['pretrained']['attn_recall']:.3f} (random) -> "
                      f"{ev['indexer']['attn_recall']:.3f} (warm-up), oracle {ev['indexer']['oracle_recall']:.3f}; "
                      f"LM loss dense {ev['indexer']['lm_loss_dense']:.3f}, sparse {ev['pretrained']['lm_loss_sparse']:.3f}"
                      f" -> {ev['indexer']['lm_loss_sparse']:.3f}")
    console.print(f"eval math (greedy, held-out tasks): dense {_fmt(acc.get('dense'))}, sparse {_fmt(acc.get('sparse'))}")
    console.print(f"run dir: {summary['run_dir']}")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
