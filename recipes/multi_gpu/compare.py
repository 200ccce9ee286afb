"""Reads the runs of `recipes/multi_gpu/run.sh OUT` and prints the table issue 18 asks for: each
2-GPU run's final weights against the 1-GPU run of the same global batch (relative L2 difference over
all tensors), the per-step metrics side by side, and the throughput and time split of 1 vs 2 GPUs.
Writes OUT/multi_gpu.json. Usage: python recipes/multi_gpu/compare.py OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update({k: v.double() for k, v in load_file(str(f)).items()})
    return out


def rel_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        raise SystemExit(f"tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / max(den, 1e-300)) ** 0.5


def final_policy(run: Path) -> Path:
    steps = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    if not steps:
        raise SystemExit(f"{run}: no checkpoint")
    return steps[-1] / "policy"


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows[1:] if r.get(key) is not None]  # step 1 carries compile/warm-up time
    return sum(vals) / len(vals) if vals else None


def main(out: Path) -> None:
    res: dict = {"grpo": {}, "indexer": {}}
    ref = weights(final_policy(out / "grpo_1gpu"))
    ref_m = metrics(out / "grpo_1gpu")
    print("| run | weights vs 1 GPU (rel. L2) | max |reward diff| per step | rollout tok/s | step s | rollout s | dense fwd s | update s | distill s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("grpo_1gpu", "grpo_ddp", "grpo_fsdp", "grpo_accel", "grpo_fsdp_killed"):
        run = out / name
        if not (run / "metrics.jsonl").is_file():
            continue
        m = metrics(run)
        d = rel_diff(weights(final_policy(run)), ref)
        rdiff = max((abs((a.get("reward") or 0) - (b.get("reward") or 0)) for a, b in zip(m, ref_m)), default=None)
        row = {"weights_rel_diff": d, "max_reward_diff": rdiff, "steps": len(m)}
        for k in ("rollout_tokens_per_s", "time_step", "time_rollout", "time_dense_forward", "time_update", "time_distill"):
            row[k] = mean(m, k)
        res["grpo"][name] = row
        f = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
        print(f"| {name} | {d:.2e} | {f(rdiff)} | {f(row['rollout_tokens_per_s'])} | {f(row['time_step'])} | "
              f"{f(row['time_rollout'])} | {f(row['time_dense_forward'])} | {f(row['time_update'])} | {f(row['time_distill'])} |")
    if (out / "indexer_ddp" / "model").is_dir():
        a = weights(out / "indexer_1gpu" / "model")
        b = weights(out / "indexer_ddp" / "model")
        res["indexer"]["ddp_vs_1gpu_rel_diff"] = rel_diff(b, a)
        print(f"\nindexer warm-up, DDP (2 GPUs) vs 1 GPU: weights rel. L2 {res['indexer']['ddp_vs_1gpu_rel_diff']:.2e}")
    (out / "multi_gpu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
