"""dk/dv over each 64-key tile's two-level query lists (`bwd_path="keyq2"`, ops/sparse_attention/keyq2.py), through
TRITON_INTERPRET=1 against the PyTorch reference: odd sizes, GQA 1/4/7, S not a multiple of 64, left padding (shared
rows expanded), -1 holes and out-of-range keys, an empty row, an lse gradient; the class lists against a direct
reading of the index rows; keyq2's dk/dv against keyq's; and `auto`'s estimate (reported, never picked)."""

import pytest
import torch

from sparse_rl.sparse.ops import shared_to_per_query
from sparse_rl.sparse.ops.sparse_attention import keyq, keyq2, paths
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive

from .test_kernels import shared_rows_case
from .test_keymajor import _rel
from .test_keyq import _grads


def _half_rows(B, T, S, K, seed, holes=0.3):
    """Random rows where each (query, 64-key tile) keeps all its keys, only those of the low 32-key half or only
    the high half (a third each): every class of keyq2's lists is populated. -1 holes, an empty row (0, 5), an
    out-of-range key (dropped like -1, as the reference does)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(B, T, S, generator=g).argsort(-1)[..., :K]
    keep = torch.randint(0, 3, (B, T, -(-S // 64)), generator=g).gather(-1, idx // 64)
    upper = (idx % 64) >= 32
    idx = torch.where(((keep == 1) & upper) | ((keep == 2) & ~upper), -1, idx).to(torch.int32)
    idx[torch.rand(B, T, K, generator=g) < holes] = -1
    idx[0, 5] = -1
    idx[-1, 3, 0] = S + 4
    return idx


def _classes(idx, S):
    """{(b, tile, class): [(query, mask)]} read directly from the rows (class 0 low half only, 1 both halves, 2 high
    half only; the mask: bit n = key tile 64 + n selected)."""
    out = {}
    B, T, _ = idx.shape
    for b in range(B):
        for t in range(T):
            words = {}
            for s in idx[b, t].tolist():
                if 0 <= s < S:
                    words[s // 64] = words.get(s // 64, 0) | (1 << (s % 64))
            for j, w in words.items():
                lo, hi = w & 0xFFFFFFFF, w >> 32
                out.setdefault((b, j, 1 if lo and hi else 0 if lo else 2), []).append((t, w))
    return out


@pytest.mark.parametrize("H,H_kv,T,S,tune,fwd", [
    (8, 2, 40, 75, (64, 64, 4, 1), "tile"),  # G 4, 16 queries a chunk; 75 keys: a partial last tile (11 keys)
    (7, 1, 37, 70, (64, 128, 4, 1, 1), "tile"),  # G 7: 18 queries a 128-row chunk, 126 live rows; the split form
    (3, 3, 29, 130, (64, 16, 4, 1, 0), "query"),  # G 1, dq from the per-query kernel; 130 keys: a 2-key last tile
])
def test_keyq2_grads_match_reference(H, H_kv, T, S, tune, fwd):
    g = torch.Generator().manual_seed(T)
    B, D, K = 2, 16, 40
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, H), (S, H_kv), (S, H_kv)))
    idx = _half_rows(B, T, S, K, T)
    got, ref = _grads(q, k, v, idx, idx, fwd_path=fwd, bwd_path="keyq2", tune={"keyq2": tune})
    fin = torch.isfinite(ref[1])
    assert not fin.all()  # the empty row is there
    torch.testing.assert_close(got[1][fin], ref[1][fin], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert _rel(a, b) < 1e-5


def test_keyq2_on_shared_rows_with_left_padding():
    """Shared rows (q_offset 9, row 1 left-padded by 5 keys), G 7: "keyq2" expands them to per-query rows."""
    H, H_kv, group, T, left = 7, 1, 16, 40, 5
    _, q, k, v, sh, q_off = shared_rows_case(H, H_kv, group, T, left)
    per = shared_to_per_query(sh, group, T, q_off)
    got, ref = _grads(q, k, v, sh, per, query_group=group, q_offset=q_off, bwd_path="keyq2",
                      tune={"keyq2": (64, 32, 4, 1)})
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert _rel(a, b) < 1e-5


def test_key_query_lists2_are_the_classified_transposed_selection():
    """Every (tile, query) pair in exactly one class segment, ascending, with its mask; nothing else listed."""
    B, T, S, K = 2, 45, 150, 24  # 3 tiles, the last of 22 keys
    idx = _half_rows(B, T, S, K, 3)
    off, lst, msk = keyq2.key_query_lists2(idx, S)
    NKT = -(-S // 64)
    assert off.shape == (B * NKT * 3 + 1,)
    want = _classes(idx, S)
    assert {c for (_, _, c) in want} == {0, 1, 2}
    n = 0
    for b in range(B):
        for j in range(NKT):
            for c in range(3):
                s = (b * NKT + j) * 3 + c
                lo, hi = int(off[s]), int(off[s + 1])
                exp = want.get((b, j, c), [])
                assert lst[lo:hi].tolist() == [t for t, _ in exp]  # ascending: the rows were read in order
                assert [m & ((1 << 64) - 1) for m in msk[lo:hi].tolist()] == [m for _, m in exp]  # int64: bit 63 the sign
                n += len(exp)
    assert int(off[-1]) == n == sum(len(x) for x in want.values())


def test_keyq2_dkdv_equals_keyq():
    """The same sums in another order (four 32-key accumulators; three loops, or two in the split form): equal
    within fp32 rounding, on a case where all three lists of some tiles are non-empty (asserted)."""
    g = torch.Generator().manual_seed(4)
    B, T, S, H, H_kv, D, K = 2, 50, 140, 8, 2, 32, 40
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, H), (S, H_kv), (S, H_kv)))
    idx = _half_rows(B, T, S, K, 9, holes=0.1)
    o, lse = sparse_attention_naive(q, k, v, idx)
    do = torch.randn(o.shape, generator=g)
    delta = (o * do).sum(-1).contiguous()
    lse = lse.contiguous()
    off, _, _ = lists = keyq2.key_query_lists2(idx, S)
    sizes = (off[1:] - off[:-1]).view(B, -1, 3)
    assert ((sizes > 0).all(-1)).sum() >= 2  # tiles with all three lists non-empty
    dk1, dv1 = keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, D ** -0.5, 2, tune=(64, 64, 4, 1))
    for split in (0, 1):
        dk2, dv2 = keyq2.keyq2_dkdv(q, k, v, idx, do, lse, delta, D ** -0.5, 2, tune=(64, 64, 4, 1, split),
                                    lists=lists)
        torch.testing.assert_close(dk2, dk1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dv2, dv1, atol=1e-5, rtol=1e-5)
    for bad in ((32, 64, 4, 1), (64, 64, 4, 1, 2)):
        with pytest.raises(ValueError, match="BLOCK_N"):
            keyq2.keyq2_dkdv(q, k, v, idx, do, lse, delta, D ** -0.5, 2, tune=bad)


def test_auto_reports_keyq2_estimate_and_does_not_take_it():
    """paths.plan: "keyq2_dkdv" in the estimate, `auto` never picks keyq2 (unmeasured), explicit keyq2 is taken;
    rows of low-half keys only (every pair one-half) estimate below keyq, whole 64-key blocks (every pair "both")
    not below it."""
    T = 1024
    t = torch.arange(T)[None, :, None]
    starts = (torch.rand(1, T, 8, generator=torch.Generator().manual_seed(0)) * t).long() // 64 * 64
    lo_runs = (starts[..., None] + torch.arange(16)).flatten(2)  # 16 keys in the low half of 8 tiles
    lo_runs = torch.where(lo_runs <= t, lo_runs, -1).to(torch.int32)
    p = paths.plan(lo_runs, T, 8, 32, is_cuda=True)
    assert p.bwd != "keyq2" and "keyq2_dkdv" in p.estimate_ms
    assert p.estimate_ms["keyq2_dkdv"] < p.estimate_ms["keyq_dkdv"]
    block = (t[0] // 64 - 1) * 64 + torch.arange(64)[None]  # the whole previous tile
    block = torch.where(block >= 0, block, -1)[None, :512].to(torch.int32)
    pb = paths.plan(block, 512, 8, 32, is_cuda=True)
    assert pb.bwd != "keyq2" and pb.estimate_ms["keyq2_dkdv"] >= pb.estimate_ms["keyq_dkdv"]
    assert paths.plan(lo_runs, T, 8, 32, fwd="tile", bwd="keyq2", is_cuda=True).bwd == "keyq2"
    assert paths.plan(lo_runs, T, 8, 32, bwd="keyq2", is_cuda=False).dq == "query"
