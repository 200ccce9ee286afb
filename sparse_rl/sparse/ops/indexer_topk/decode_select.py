"""The choice of decode select after the index score pass (`decode.indexer_topk_decode(impl=...)`), as a
value: no Triton here, so the rollout runner and the CLI can hold and validate it on any machine.

Every choice selects the same keys (the reference's: forced sinks and window, the highest scores, ties to
the later key); they differ only in speed, by context length.
"""

from __future__ import annotations

from dataclasses import dataclass

# The kernel's own default, "auto", takes the one-program-per-row select (decode_row.py) for rows of at most
# ROW_MAX_KEYS keys and the chunked passes beyond. On the H200 (Qwen3-4B shape, random caches, one engine;
# benchmarks/results/2026-12-01-h200-rollout-session6.md) the row select took 0.43-0.71 ms off the batch-32
# step at 2.3K-8K context (0.32 at batch 16, 2.3K-4K), where the chunked passes are held by their seven
# launches, and added 0.6-1.25 ms at 16 x 16K-32K, where one program per row walks the row alone. "split"
# (decode_split.py) is opt-in; "fine" (decode_fine.py: two levels of bins, exact zeros by count) is what the
# rollout engine runs (ENGINE_SELECT). "bits" (decode_bits.py: bins fixed by the score's fp16 bits, counted by
# the score pass, the row's last program resolving) is opt-in: exact, but 0.22-0.57 ms slower a batch-32 step
# than fine at 2.3K-16K on the H200 (session 10).
# "bsearch" (decode_bsearch.py: one program per row, the k-th largest key found bit by bit in registers) is
# opt-in: exact and two launches a layer, but 0.34-0.36 ms slower a batch-32 step than fine at 2.3K-16K
# (results/2026-12-02-h200-bsearch-session10.md).
# "sync" (decode_sync.py): the scores, four radix levels and the write in ONE launch, the row's programs meeting
# at in-kernel barriers: exact; in its default form (keys held in registers, at most 16 chunks a row, 128-key
# step) the step against fine -0.34 ms at 32 x 16K, -0.02 at 32 x 2304, +0.03 at 16 x 32K, +0.17 at batch 1
# (H200; results/2026-12-03-h200-sync-session16.md). Its barriers need the whole grid resident at once: it is
# launched as a cooperative grid (sync_coop, CUDA's guarantee of that, also beside other streams' kernels), which
# cost nothing measurable in the step (session 17: 8.33 vs 8.33 ms at 32 x 16K, 6.45 vs 6.45 at 32 x 2304).
# The engine runs it for batches of at least 32 rows (ENGINE_SELECT.sync_min_batch), fine below.
IMPLS = ("auto", "chunked", "row", "split", "fine", "bits", "bsearch", "sync", "cuda")
# the "cuda" select's blocks a row (`DecodeSelect.cuda_cluster`, `decode_cuda.row_select(cluster=)`): 0 for
# `decode_cuda.auto_cluster`'s choice, at most 8 (the portable cluster size)
CUDA_CLUSTERS = (0, 1, 2, 4, 8)
# where the fine select resolves a row's threshold (`DecodeSelect.fine_resolve`): "each" (decode_fine.py: every
# (chunk, row) program of its last pass repeats it), "arrive" (decode_fine_once.py: once, by the row's last
# program of the gather pass), "pass" (decode_fine_once.py: once, by a [B]-program pass of its own); "arrive" /
# "pass" are opt-in and not yet timed on a GPU (session 11: exact under the interpreter)
FINE_RESOLVES = ("each", "arrive", "pass")
ROW_MAX_KEYS = 8192
AUTO_LONG = "chunked"  # what "auto" runs for rows of more than ROW_MAX_KEYS keys


