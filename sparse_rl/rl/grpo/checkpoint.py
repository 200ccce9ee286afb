"""Atomic GRPO checkpoints: `run_dir/checkpoints/step-N/`.

    policy/        a loadable model dir (HF weights of theta, tokenizer, sparse_config.json + indexer
                   weights for sparse models): `sparse-rl eval`/`generate` open it directly
    adapter/       the LoRA adapter phi (peft `save_pretrained`), sparse+distill mode only
    optimizer.pt   {"policy": ..., "distill": ...} optimizer states
    rng.pt         per-rank RNG states: python, numpy, torch CPU, every CUDA device
    meta.json      step, data cursor, KL coefficient, dynamic-sampling keep rate, world size, config

Naming, atomicity (temporary dir renamed into place), pruning, `latest()` and the RNG states are
the run-dir module's (`sparse_rl.runs`). Only rank 0 writes; the other ranks' RNG states reach it
by all_gather.

With `parallel: fsdp` (theta sharded, see parallel.FSDPPolicy) the format is the same: the caller
gathers the full weights (`full_state`) and the policy optimizer's full state (keyed by parameter
name instead of index) for rank 0 to write; `load` copies each full tensor into the local shard.
meta.json records the layout, and a checkpoint resumes only under the layout that wrote it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError
from sparse_rl.runs import latest, list_checkpoints, load_rng, rng_state, set_rng_state  # noqa: F401  (API)
from sparse_rl.runs import read_meta, save_checkpoint, torch_save


def _clean_key(k: str) -> str:
    """peft-wrapped parameter name -> the plain HF name."""
    return k.removeprefix("base_model.model.").replace(".base_layer.", ".")


def policy_state_dict(model, full_state: dict | None = None) -> dict[str, torch.Tensor]:
    """theta (and the frozen indexers) under plain HF names, without LoRA tensors. full_state: the
    model's gathered full state dict (FSDP), used instead of the model's own (sharded) tensors."""
    if full_state is not None:
        return {_clean_key(k): v for k, v in full_state.items() if "lora_" not in k}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_clean_key(k): v for k, v in base.state_dict().items() if "lora_" not in k}


def _indexers_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Indexer weights of a plain-named state dict, keyed `layers.{i}.{param}` like `indexer_state_dict`."""
    import re

    out = {}
    for k, v in state.items():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.self_attn\.indexer\.(.+)$", k)
        if m:
            out[f"layers.{m.group(1)}.{m.group(2)}"] = v
    return out


def save_policy(model, tokenizer, out: Path, full_state: dict | None = None) -> None:
    """Write theta as a model dir into the existing directory `out` (see module doc). full_state: the
    gathered full state dict of a sharded (FSDP) model."""
    from safetensors.torch import save_file

    from sparse_rl.sparse.config import INDEXER_WEIGHTS
    from sparse_rl.sparse.layer import sparse_config
    from sparse_rl.sparse.patch import indexer_state_dict

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    plain = policy_state_dict(model, full_state)
    state = {k: v for k, v in plain.items() if ".indexer." not in k}
    base.save_pretrained(out, state_dict=state)
    tokenizer.save_pretrained(out)
    cfg = sparse_config(model)
    if cfg is not None:
        cfg.save(out)
        idx = indexer_state_dict(model) if full_state is None else _indexers_of(plain)
        if idx:
            save_file({k: v.detach().contiguous().cpu() for k, v in idx.items()}, str(out / INDEXER_WEIGHTS))
    import json

    cfg_file = out / "config.json"
    data = json.loads(cfg_file.read_text())
    if data.pop("_attn_implementation", None) is not None or data.pop("attn_implementation", None) is not None:
        cfg_file.write_text(json.dumps(data, indent=2))


