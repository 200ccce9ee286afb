"""Session 21 (CPU, no GPU): how many radix levels (barriers) the one-launch decode select (`decode_sync.py`) needs a
row, on the rollout bench's kind of index scores (random q, w, N(0, 1) bf16 keys, 4 x 64 indexer, 4 sink and 64
window keys forced), batch 32, k = 2048: the launch lasts as long as its slowest row. Also an adaptive first digit
(the row's finite score range stretched to the top bits: one barrier for the range first) for comparison.

    python benchmarks/sync_levels_cpu.py

Measured (session 21): 32 x 2304: levels 1-4, the slowest row 4; 32 x 16384: 2-3, the slowest 3. Adaptive: the
slowest row 5 / 5 barriers (the range barrier plus 3-4 levels: the fixed digits' first level is nearly empty, but
their second already lands on the threshold's region, and a level ends only when the threshold's bin holds exactly
the keys still wanted). Not built.
"""

import torch


def okey(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> its order-preserving 32-bit radix key (int64 holding uint32; `radix_topk._okey`)."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where((u >> 31) == 1, (~u) & 0xFFFFFFFF, u | 0x80000000)


def levels(u: torch.Tensor, K: int) -> int:
    """Radix levels (8-bit digits, top first) the select resolves row u's K-th key in: as `_sync_select`, a level
    ends the search when the threshold digit's keys are exactly the ones still wanted (or all 32 bits are read)."""
    rem, m = K, torch.ones_like(u, dtype=torch.bool)
    for lv in range(4):
        dig = (u >> (24 - 8 * lv)) & 255
        h = torch.bincount(dig[m], minlength=256)
        if lv == 0 and int(h.sum()) <= K:
            return 1
        d = int(((h.flip(0).cumsum(0).flip(0)) >= rem).nonzero().max())
        rem -= int(h[d + 1:].sum())
        if rem == int(h[d]) or lv == 3:
            return lv + 1
        m = m & (dig == d)
    return 4


def adaptive(u: torch.Tensor, fin: torch.Tensor, K: int) -> int:
    """Barriers with the row's finite range stretched to the top bits first (one barrier for the range)."""
    uf = u[fin]
    lo, hi = int(uf.min()), int(uf.max())
    v = ((uf - lo) << (32 - (hi - lo).bit_length())) & 0xFFFFFFFF
    return levels(v, K - int((~fin).sum())) + 1


def main() -> None:
    torch.manual_seed(0)
    B, HI, D, K = 32, 4, 64, 2048
    for S in (2304, 16384):
        q, w = torch.randn(B, HI, D), torch.randn(B, HI)
        k = torch.randn(B, S, D).bfloat16().float()
        s = (torch.relu(torch.einsum("bhd,bsd->bhs", q, k)) * w[:, :, None]).sum(1)
        s[:, :4] = float("inf")  # sink and window keys, forced
        s[:, -64:] = float("inf")
        u, fin = okey(s.contiguous()), torch.isfinite(s)
        fixed = sorted(levels(u[b], K) for b in range(B))
        ada = sorted(adaptive(u[b], fin[b], K) for b in range(B))
        print(f"{B} x {S}: levels a row {fixed} (slowest {fixed[-1]}); adaptive barriers {ada} (slowest {ada[-1]})")


if __name__ == "__main__":
    main()
