"""Atomic training checkpoints: `run_dir/checkpoints/step-N/`.

A checkpoint holds what an exact continuation needs: the trainable tensors (`trainable.safetensors`:
the indexers, plus the model's weights or LoRA adapter in the sparse stage), the optimizer and LR
scheduler (`optimizer.pt`), the RNG states (`rng.pt`), and `meta.json` (step, data cursor, stage,
time). It is written into a temporary directory and renamed, so a killed run leaves either a
complete checkpoint or none; `latest` ignores anything without `meta.json`.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError
from sparse_rl.io import list_checkpoints  # noqa: F401  (part of this module's API)



def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: str | Path, step: int, trainable: dict[str, torch.Tensor], optimizer, scheduler,
         meta: dict, keep: int = 2) -> Path:
    """Write `checkpoints/step-{step}` atomically, then prune to the newest `keep` checkpoints."""
    from safetensors.torch import save_file

    from sparse_rl.io import atomic_dir, atomic_write_json

    path = checkpoint_dir(run_dir) / f"step-{step}"
    with atomic_dir(path, force=True, flag="checkpoint") as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        atomic_write_json(tmp / "meta.json", {"step": step, **meta})
    if keep > 0:
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load(path: str | Path, device: str | torch.device = "cpu") -> dict:
    """Read a checkpoint: {"trainable", "optimizer", "scheduler", "rng", "meta"}."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    try:
        meta = json.loads((p / "meta.json").read_text())
        trainable = load_file(str(p / "trainable.safetensors"), device=str(device))
        opt = torch.load(p / "optimizer.pt", map_location=device, weights_only=True)
        rng = torch.load(p / "rng.pt", map_location="cpu", weights_only=False)  # python's RNG state is a tuple
    except (OSError, json.JSONDecodeError, SafetensorError, RuntimeError, KeyError) as e:
        raise SparseRLError(f"checkpoint {p}: unreadable ({str(e).splitlines()[0][:160]}); "
                            "delete it to resume from the one before") from None
    return {"trainable": trainable, "optimizer": opt["optimizer"], "scheduler": opt["scheduler"], "rng": rng,
            "meta": meta}
