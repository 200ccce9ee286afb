"""One loader for dense and sparse model dirs, and the matching saver.

A sparse model dir is a plain HF checkpoint plus `sparse_config.json` and `indexer.safetensors`;
plain transformers still loads it as the dense model. `load_model(path, attention=...)` opens
either kind; `set_attention(model, mode)` switches a loaded sparse model between dense and sparse.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sparse_rl.devices import resolve_dtype
from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.sparse.config import INDEXER_WEIGHTS, SparseConfig
from sparse_rl.sparse.layer import get_attention, set_attention, set_topk, sparse_config
from sparse_rl.sparse.patch import SUPPORTED, attach_sparse, indexer_state_dict, load_indexer_state_dict

__all__ = ["load_model", "load_tokenizer", "save_model", "set_attention", "get_attention", "set_topk",
           "check_model_dir", "resolve_dtype", "sparse_config_of"]

def check_model_dir(path: str | Path, flag: str = "MODEL") -> dict:
    """Validate a HF model dir; return its config.json. One-line errors for the usual mistakes."""
    p = Path(path)
    if not p.exists():
        raise SparseRLError(f"{flag} {p}: no such directory")
    if not p.is_dir():
        raise SparseRLError(f"{flag} {p}: not a directory (expected a Hugging Face model dir)")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise SparseRLError(f"{flag} {p}: no config.json (expected a Hugging Face model dir)")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SparseRLError(f"{cfg_file}: corrupt config.json ({e})") from None
    mt = config.get("model_type")
    if mt not in SUPPORTED:
        raise SparseRLError(f"{cfg_file}: unsupported architecture '{mt}' (supported: {', '.join(SUPPORTED)})")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise SparseRLError(f"{flag} {p}: no weights (*.safetensors or *.bin) found")
    return config


def sparse_config_of(path: str | Path) -> SparseConfig | None:
    return SparseConfig.load(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")


def load_tokenizer(path: str | Path):
    """The model dir's tokenizer. Refused in one line naming the dir when the dir holds no
    tokenizer file, or when what loads encodes text to no tokens (an empty vocabulary would make
    every prompt empty: generation loops would wait for tokens that never come)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.is_dir() and not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise SparseRLError(f"{path}: no tokenizer in this model dir (none of {', '.join(TOKENIZER_FILES)}); "
                            "copy the base model's tokenizer files into it")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds; the user needs one line
        raise SparseRLError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0][:200]})") from None
    if not tok("The quick brown fox jumps over the lazy dog. 0123456789", add_special_tokens=False)["input_ids"]:
        raise SparseRLError(f"{path}: the tokenizer encodes text to no tokens ({len(tok)} entries in its "
                            "vocabulary); copy the base model's tokenizer files into the dir")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | Path, attention: str = "dense", device: str = "cpu", dtype="auto",
               sparse: SparseConfig | None = None, backend: str | None = None):
    """Open a dense or sparse model dir.

    attention: "dense" | "sparse" (sparse needs a selector: the dir's sparse_config.json, or `sparse`).
    sparse: a SparseConfig to attach instead of the dir's (convert uses this; fresh indexers).
    Returns an eval-mode HF causal LM; `set_attention(model, mode)` switches later.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    check_model_dir(path)
    saved = SparseConfig.load(path)
    cfg = sparse or saved
    if attention == "sparse" and cfg is None:
        raise SparseRLError(f"{path}: not a sparse model dir (no sparse_config.json); run `sparse-rl convert` first")
    torch_dtype = resolve_dtype(dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, attn_implementation="sdpa")
    except Exception as e:
        raise SparseRLError(f"{path}: cannot load the model ({str(e).splitlines()[0][:200]})") from None
    model.to(device)
    if cfg is not None:
        attach_sparse(model, cfg)
        if sparse is None and cfg.selector == "indexer":
            wfile = Path(path) / INDEXER_WEIGHTS
            if not wfile.is_file():
                raise SparseRLError(f"{wfile}: missing (the sparse config names the indexer selector)")
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                state = load_file(str(wfile), device=str(device))
            except (SafetensorError, OSError, ValueError) as e:
                raise SparseRLError(f"{wfile}: corrupt indexer weights ({e})") from None
            load_indexer_state_dict(model, {k: v.to(torch_dtype) for k, v in state.items()}, str(wfile))
        set_attention(model, attention, backend)
    model.eval()
    return model


def save_model(model, out: str | Path, tokenizer=None, sparse: SparseConfig | None = None) -> None:
    """Write a model dir into an existing (temporary) directory `out`: HF weights without the
    indexers (so plain transformers loads it cleanly), plus sparse_config.json and
    indexer.safetensors when the model has a selector."""
    from safetensors.torch import save_file

    out = Path(out)
    idx_state = indexer_state_dict(model)
    full = model.state_dict()
    base_state = {k: v for k, v in full.items() if ".indexer." not in k}
    model.save_pretrained(out, state_dict=base_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    cfg = sparse
    if cfg is None:
        cfg = sparse_config(model)
    if cfg is not None:
        cfg.save(out)
        if idx_state:
            save_file({k: v.detach().contiguous().cpu() for k, v in idx_state.items()}, str(out / INDEXER_WEIGHTS))
    # the saved config must not carry our attention implementation name
    cfg_file = out / "config.json"
    data = json.loads(cfg_file.read_text())
    if data.get("_attn_implementation") == "sparse_rl" or data.get("attn_implementation") == "sparse_rl":
        data.pop("_attn_implementation", None)
        data.pop("attn_implementation", None)
        cfg_file.write_text(json.dumps(data, indent=2))


def check_adapter_dir(path: str | Path, flag: str = "--adapter") -> Path:
    """The dir, if it is a peft adapter dir (holds `adapter_config.json`); else a usage error naming `flag`."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise UsageError(f"{flag} {path}: no adapter_config.json (expected a peft adapter dir, e.g. a grpo "
                         f"checkpoint's adapter/)")
    return path


def load_adapter(path: str | Path, flag: str = "--adapter") -> tuple[dict[str, torch.Tensor], float]:
    """A peft LoRA adapter dir (`adapter_config.json` + `adapter_model.safetensors`) as (state dict
    with peft's key names, scaling): W = W_base + scaling * B @ A, scaling = lora_alpha / r (or
    lora_alpha / sqrt(r) for rsLoRA), as peft's `LoraLayer` sets it."""
    from safetensors.torch import load_file

    path = check_adapter_dir(path, flag)
    conf_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not weights.is_file():
        raise UsageError(f"{flag} {path}: no adapter_model.safetensors (the adapter's weights)")
    try:
        conf = json.loads(conf_file.read_text())
        r, alpha = int(conf["r"]), float(conf["lora_alpha"])
    except (ValueError, KeyError, TypeError) as e:
        raise SparseRLError(f"{flag} {conf_file}: unreadable LoRA config ({e})") from None
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise SparseRLError(f"{flag} {conf_file}: per-module rank/alpha patterns are not supported")
    scaling = alpha / (r ** 0.5) if conf.get("use_rslora") else alpha / r
    return load_file(str(weights)), scaling
