"""`sparse_config.json`: what a sparse model dir adds to a dense checkpoint (one dataclass)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sparse_rl.errors import SparseRLError, UsageError

SPARSE_CONFIG = "sparse_config.json"
INDEXER_WEIGHTS = "indexer.safetensors"
SELECTORS = ("indexer", "block")
BLOCK_SCORES = ("max", "mean")
INDEX_DTYPES = ("bf16", "fp8")


@dataclass
class SparseConfig:
    """Selector settings shared by convert, the loader and training.

    selector: "indexer" (DSA lightning indexer, trainable) or "block" (training-free mean-key blocks).
    topk: keys each query attends to (sinks and window included), indexer selector.
    index_heads / index_dim / rope_dim: indexer shape (H_I, d_I, RoPE'd leading dims of d_I).
    sink / window: tokens always kept: the first `sink` and the last `window` (own position included).
    dense_layers: layer indices that always run dense attention (DistillSparse keeps the first two).
    block_size / topk_blocks / sink_blocks / recent_blocks: block selector (topk_blocks counts all kept blocks).
    key_block / query_group / block_score: the indexer's selection granularity (docs/DESIGN.md, "Selection
    granularity"): keys picked in aligned blocks of `key_block` tokens (1 = token-level DSA), scored by the
    max or mean of their tokens' scores; `query_group` consecutive queries share one selection (1 = per
    query). Files written before these fields existed load as 1, 1, "max".
    index_dtype: how the rollout engine's decode cache stores the index keys: "bf16" (the model's dtype)
    or "fp8" (e4m3 with one fp32 scale per token, as DeepSeek-V3.2's indexer: half the bytes the decode
    select reads; token-level indexer selection only). Training and prefill score unquantized keys.
    """

    selector: str = "indexer"
    topk: int = 2048
    index_heads: int = 4
    index_dim: int = 64
    rope_dim: int | None = None  # default: min(32, index_dim, the model's head dim)
    sink: int = 4
    window: int = 64
    dense_layers: list[int] = field(default_factory=lambda: [0, 1])
    block_size: int = 64
    topk_blocks: int = 32
    sink_blocks: int = 1
    recent_blocks: int = 2
    key_block: int = 1
    query_group: int = 1
    block_score: str = "max"
    index_dtype: str = "bf16"

    def __post_init__(self):
        if self.selector not in SELECTORS:
            raise UsageError(f"--selector {self.selector}: expected one of {', '.join(SELECTORS)}")
        for name in ("topk", "index_heads", "index_dim", "block_size", "topk_blocks", "recent_blocks"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        for name in ("sink", "window", "rope_dim", "sink_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)})")
        if self.sink + self.window > self.topk:
            raise UsageError(f"--sink ({self.sink}) + --window ({self.window}) must not exceed --index-topk ({self.topk})")
        if self.sink_blocks + self.recent_blocks > self.topk_blocks:
            raise UsageError(f"--sink-blocks + --recent-blocks must not exceed --topk-blocks ({self.topk_blocks})")
        self._check_granularity()
        if self.index_dtype not in INDEX_DTYPES:
            raise UsageError(f"--index-dtype {self.index_dtype}: expected one of {', '.join(INDEX_DTYPES)}")
        if self.index_dtype != "bf16" and (self.selector != "indexer" or self.granular):
            raise UsageError(f"--index-dtype {self.index_dtype}: applies to token-level indexer selection "
                             "(--selector indexer, --key-block 1, --query-group 1)")
        if self.rope_dim is not None and (self.rope_dim > self.index_dim or self.rope_dim % 2):
            raise UsageError(f"--rope-dim ({self.rope_dim}) must be even and <= --index-dim ({self.index_dim})")

    def _check_granularity(self) -> None:
        if self.block_score not in BLOCK_SCORES:
            raise UsageError(f"--block-score {self.block_score}: expected one of {', '.join(BLOCK_SCORES)}")
        for name in ("key_block", "query_group"):
            v = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if v < 1 or v & (v - 1):
                raise UsageError(f"{flag} must be a power of two >= 1 (got {v})")
            if self.selector == "block" and v != 1:
                raise UsageError(f"{flag} {v}: applies to --selector indexer (the block selector has --block-size)")
            if self.topk % v:
                raise UsageError(f"--index-topk ({self.topk}) must be a multiple of {flag} ({v})")
        spare = self.topk - self.sink - self.window - (self.query_group - 1)
        if self.query_group > 1 and spare < 0:
            raise UsageError(f"--sink ({self.sink}) + --window ({self.window}) + --query-group ({self.query_group}) - 1 "
                             f"must not exceed --index-topk ({self.topk})")

    @property
    def granular(self) -> bool:
        """The indexer selects by key blocks or query groups (not token-level, per query)."""
        return self.key_block > 1 or self.query_group > 1

    def resolved(self, head_dim: int) -> "SparseConfig":
        """A copy with defaults that depend on the model filled in (rope_dim)."""
        from dataclasses import replace

        if self.rope_dim is not None:
            return self
        rope = min(32, self.index_dim, head_dim)
        return replace(self, rope_dim=rope - rope % 2)

    @property
    def budget(self) -> int:
        """Keys per query: the width of the index rows."""
        return self.topk if self.selector == "indexer" else self.topk_blocks * self.block_size

    def save(self, model_dir: str | Path) -> None:
        from sparse_rl.io import atomic_write_json

        atomic_write_json(Path(model_dir) / SPARSE_CONFIG, asdict(self))

    @classmethod
    def load(cls, model_dir: str | Path) -> "SparseConfig | None":
        p = Path(model_dir) / SPARSE_CONFIG
        if not p.exists():
            return None
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise SparseRLError(f"{p} line {e.lineno}: invalid JSON ({e.msg})") from None
        from sparse_rl.config import from_dict

        try:
            return from_dict(cls, data, str(p))
        except UsageError as e:
            raise SparseRLError(str(e)) from None
