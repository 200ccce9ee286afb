"""The block-list kernels of shared selections (ops/sparse_attention/blocks.py) against the reference:
forward and gradients through `sparse_attention(fwd_path="block")`, on selections of whole aligned key
blocks (full tiles) mixed with token-level keys (partial tiles), odd lengths, GQA 1/4/7, a prefix
(q_offset) and a left-padded batch row; and the lists themselves against a torch count."""

from __future__ import annotations

import pytest
import torch

from sparse_rl.sparse.ops import shared_to_per_query
from sparse_rl.sparse.ops.sparse_attention import blocks, union
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention


def block_rows_case(H, H_kv, group, T, kb, left, q_off=5, D=16, nblk=3, extra=4):
    """q [2, T, H, D], k/v [2, T + q_off, H_kv, D] and shared rows [2, ceil(T/group), K] (unsorted, -1 padded):
    per group `nblk` random whole kb-aligned blocks the group's first query sees, the keys from there to its
    last query (the causal diagonal) and `extra` random single keys; batch row 1 selects no key < left."""
    g = torch.Generator().manual_seed(T * kb + group)
    B, S = 2, T + q_off
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, S, H_kv, D, generator=g), torch.randn(B, S, H_kv, D, generator=g)
    NG = -(-T // group)
    keys = torch.arange(S)
    rows = []
    for b in range(B):
        per_b = []
        for r in range(NG):
            first, last = r * group + q_off, min(r * group + group - 1, T - 1) + q_off
            nb = (first + 1) // kb
            chosen = torch.zeros(S, dtype=torch.bool)
            if nb:
                for c in torch.randperm(nb, generator=g)[:nblk].tolist():
                    chosen[c * kb:(c + 1) * kb] = True
            chosen |= (keys > first - 2) & (keys <= last)
            chosen[torch.randint(0, last + 1, (extra,), generator=g)] = True
            if b == 1:
                chosen[:left] = False
            idx = keys[chosen]
            per_b.append(idx[torch.randperm(idx.numel(), generator=g)])
        rows.append(per_b)
    K = max(x.numel() for rb in rows for x in rb) + 2
    sh = torch.full((B, NG, K), -1, dtype=torch.int32)
    for b in range(B):
        for r in range(NG):
            sh[b, r, :rows[b][r].numel()] = rows[b][r]
    return g, q, k, v, sh, q_off


@pytest.mark.parametrize("H,H_kv,group,T,kb,left,BN,form", [(8, 2, 16, 45, 16, 7, 16, "dts"), (7, 1, 8, 37, 8, 0, 16, "dts"),
                                                             (4, 4, 32, 70, 32, 5, 32, "dts"), (8, 2, 16, 40, 1, 3, 16, "dt")])
def test_block_path_matches_reference(H, H_kv, group, T, kb, left, BN, form):
    """Forward and dq by the block kernels, dk/dv by the key-major pass ("dts": full pairs unmasked first)."""
    g, q, k, v, sh, q_off = block_rows_case(H, H_kv, group, T, kb, left)
    per = shared_to_per_query(sh, group, T, q_off)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    tune = {"fwd": (BN, 4, 1), "dq": (BN, 4, 1), "dkdv": (BN, 4, 1, form)}
    out, lse = sparse_attention(qs, ks, vs, sh, query_group=group, q_offset=q_off, fwd_path="block", tune=tune)
    go = torch.randn(out.shape, generator=g)
    (out * go).sum().backward()
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, rl = sparse_attention_naive(qr, kr, vr, per)
    (ref * go).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    fin = torch.isfinite(rl)
    torch.testing.assert_close(lse[fin], rl[fin], atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isfinite(lse), fin)
    for got, want in ((qs.grad, qr.grad), (ks.grad, kr.grad), (vs.grad, vr.grad)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("H,H_kv,group,T,kb,BN", [(8, 2, 16, 45, 16, 16), (4, 4, 32, 70, 32, 32)])
def test_block_forward_tma_loads_match_pointer_loads(H, H_kv, group, T, kb, BN):
    """loads="tma" (tensor descriptors; the last tile's rows past S read as zero) gives the pointer loads' output."""
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    g, q, k, v, sh, q_off = block_rows_case(H, H_kv, group, T, kb, 3)
    ref = sparse_attention_forward(q, k, v, sh, query_group=group, q_offset=q_off, fwd_path="block",
                                   tune={"fwd": (BN, 4, 1)})
    got = sparse_attention_forward(q, k, v, sh, query_group=group, q_offset=q_off, fwd_path="block",
                                   tune={"fwd": (BN, 4, 1, "tma")})
    assert got[2].fwd == "block"
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], ref[1], atol=1e-6, rtol=1e-6)
    sel = union.shared_tiles(sh, k.shape[1], group, min(union.tile_queries(H // H_kv), group), q_off, bits=True)
    do = torch.randn(q.shape, generator=g)
    delta = (got[0] * do).sum(-1)
    dq = [blocks.block_dq(q, k, v, sel, do, ref[1], delta, 0.25, 2, tune=(BN, 4, 1, ld)) for ld in ("ptr", "tma")]
    torch.testing.assert_close(dq[1], dq[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="loads"):  # K without a unit stride along D cannot take descriptors
        blocks.block_fwd(q, k.transpose(1, 3).contiguous().transpose(1, 3), v, sel, 0.25, 2, tune=(BN, 4, 1, "tma"))


@pytest.mark.parametrize("BN", [16, 32])
def test_block_lists_split_full_and_partial(BN):
    """Each group's list holds exactly the key tiles with a key its last query sees; a tile is full iff all BN
    keys are selected and none lies after the group's first query."""
    group, T, kb = 16, 61, 16
    _, q, k, v, sh, q_off = block_rows_case(8, 2, group, T, kb, left=9)
    S = k.shape[1]
    sel = union.shared_tiles(sh, S, group, 8, q_off, bits=True)
    bl = blocks.block_lists(sel, T, S, BN)
    W = bl.tiles.shape[2]
    n_full = 0
    for b in range(2):
        for r in range(sh.shape[1]):
            keys = sh[b, r][sh[b, r] >= 0].long()
            first, last = r * group + q_off, min(r * group + group - 1, T - 1) + q_off
            cnt = torch.bincount(keys // BN, minlength=-(-S // BN))
            tiles = torch.arange(cnt.numel())
            live = (cnt > 0) & (tiles * BN <= last)
            full = live & (cnt == BN) & (tiles * BN + BN - 1 <= first)
            nf, npart = int(bl.nfull[b, r]), int(bl.npart[b, r])
            assert bl.tiles[b, r, :nf].tolist() == tiles[full].tolist()
            assert sorted(bl.tiles[b, r, W - npart:].tolist()) == tiles[live & ~full].tolist()
            n_full += nf
    assert n_full > 0  # the case has full tiles, so the unmasked loop ran


def test_block_path_falls_back_on_odd_head_dim():
    """A head dim that is not a power of two takes the gather tile path (the block kernels load whole rows)."""
    g, q, k, v, sh, q_off = block_rows_case(4, 1, 8, 20, 8, 0, D=24)
    per = shared_to_per_query(sh, 8, 20, q_off)
    out, _ = sparse_attention(q, k, v, sh, query_group=8, q_offset=q_off, fwd_path="block")
    ref, _ = sparse_attention_naive(q, k, v, per)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_key_tile_lists_split_puts_full_pairs_first():
    """split=True: per key tile, the first nfull entries are exactly its full (query tile) pairs."""
    from sparse_rl.sparse.ops.sparse_attention import keymajor

    group, T, BN, BT = 16, 61, 16, 8
    _, q, k, v, sh, q_off = block_rows_case(8, 2, group, T, 16, left=9)
    S = k.shape[1]
    sel = union.shared_tiles(sh, S, group, BT, q_off, bits=True)
    off, lst, nnz, nfull = keymajor.key_tile_lists(sel, T, S, BN, split=True)
    off0, lst0, _ = keymajor.key_tile_lists(sel, T, S, BN)
    assert torch.equal(off, off0)
    NKT = -(-S // BN)
    for b in range(2):
        for j in range(NKT):
            lo, hi, nf = int(off[b * NKT + j]), int(off[b * NKT + j + 1]), int(nfull[b * NKT + j])
            assert sorted(lst[lo:hi].tolist()) == lst0[lo:hi].tolist()
            for i, tile in enumerate(lst[lo:hi].tolist()):
                keys = sh[b, tile * BT // group]
                keys = set(keys[keys >= 0].tolist())
                full = all(x in keys for x in range(j * BN, j * BN + BN)) and j * BN + BN - 1 <= tile * BT + q_off
                assert full == (i < nf)
    assert int(nfull.sum()) > 0


@pytest.mark.parametrize("BN,BT,group", [(16, 8, 16), (32, 4, 8), (64, 8, 8)])
def test_dense_key_tile_lists_equal_the_torch_lists(BN, BT, group):
    """`key_tile_lists_dense` (one launch, no host sync) lists per key tile what the torch CSR lists, in the
    same order (split: the full pairs first, each part ascending, as the stable sort)."""
    from sparse_rl.sparse.ops.sparse_attention import keymajor

    T = 61
    _, q, k, v, sh, q_off = block_rows_case(8, 2, group, T, 16, left=9)
    S = k.shape[1]
    sel = union.shared_tiles(sh, S, group, BT, q_off, bits=True)
    NKT = -(-S // BN)
    for split in (False, True):
        ref = keymajor.key_tile_lists(sel, T, S, BN, split=split)
        lst, cnt, nfull = keymajor.key_tile_lists_dense(sel, T, S, BN, split=split)
        for b in range(2):
            for j in range(NKT):
                lo, hi = int(ref[0][b * NKT + j]), int(ref[0][b * NKT + j + 1])
                assert int(cnt[b, j]) == hi - lo
                assert lst[b, j, :hi - lo].tolist() == ref[1][lo:hi].tolist()
                assert int(nfull[b, j]) == (int(ref[3][b * NKT + j]) if split else 0)


@pytest.mark.parametrize("key_block,path", [(16, "block"), (1, "tile")])
def test_auto_takes_the_block_path_for_key_block_rows(key_block, path):
    """`auto` with shared rows: the block kernels when the caller says the rows are key blocks >= 16
    (paths.BLOCK_MIN_KEY_BLOCK), the gather tiles for token rows; both exact."""
    from unittest import mock

    g, q, k, v, sh, q_off = block_rows_case(8, 2, 16, 40, 16, 0)
    per = shared_to_per_query(sh, 16, 40, q_off)
    with mock.patch.object(blocks, "block_fwd", wraps=blocks.block_fwd) as bf, \
            mock.patch.object(union, "tile_fwd", wraps=union.tile_fwd) as tf:
        out, _ = sparse_attention(q, k, v, sh, query_group=16, q_offset=q_off, key_block=key_block)
    assert (bf.call_count, tf.call_count) == ((1, 0) if path == "block" else (0, 1))
    ref, _ = sparse_attention_naive(q, k, v, per)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_block_path_request_on_per_query_rows_takes_the_tiles():
    """fwd_path="block" with rows that are not shared (a group that is no multiple of a tile) runs the union
    tiles instead, exact."""
    g, q, k, v, sh, q_off = block_rows_case(4, 1, 3, 20, 1, 0)
    per = shared_to_per_query(sh, 3, 20, q_off)
    out, _ = sparse_attention(q, k, v, sh, query_group=3, q_offset=q_off, fwd_path="block")
    ref, _ = sparse_attention_naive(q, k, v, per)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