@dataclass(frozen=True)
class DecodeSelect:
    """Which select runs after the score pass: an argument of `indexer_topk_decode` (`**as_kwargs()`), held
    by the rollout engine's runner (`ModelRunner.decode_select`) and set by its callers (rollout config,
    bench flags), never a module global. impl: one of IMPLS; "auto" runs "row" for rows of at most
    row_max_keys keys, else `long`; fine_cap: the fine select's most sub-bin keys ranked in registers;
    score_block: the score pass's keys a step (0: the select's own step, 256 on a GPU); num_warps: the warps of
    the score pass and the (chunk, row) select passes (0: the kernel's default, 4); fine_resolve: one of
    FINE_RESOLVES, where the fine select resolves its row's threshold; fine_block: the keys a step of the fine
    select's (chunk, row) loops (0: the select's own step, 256 on a GPU; capped at the chunk); fine_prefetch: with
    fine_resolve "arrive" / "pass", its histogram and gather passes load their first scores before the row's
    tiles; fine_maxnreg: a register cap (Triton's `maxnreg`) for the fine select's pass that resolves the threshold,
    0 = the compiler's choice (Triton 3.6 on the H200 gives `_resolve_write` 147 registers: 3 programs an SM);
    sync_per_sm / sync_keep / sync_split / sync_max_chunks / sync_block / sync_coop: the "sync" select's per_sm /
    keep / split / max_chunks / block / coop (`decode_sync.sync_select`; 0: its defaults; it has no separate
    score pass, so score_block does not reach it: its own measured step, 128 keys, unless sync_block);
    sync_min_batch: batches of at least this many rows run "sync" instead of impl (0: never; on the H200, 32
    rows fill its 4 programs an SM at 16 chunks a row: the step -0.34 ms at 32 x 16K, while batch 16 is equal
    and batch 1 slower, session 16; ENGINE_SELECT's rule); cuda_cluster: the "cuda" select's blocks a row (1, 2,
    4 or 8: a thread-block cluster, `decode_cuda.row_select`; 0: `decode_cuda.auto_cluster`'s choice);
    pdl: the score pass and the fine / split passes launched with programmatic dependent launch at this level
    (`_backend.PDL_LEVELS`; only where `_backend.pdl_supported`: the rollout runner sets it from its own
    `ModelRunner.pdl`, the one owner; 0 launches plainly). pdl stays the last field: the compiled step's op
    builds this positionally."""

    impl: str = "auto"
    row_max_keys: int = ROW_MAX_KEYS
    long: str = AUTO_LONG
    fine_cap: int = 32
    score_block: int = 0
    num_warps: int = 0
    fine_resolve: str = "each"
    fine_block: int = 0
    fine_prefetch: bool = False
    fine_maxnreg: int = 0
    sync_per_sm: int = 0
    sync_keep: bool = True
    sync_split: int = 0
    sync_max_chunks: int = 0
    sync_block: int = 0
    sync_coop: bool = True
    sync_min_batch: int = 0
    cuda_cluster: int = 0
    pdl: int = 0

    def __post_init__(self):
        if self.impl not in IMPLS or self.long not in IMPLS[1:]:
            raise ValueError(f"decode select {self.impl!r} / long {self.long!r}: expected one of {', '.join(IMPLS)}")
        if self.score_block < 0 or self.score_block & (self.score_block - 1):  # a tl.arange size
            raise ValueError(f"score_block {self.score_block}: must be 0 or a power of two")
        if self.fine_resolve not in FINE_RESOLVES:
            raise ValueError(f"fine_resolve {self.fine_resolve!r}: expected one of {', '.join(FINE_RESOLVES)}")
        if self.fine_block < 0 or self.fine_block & (self.fine_block - 1):  # a tl.arange size
            raise ValueError(f"fine_block {self.fine_block}: must be 0 or a power of two")
        if self.fine_maxnreg and not 24 <= self.fine_maxnreg <= 255:
            raise ValueError(f"fine_maxnreg {self.fine_maxnreg}: must be 0 (the compiler's choice) or 24-255")
        if not 0 <= self.sync_per_sm <= 32:
            raise ValueError(f"sync_per_sm {self.sync_per_sm}: must be 0 (as many as fit) or 1-32")
        if self.sync_split < 0 or self.sync_split & (self.sync_split - 1):  # score chunks a chunk: a power of two
            raise ValueError(f"sync_split {self.sync_split}: must be 0 (one launch) or a power of two")
        if self.sync_block < 0 or self.sync_block & (self.sync_block - 1):  # a tl.arange size
            raise ValueError(f"sync_block {self.sync_block}: must be 0 or a power of two")
        if self.sync_min_batch < 0:
            raise ValueError(f"sync_min_batch {self.sync_min_batch}: must be 0 (never) or a batch size")
        if not 0 <= self.sync_max_chunks <= 32:  # decode_sync.MAX_CHUNKS (its histograms' rows)
            raise ValueError(f"sync_max_chunks {self.sync_max_chunks}: must be 0 (the kernel's default, 16) or 1-32")
        if self.num_warps not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"num_warps {self.num_warps}: must be 0 (the default) or a power of two up to 16")
        if self.cuda_cluster not in CUDA_CLUSTERS:
            raise ValueError(f"cuda_cluster {self.cuda_cluster}: must be 0 (auto), 1, 2, 4 or 8")
        if self.pdl not in (0, 1, 2):  # ops/_backend.PDL_LEVELS (not imported here: this module has no torch)
            raise ValueError(f"pdl {self.pdl!r}: must be 0, 1 or 2 (False / True are 0 / 1)")

    def as_kwargs(self) -> dict:
        return {"impl": self.impl, "row_max_keys": self.row_max_keys, "auto_long": self.long, "fine_cap": self.fine_cap,
                "score_block": self.score_block, "num_warps": self.num_warps or None, "fine_resolve": self.fine_resolve,
                "fine_block": self.fine_block, "fine_prefetch": self.fine_prefetch,
                "fine_maxnreg": self.fine_maxnreg, "sync_per_sm": self.sync_per_sm,
                "sync_keep": self.sync_keep, "sync_split": self.sync_split, "sync_max_chunks": self.sync_max_chunks,
                "sync_block": self.sync_block, "sync_coop": self.sync_coop, "sync_min_batch": self.sync_min_batch,
                "cuda_cluster": self.cuda_cluster, "pdl": self.pdl}


