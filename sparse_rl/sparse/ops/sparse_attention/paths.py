"""Which kernel path the sparse attention takes: the one place where `auto` is decided.

Paths. Forward: "query" (one program per (query, KV head), `triton._fwd_kernel`), "tile" (GQA-packed
query tiles over the union of their selections, `union.tile_fwd`) or, for shared rows only, "block" (the
tiles over contiguous key tiles, full ones unmasked, `blocks.block_fwd`; its dq pass likewise).
Backward: "atomic" (the per-query kernel: dq stored, dk/dv by fp32 atomics), "tile" (dq from a
query-major pass, per tile, per query or per key tile, and dk/dv from the key-major pass, no atomics) or
"keyq" (dq as "tile"; dk/dv key-major over each key tile's compacted query list, keyq.py; `auto` takes it
for per-query rows when its estimate beats the key-major pass's: session 12, trained rows 38.3 vs 50.4 ms fwd+bwd).

`auto` estimates each path's time from a sample of query tiles (at most SAMPLE_TILES tiles' bitmaps:
~1/30 of a union build at 32K; `stats="full"`: every tile's bitmap and |U| with one host sync, which the
union build then reuses, `full_stats`) and a per-unit cost of each kernel: a few numbers, below, measured on
an H200 (bf16, G = 4, D = 128; benchmarks/NOTES.md) and re-checked by `sparse-rl bench attention`,
which prints the estimate beside the measured times. Shared selections (`query_group`) take the tile
path without an estimate (their union is the selection, so nothing is built), or the block path when
the caller says the rows are whole key blocks of >= BLOCK_MIN_KEY_BLOCK keys (`key_block`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ns per unit and KV head, H200, bf16, G=4, D=128, 32K; re-measured on session 9's second device call (token-level
# per-query rows of the trained indexer, k = 2048: NOTES.md item 17, results/2026-12-02-h200-granular-session9.md)
NS_QUERY_FWD = 0.067  # per (query, selected key): per-query forward, L2 gather bound (35.1 ms; session 4: 0.069)
NS_QUERY_BWD = 0.32  # per (query, selected key): per-query backward with fp32 atomics (174 ms; session 4, not re-timed)
NS_QUERY_DQ = 0.091  # per (query, selected key): per-query dq only, no atomics (47.1 ms; first timing)
NS_TILE_FWD = 0.25  # per (tile, union key): tile forward, 128 rows (9.31 ms over 4.61 M union keys; session 4: 0.27)
NS_TILE_FWD_64 = 0.135  # per (16-query tile, union key): 64-row tiles at (32, 4, 3) cost 1.07-1.09x the 128-row
# tiles' time per unit of MMA work (rows x union keys): H200, session 12 (fwd12), 32K trained 7.88 vs 9.29 ms at
# work 0.785x, 32K block 4.28 vs 4.01 at 0.996x, 128K trained 37.7 vs 47.1 at 0.732x; 0.25 * 0.5 * 1.08
NS_TILE_DQ = 0.30  # per (tile, union key): tile dq pass (10.9 ms; session 4: 0.27)
NS_TILE_DQ_64 = 0.162  # per (16-query tile, union key): the dq pass on 64-row tiles at (64, 4, 2), scaled from
# NS_TILE_DQ as NS_TILE_FWD_64 from NS_TILE_FWD (x 0.54): session 13's H200 run of the helper bwd13 timed the
# 32K trained rows' dq at 7.85 ms on 16-query tiles vs 9.38 on 32 (x 0.84) and the forward 7.04 vs 8.39 (x 0.84):
# the two passes scale alike
NS_KEYMAJOR = 30.2  # per (key tile of KEY_TILE, query tile) touched: key-major dk/dv at its default launch for
# 128-row tiles, (64, 8, 2, "dt") (32.6 ms over 135 K touched pairs; at (32, 8, 2, "dt") 21.1 ns per 32-key pair,
# 38.3 ms; session 4's "rows" form 25 ns per 32-key pair)
NS_BUILD = 0.020  # per selected (query, key), once (not per KV head): the union build (1.32 ms)
# session 12 call 1 (NOTES.md, results/2026-12-02-h200-bwd12-session12.md; 32K trained rows, same run as each other):
# keymajor "dt" (64, 8, 2) 30.16 ms over 135 K touched pairs = 27.9 ns (NS_KEYMAJOR kept: session 9's, lists included)
NS_KEYQ = 26.4  # per 128-row chunk of a key tile's query list (KEYQ_TILE keys) and KV head: keyq.py at (64, 128, 8, 3)
# (15.44 ms over 2.33 M (64-key tile, query) pairs = 73 K chunks x 8 KV heads)
NS_KEYQ_LISTS = 0.017  # per selected (query, key), once: keyq's query lists (1.10 ms at 65 M pairs)
KEYQ_TILE = 64  # keys per tile of keyq's default launch
KEYQ_MARGIN = 0.85  # `auto` takes keyq when its dk/dv estimate is below this share of the key-major pass's: on
# per-query block rows (128-key blocks) the estimate said 7.6 vs 8.7 ms but fwd+bwd measured 18.98 vs 18.68 ms
# (keyq 1.6% slower); trained rows 16.6 vs 31.7 estimated, 38.3 vs 50.4 fwd+bwd measured; local+spans+noise 50.3
# vs 64.7 estimated, 112.6 vs 119.2 measured (session 12 call 1)
KEY_TILE = 64  # keys per touched tile in the estimate: the default dk/dv launch's BLOCK_N
SAMPLE_TILES = 32
FWD_PATHS = ("auto", "query", "tile", "block")  # "block": shared selections only (blocks.py)
BWD_PATHS = ("auto", "atomic", "tile", "keyq")  # "keyq": keyq.py (session 12)


@dataclass
class Plan:
    fwd: str  # "query" | "tile" | "block"
    bwd: str  # "atomic" | "tile"
    dq: str  # "query" | "tile" | "block" (with bwd == "tile")
    estimate_ms: dict
    union: tuple | None = None  # stats="full": (bits, ulen, umax) of every tile, for union.build_union
    bt: int = 0  # the union tiles' queries, forward and tile dq (0: the caller's BT); small_tiles may halve it


_POPC = {}  # device -> the byte popcount table (built once: a pageable host copy waits for the stream)


def _popcount_sum(bits: torch.Tensor) -> torch.Tensor:
    """Set bits of `bits`, a 0-d tensor on its device (no host sync)."""
    table = _POPC.get(bits.device)
    if table is None:
        table = _POPC[bits.device] = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64,
                                                  device=bits.device)
    return table[bits.contiguous().view(torch.uint8).long()].sum()


def sample_stats(indices: torch.Tensor, S: int, BT: int, BN: int = KEY_TILE,
                 BNQ: int = KEYQ_TILE) -> tuple[float, float, float, float]:
    """From SAMPLE_TILES evenly spread tiles: (selected pairs, union keys, touched key tiles of BN keys,
    (query, key tile of BNQ keys) pairs), each per tile and averaged (one small bitmap build and one
    host sync, the four sums read together. Session 12 call 2 measured `auto` ~1.5 ms slower than the path it
    picks, forced (32K fwd+bwd, trained and block rows), when this took 6 syncs: one per sum, `unique`, a boolean
    index, and a host copy of the popcount table every call; the one-sync form is not timed yet)."""
    from sparse_rl.sparse.ops.sparse_attention.union import _bitmap

    B, T, K = indices.shape
    NT = -(-T // BT)
    # distinct without `unique` (min(NT, SAMPLE_TILES) points over NT - 1 are >= 1 apart); rows past T read as -1
    # instead of being dropped by a boolean index: both were host syncs
    tiles = torch.linspace(0, NT - 1, min(NT, SAMPLE_TILES), device=indices.device).round().long()
    rows = (tiles[:, None] * BT + torch.arange(BT, device=indices.device)).flatten()
    sub = torch.where((rows < T)[None, :, None], indices[:, rows.clamp(max=T - 1)], -1)
    bits = _bitmap(sub, S, BT)
    n = bits.shape[0] * bits.shape[1]
    pairs = ((sub >= 0) & (sub < S)).sum()
    touched = bits.view(bits.shape[0], bits.shape[1], -1, BN // 32).ne(0).any(-1).sum()
    kt = torch.where((sub >= 0) & (sub < S), sub // BNQ, -1).sort(-1).values  # a row's key tiles, ascending
    first = torch.ones_like(kt, dtype=torch.bool)
    first[..., 1:] = kt[..., 1:] != kt[..., :-1]
    kq = (first & (kt >= 0)).sum()
    p, u, t, q = (x / n for x in torch.stack([pairs, _popcount_sum(bits), touched, kq]).tolist())
    return p, u, t, q


PAIR_ROWS = 1024  # stats="full": rows (evenly strided, a view) that the selected pairs per tile are counted on


def full_stats(indices: torch.Tensor, S: int, BT: int, BN: int = KEY_TILE, half: bool = False, BNQ: int = KEYQ_TILE):
    """Every tile's bitmap and |U| (the first two steps of a union build, which `build_union` then skips),
    and from them (selected pairs, union keys, touched key tiles, (query, BNQ-key tile) pairs for keyq) per tile
    averaged, with ONE host sync: -> ((pairs, ukeys, touched, kq), (bits, ulen, umax)). Why not a sample: the sample's bitmap runs on
    SAMPLE_TILES programs, each looping over BT*K atomics, so it is latency bound (~1.9 ms of `auto`
    over union build + tile kernel at 32K on the H200, session 12's measurement of 4eda7e8), and the
    tile path builds the full bitmap anyway. Pairs come from a strided view of PAIR_ROWS rows.
    half: also the tiles of BT/2 queries: their bitmap is built and BT's is its OR over pairs of tiles (the same
    bits), -> (..., (bits, ulen, umax), (ukeys per BT/2 tile, (bits, ulen, umax) of BT/2)); one sync still."""
    from sparse_rl.sparse.ops.sparse_attention.union import _bitmap, count_union

    T = indices.shape[1]
    if half:
        bits_h = _bitmap(indices, S, BT // 2)
        ulen_h = count_union(bits_h, indices)
        pair = bits_h if bits_h.shape[1] % 2 == 0 else torch.cat([bits_h, torch.zeros_like(bits_h[:, :1])], 1)
        bits = (pair[:, 0::2] | pair[:, 1::2]).contiguous()
    else:
        bits = _bitmap(indices, S, BT)
    ulen = count_union(bits, indices)
    n = bits.shape[0] * bits.shape[1]
    step = max(1, T // PAIR_ROWS)
    sub = indices[:, ::step]
    pairs = ((sub >= 0) & (sub < S)).sum(dtype=torch.float64) * (T / sub.shape[1]) / n
    touched = bits.view(bits.shape[0], bits.shape[1], -1, BN // 32).ne(0).any(-1).sum(dtype=torch.float64) / n
    # keyq's (query, key tile of BNQ keys) pairs, from the same strided rows as the pairs
    kt = torch.where((sub >= 0) & (sub < S), sub // BNQ, -1).sort(-1).values
    first = torch.ones_like(kt, dtype=torch.bool)
    first[..., 1:] = kt[..., 1:] != kt[..., :-1]
    kq = (first & (kt >= 0)).sum(dtype=torch.float64) * (T / sub.shape[1]) / n
    parts = [pairs, ulen.sum(dtype=torch.float64) / n, touched, kq, ulen.max().to(torch.float64)]
    if half:
        parts += [ulen_h.sum(dtype=torch.float64) / ulen_h.numel(), ulen_h.max().to(torch.float64)]
    vals = torch.stack(parts).tolist()  # the one host sync
    out = (vals[0], vals[1], vals[2], vals[3]), (bits, ulen, max(1, int(vals[4])))
    if half:
        return (*out, (vals[5], (bits_h, ulen_h, max(1, int(vals[6])))))
    return out


BLOCK_MIN_KEY_BLOCK = 16  # shared rows of whole key blocks >= this take the block path (blocks.py) under `auto`:
# H200, 32K, trained input (session 9, NOTES.md item 17): forward / dq vs the gather tiles 1.43x / 1.49x at kb64g64,
# 1.41x / 1.41x at kb32g32, 1.03x / 1.05x at kb16g16, but 0.60-0.66x on token rows (g16, g64: partial tiles)


def plan(indices: torch.Tensor, S: int, H_kv: int, BT: int, fwd: str = "auto", bwd: str = "auto",
         shared: bool = False, is_cuda: bool = True, key_block: int = 1, stats: str = "full",
         small_tiles: bool = False, grad: bool = False) -> Plan:
    """Resolve `auto` paths for one call. indices `[B, T, K]` per query (or shared rows when `shared`);
    key_block: the rows' key block (a hint from the selection's config; 1 = token rows); stats: what the
    estimate reads, "full" (every tile's bitmap and |U|, one host sync, kept in Plan.union for the union
    build: `full_stats`; 32K trained on the H200, session 12: auto 11.55 -> 10.69 ms, the same output) or
    "sample" (SAMPLE_TILES tiles' bitmaps, `sample_stats`: latency bound, ~1 ms of host-synced work). small_tiles (with "full"):
    the union tiles may hold BT/2 queries (Plan.bt) where their estimate (NS_TILE_FWD_64, NS_TILE_DQ_64) is lower.
    grad: a backward follows; then BT/2 tiles only with a dk/dv that does not read the union (keyq: its own
    query lists), so that the forward's tiles also serve the tile dq (the key-major pass is measured at BT only)."""
    if stats not in ("sample", "full"):
        raise ValueError(f"plan stats {stats!r}: expected 'sample' or 'full'")
    if fwd not in FWD_PATHS:
        raise ValueError(f"fwd_path {fwd!r}: expected one of {', '.join(FWD_PATHS)}")
    if bwd not in BWD_PATHS:
        raise ValueError(f"bwd_path {bwd!r}: expected one of {', '.join(BWD_PATHS)}")
    if shared:
        f = ("block" if key_block >= BLOCK_MIN_KEY_BLOCK else "tile") if fwd == "auto" else fwd
        return Plan(f, "tile" if bwd == "auto" else bwd, "block" if f == "block" else "tile", {})
    if fwd == "block":  # the block kernels read shared rows only; per-query rows take the union tiles
        fwd = "tile"
    T = indices.shape[1]
    if (fwd != "auto" and bwd != "auto") or T < 2 * BT or not is_cuda:
        # nothing to estimate, too few queries to share keys, or the interpreter (the simple paths)
        f = "query" if fwd == "auto" else fwd
        b = "atomic" if bwd == "auto" else bwd
        return Plan(f, b, f if b in ("tile", "keyq") else "query", {})
    prebuilt, half = None, None
    if stats == "full" and small_tiles and BT >= 16:
        (pairs, ukeys, touched, kq), prebuilt, half = full_stats(indices, S, BT, half=True)
    elif stats == "full":
        (pairs, ukeys, touched, kq), prebuilt = full_stats(indices, S, BT)
    else:
        pairs, ukeys, touched, kq = sample_stats(indices, S, BT)
    nt = -(-T // BT) * indices.shape[0]
    # keyq's chunks: its query lists in steps of ~BT queries (128 rows), a partial last chunk per key tile
    chunks = kq * nt / BT + indices.shape[0] * -(-S // KEYQ_TILE) / 2
    est = {"query_fwd": pairs * nt * H_kv * NS_QUERY_FWD * 1e-6,
           "tile_fwd": (ukeys * nt * H_kv * NS_TILE_FWD + pairs * nt * NS_BUILD) * 1e-6,
           "atomic_bwd": pairs * nt * H_kv * NS_QUERY_BWD * 1e-6,
           "query_dq": pairs * nt * H_kv * NS_QUERY_DQ * 1e-6,
           "tile_dq": ukeys * nt * H_kv * NS_TILE_DQ * 1e-6,
           "keymajor_dkdv": (touched * nt * H_kv * NS_KEYMAJOR + pairs * nt * NS_BUILD) * 1e-6,
           "keyq_dkdv": (chunks * H_kv * NS_KEYQ + pairs * nt * NS_KEYQ_LISTS) * 1e-6}
    f = fwd if fwd != "auto" else ("tile" if est["tile_fwd"] < est["query_fwd"] else "query")
    dq = "tile" if est["tile_dq"] < est["query_dq"] else "query"
    if bwd == "auto":
        dkdv = "keyq" if est["keyq_dkdv"] < KEYQ_MARGIN * est["keymajor_dkdv"] else "tile"
        bwd = dkdv if est[f"{dq}_dq"] + est[f"{'keyq' if dkdv == 'keyq' else 'keymajor'}_dkdv"] < est["atomic_bwd"] \
            else "atomic"
    bt = BT
    if half is not None:
        nt_h = -(-T // (BT // 2)) * indices.shape[0]
        est["tile_fwd_half"] = (half[0] * nt_h * H_kv * NS_TILE_FWD_64 + pairs * nt * NS_BUILD) * 1e-6
        est["tile_dq_half"] = half[0] * nt_h * H_kv * NS_TILE_DQ_64 * 1e-6
        fwd_ok = f == "tile" or fwd == "auto"
        if not grad and fwd_ok and est["tile_fwd_half"] < est[f"{f}_fwd"]:
            bt, f = BT // 2, "tile"
        elif grad and fwd_ok and bwd == "keyq":
            # the forward's and the dq pass's tiles together: BT/2 where their sum is lower
            now = est[f"{f}_fwd"] + est[f"{dq}_dq"]
            dq_h = "tile" if est["tile_dq_half"] < est["query_dq"] else "query"
            if est["tile_fwd_half"] + (est["tile_dq_half"] if dq_h == "tile" else est["query_dq"]) < now:
                bt, f, dq = BT // 2, "tile", dq_h
        if bt != BT:
            prebuilt = half[1]
            est["tile_fwd"], est["tile_dq"] = est["tile_fwd_half"], est["tile_dq_half"]
    return Plan(f, bwd, dq, est, prebuilt if f == "tile" or bwd in ("tile", "keyq") else None, bt if f == "tile" else 0)
