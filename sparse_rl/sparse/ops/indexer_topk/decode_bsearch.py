"""The decode select after the score pass as a bitwise search on the row held in registers
(`indexer_topk_decode(impl="bsearch")`).

Why: at decode sizes a row is small (16K fp32 scores = 64 KB) and its bytes cost well under a
microsecond from L2; the histogram selects (chunked, row, fine) pay instead for `tl.histogram`
(~55-100 instructions a score at 128-256 bins, benchmarks/NOTES.md item 16) and for three to five
dependent launches. Here one program per row loads the row's visible scores once into registers
(`RB` = the next power of two of S, up to 32 warps) and finds the k-th largest key by its
order-preserving uint32 image (`radix_topk._okey`, -0.0 == +0.0) one bit at a time, from the top:
32 steps of "how many keys are >= t | bit", each a compare and a block sum, no histogram, no
scratch. Among keys equal to that threshold the later ones are kept (the reference's tie rule) by a prefix
count over them; positions go out ascending through one prefix sum, -1 padded. Forced keys (+inf) are the largest
keys and so always kept (sink + window <= top-k); -inf (invisible) keys never.

Rows longer than BSEARCH_MAX_KEYS keys would not fit the registers of one program; for them
`indexer_topk_decode` runs the fine select instead (decode_fine.py). The result is the same set of
keys as every other impl.

Measured (H200, Qwen3-4B shape, results/2026-12-02-h200-bsearch-session10.md): slower than the fine
select, 0.34-0.36 ms a batch-32 step at 2.3K-16K context: each of the ~47 serial block-wide sums over
16 warps costs ~1 us. Opt-in, not the engine's default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey, _write_selected

# the longest row one program holds: 32 warps x 32 lanes x 32 keys (a uint32 key and its position a lane)
BSEARCH_MAX_KEYS = 32768


@triton.jit
def _bsearch_select(SC, POS, OUT, S, sob, K, RB: tl.constexpr, PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    offs = tl.arange(0, RB)
    x = tl.load(SC + b * S + offs, mask=(offs <= pos) & (offs < S), other=float("-inf"))
    valid = x > float("-inf")
    # the register resolve the prefill cand select uses too (radix_topk._write_selected): the k-th key by
    # a bit search, later keys win ties, ascending, -1 padded
    _write_selected(_okey(x), offs, valid, tl.sum(valid.to(tl.int32), 0), K, OUT + b * sob, PAD, False)


def bsearch_warps(rb: int) -> int:
    """Warps for a row of rb (a power of two) keys: 32 keys a lane, 4 to 32 warps."""
    return max(4, min(32, rb // 1024))


def bsearch_select(sc: torch.Tensor, pos: torch.Tensor, topk: int, *, interpret: bool,
                   num_warps: int | None = None) -> torch.Tensor:
    """sc `[B, S]` fp32 scores of the score pass (+inf forced, -inf invisible; only columns <= pos
    read), pos `[B]` int32 -> `[B, topk]` int32 positions ascending, -1 padded. S <= BSEARCH_MAX_KEYS."""
    B, S = sc.shape
    rb = max(16, triton.next_power_of_2(S))
    if rb > BSEARCH_MAX_KEYS:
        raise ValueError(f"bsearch_select: rows of {S} keys exceed BSEARCH_MAX_KEYS ({BSEARCH_MAX_KEYS})")
    out = torch.empty(B, topk, device=sc.device, dtype=torch.int32)
    nw = 1 if interpret else (num_warps or bsearch_warps(rb))
    _bsearch_select[(B,)](sc, pos, out, S, out.stride(0), topk, RB=rb,
                          PAD=16 if interpret else 1024, num_warps=nw)
    return out