def load_policy(model, policy_dir: Path) -> None:
    """Copy the weights of a checkpoint's `policy/` dir into `model` (peft-wrapped or not) in place."""
    from safetensors.torch import load_file

    from sparse_rl.sparse.config import INDEXER_WEIGHTS

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = {_clean_key(k): v for k, v in base.state_dict(keep_vars=True).items() if "lora_" not in k}
    files = [f for f in sorted(policy_dir.glob("*.safetensors")) if f.name != INDEXER_WEIGHTS]
    if not files:
        raise SparseRLError(f"{policy_dir}: no weights in the checkpoint (it may be damaged; remove it to resume "
                            "from the one before)")
    from torch.distributed.tensor import DTensor, distribute_tensor

    loaded = 0
    with torch.no_grad():
        for f in files:
            for k, v in load_file(str(f)).items():
                if k not in own:
                    raise SparseRLError(f"{f}: parameter {k!r} does not belong to the model; resume with the same MODEL")
                dst = own[k]
                if isinstance(dst, DTensor):  # FSDP shard: every rank read the full tensor, keeps its own part
                    v = distribute_tensor(v.to(dst.device), dst.device_mesh, dst.placements, src_data_rank=None)
                dst.copy_(v)
                loaded += 1
    if loaded == 0:
        raise SparseRLError(f"{policy_dir}: the checkpoint holds no parameters")


def save(run_dir: str | Path, step: int, *, model, tokenizer, optimizers: dict, rng_states: list[dict], meta: dict,
         keep: int = 0, full_state: dict | None = None, optim_states: dict | None = None) -> Path:
    """Write checkpoints/step-`step` atomically and prune to the newest `keep` (0 = keep all). Rank 0 only.
    FSDP: full_state = the gathered model state dict; optim_states = {name: gathered optimizer state},
    used instead of `optimizers[name].state_dict()`."""
    def write(tmp: Path) -> None:
        (tmp / "policy").mkdir()
        save_policy(model, tokenizer, tmp / "policy", full_state)
        if hasattr(model, "peft_config"):
            model.save_pretrained(str(tmp / "adapter"))
        gathered = optim_states or {}
        torch_save({k: gathered[k] if k in gathered else o.state_dict() for k, o in optimizers.items()
                    if o is not None}, tmp / "optimizer.pt")

    return save_checkpoint(run_dir, step, write, meta, rng_states=rng_states, keep=keep)


def load(path: Path, *, model, optimizers: dict, rank: int, world: int, parallel: str = "ddp",
         optim_loaders: dict | None = None) -> tuple[dict, dict]:
    """Restore weights, adapter and optimizer states in place; return (meta, this rank's RNG state).
    parallel: the resuming run's layout (must be the checkpoint's); optim_loaders: {name: fn(optimizer,
    state)} for optimizers whose state is not loaded by `load_state_dict` (FSDP's full state)."""
    meta = read_meta(path)
    if int(meta.get("world_size", 1)) != world:
        raise SparseRLError(f"{path}: saved by {meta.get('world_size')} processes, resumed with {world}; "
                            "resume with the same number of processes")
    saved = meta.get("parallel", "ddp")
    if saved != parallel:
        raise SparseRLError(f"{path}: saved with parallel={saved}, resumed with parallel={parallel}; "
                            f"resume with --set parallel={saved}")
    load_policy(model, path / "policy")
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        afile = path / "adapter" / "adapter_model.safetensors"
        if not afile.is_file():
            raise SparseRLError(f"{afile}: missing; this checkpoint has no LoRA adapter (was the run in sparse+distill mode?)")
        set_peft_model_state_dict(model, load_file(str(afile)))
    states = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    for k, opt in optimizers.items():
        if opt is None:
            continue
        if k not in states:
            raise SparseRLError(f"{path}/optimizer.pt: no {k} optimizer state (the run's mode changed?)")
        loader = (optim_loaders or {}).get(k)
        if loader is not None:
            loader(opt, states[k])
        else:
            opt.load_state_dict(states[k])
    return meta, load_rng(path)[rank]
