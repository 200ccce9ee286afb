"""Indexer-training checkpoints: what `sparse_rl.runs.save_checkpoint` puts into `checkpoints/step-N/`.

A checkpoint holds what an exact continuation needs: the trainable tensors (`trainable.safetensors`:
the indexers, plus the model's weights or LoRA adapter in the sparse stage), the optimizer and LR
scheduler (`optimizer.pt`), and, from the run-dir module, the RNG states (`rng.pt`) and `meta.json`
(step, data cursor, stage, time). Naming, atomicity, pruning and `latest()` are `sparse_rl.runs`'.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError
from sparse_rl.io import writing
from sparse_rl.runs import load_rng, save_checkpoint, torch_save

TRAINABLE = "trainable.safetensors"


def save(run_dir: str | Path, step: int, trainable: dict[str, torch.Tensor], optimizer, scheduler,
         meta: dict, keep: int = 2) -> Path:
    """Write `checkpoints/step-{step}` atomically, then prune to the newest `keep` checkpoints."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        with writing(tmp / TRAINABLE):
            save_file({k: v.detach().contiguous().cpu() for k, v in trainable.items()}, str(tmp / TRAINABLE))
        torch_save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")

    return save_checkpoint(run_dir, step, write, meta, keep=keep)


def load(path: str | Path, device: str | torch.device = "cpu") -> dict:
    """Read a checkpoint: {"trainable", "optimizer", "scheduler", "rng", "meta"}."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    try:
        meta = json.loads((p / "meta.json").read_text())
        trainable = load_file(str(p / TRAINABLE), device=str(device))
        opt = torch.load(p / "optimizer.pt", map_location=device, weights_only=True)
        rng = load_rng(p)
    except (OSError, json.JSONDecodeError, SafetensorError, RuntimeError, KeyError) as e:
        raise SparseRLError(f"checkpoint {p}: unreadable ({str(e).splitlines()[0][:160]}); "
                            "delete it to resume from the one before") from None
    return {"trainable": trainable, "optimizer": opt["optimizer"], "scheduler": opt["scheduler"], "rng": rng,
            "meta": meta}


def restore(path: str | Path, named: dict[str, torch.Tensor], optimizer, scheduler, device) -> dict:
    """Load checkpoint `path` into a run: the trainable tensors `named` (copied in place), the optimizer,
    the scheduler and this process's RNG states. Returns its meta.json (step, cursor, ...)."""
    from sparse_rl.runs import set_rng_state

    ck = load(path, device)
    missing = set(named) - set(ck["trainable"])
    if missing:
        raise SparseRLError(f"checkpoint {path}: lacks {sorted(missing)[0]} (it was written by another setup)")
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(ck["trainable"][n])
    optimizer.load_state_dict(ck["optimizer"])
    scheduler.load_state_dict(ck["scheduler"])
    set_rng_state(ck["rng"])
    return ck["meta"]


def begin_run(run_dir: Path, ckpt: Path | None, cfg, named: dict[str, torch.Tensor], optimizer, scheduler, device,
              main: bool, log) -> tuple[int, int]:
    """Start or resume a run in `run_dir`: restore checkpoint `ckpt` (if any) and drop metrics lines
    past its step, then (rank 0) write the resolved config. Returns (step, data cursor)."""
    from sparse_rl.config import save_config
    from sparse_rl.runs import truncate_metrics

    step, cursor = 0, 0
    if ckpt is not None:
        meta = restore(ckpt, named, optimizer, scheduler, device)
        step, cursor = int(meta["step"]), int(meta["cursor"])
        if main:
            truncate_metrics(run_dir, step, log=log)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    return step, cursor