# The rollout engine's default (`ModelRunner(decode_select=None)`, the GRPO and `bench rollout` defaults). Until
# session 26: the fine select at every context, its score pass stepping 64 keys (80 registers on sm_90a against 172 at
# 256: 6 programs an SM, 32 x 16K's 512 programs in one wave). On the H200 (Qwen3-4B shape, batch 32, random
# caches; benchmarks/results/2026-12-02-h200-rollout-session9.md, call 2) its step took 6.52 / 7.47 / 8.71 ms
# at 2304 / 8192 / 16384 context against auto's 6.80 / 7.67 / 8.88, and the whole 16K generation 4,269 tok/s
# against 4,147 (1.67x dense instead of 1.63x). Session 10 (results/2026-12-02-h200-rollout-session10.md): whole
# 32K batch 16 2,350 tok/s (1.80x dense), batch 1 sparse 3.72 / 4.85 ms at 2K / 16K; 2 warps instead of 4
# (`num_warps`) no faster in the step (+0.12 / -0.04 / +0.06 ms at 2304 / 8192 / 16384).
# Batches of at least 32 rows take the sync select instead (sync_min_batch; its defaults: keys in registers, at
# most 16 chunks a row, a cooperative launch): session 17 (results/2026-12-03-h200-session17.md) measured the
# step at 32 x 16K 8.32 vs fine 8.68 ms and the whole 16K batch-32 generation 1.70x dense against 1.66x with fine
# alone in one run; batches 16 and 1 run fine as before (sync: +0.03 ms at 16 x 32K, +0.2 at batch 1).
# Since session 27 the engine runs "cuda" (decode_cuda.py: the same score pass, then a CUDA block or a cluster of
# blocks a row) at every batch; where it cannot build (no NVRTC, compute capability below 8.0) the fine select runs
# the same keys. On the H100 (results/2026-12-07-h100-session27.md; call 2, us a layer, the whole select, its
# first cluster form) 16 x 16K 25.4 against the rule above's 45.9, 32 x 16K 42.0 / 45.4, 32 x 2304 12.4 / 17.2,
# 32 x 8192 21.9 / 31.7, 16 x 32K 42.8 / 63.5, 1 x 16K 21.7 / 30.4; with the three-pass kernel (calls 5-7, the CLI
# alternating on one machine) the step at 16 x 16K 7.10-7.13 / 7.73-7.84 ms, 16 x 2304 5.94-5.95 / 6.07-6.08,
# 1 x 16K 4.48 / 4.66, and the whole 16K generation at batch 16 1.58x dense against 1.51x.
ENGINE_SELECT = DecodeSelect("cuda", score_block=64)
