"""`sparse-rl convert IN OUT`: add a selector to a dense HF checkpoint.

The base files are copied byte for byte (weights untouched, so plain transformers still loads OUT
as the dense model); `sparse_config.json` and, for the indexer selector, freshly initialised
`indexer.safetensors` are added. OUT is built in a temporary directory and renamed at the end.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError
from sparse_rl.sparse.config import INDEXER_WEIGHTS, SPARSE_CONFIG, SparseConfig


@dataclass
class ConvertConfig:
    """Stage config: the selector settings plus the indexer init seed."""

    sparse: SparseConfig = field(default_factory=SparseConfig)
    seed: int = 0


def _check_weights(path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    for f in sorted(path.glob("*.safetensors")):
        if f.name == INDEXER_WEIGHTS:
            continue
        try:
            with safe_open(str(f), framework="pt") as fh:
                fh.keys()
        except (SafetensorError, OSError, ValueError) as e:
            raise SparseRLError(f"{f}: corrupt weights file ({str(e)[:200]})") from None


def init_indexers(model_config: dict, cfg: SparseConfig, seed: int) -> dict[str, torch.Tensor]:
    """Fresh indexer weights `layers.{i}.{param}` for every non-dense layer, in the checkpoint dtype."""
    from sparse_rl.sparse.indexer import LightningIndexer
    from sparse_rl.devices import resolve_dtype

    dtype = resolve_dtype(model_config.get("dtype") or model_config.get("torch_dtype") or "float32")
    hidden, n_layers = model_config["hidden_size"], model_config["num_hidden_layers"]
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        out = {}
        for i in range(n_layers):
            if i in cfg.dense_layers:
                continue
            mod = LightningIndexer(hidden, cfg.index_heads, cfg.index_dim, cfg.rope_dim)
            for k, v in mod.state_dict().items():
                out[f"layers.{i}.{k}"] = v.to(dtype).contiguous()
    finally:
        torch.random.set_rng_state(gen_state)
    return out


def convert(src: str | Path, out: str | Path, cfg: ConvertConfig, force: bool = False) -> dict:
    """Write the sparse model dir OUT from the dense dir SRC; returns a summary dict."""
    from safetensors.torch import save_file

    from sparse_rl.io import atomic_dir
    from sparse_rl.sparse.loader import check_model_dir

    src, out = Path(src), Path(out)
    model_config = check_model_dir(src, flag="IN")
    if src.resolve() == out.resolve():
        raise SparseRLError(f"OUT {out}: must differ from IN (the dense checkpoint is never modified)")
    _check_weights(src)
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]
    sc = cfg.sparse.resolved(head_dim)
    n_layers = model_config["num_hidden_layers"]
    bad = [i for i in sc.dense_layers if not 0 <= i < n_layers]
    if bad:
        raise SparseRLError(f"--dense-layers {bad}: the model has layers 0..{n_layers - 1}")
    if sc.selector == "indexer" and sc.rope_dim > head_dim:
        raise SparseRLError(f"--rope-dim {sc.rope_dim}: must not exceed the model's head dim {head_dim}")
    with atomic_dir(out, force=force, flag="OUT") as tmp:
        for f in src.iterdir():
            if f.name in (SPARSE_CONFIG, INDEXER_WEIGHTS) or f.name.startswith("."):
                continue
            if f.is_dir():
                shutil.copytree(f, tmp / f.name)
            else:
                shutil.copy2(f, tmp / f.name)
        sc.save(tmp)
        n_params = 0
        if sc.selector == "indexer":
            state = init_indexers(model_config, sc, cfg.seed)
            n_params = sum(v.numel() for v in state.values())
            save_file(state, str(tmp / INDEXER_WEIGHTS))
    sparse_layers = [i for i in range(n_layers) if i not in sc.dense_layers]
    return {"out": str(out), "selector": sc.selector, "budget": sc.budget, "key_block": sc.key_block,
            "query_group": sc.query_group, "index_dtype": sc.index_dtype, "sparse_layers": sparse_layers,
            "indexer_params": n_params}
