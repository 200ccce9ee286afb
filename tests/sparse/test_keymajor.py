"""The key-major dk/dv pass in each form ("rows", "dt"; ops/sparse_attention/keymajor.py), its
key-tile lists and the backward's delta kernel, through TRITON_INTERPRET=1 against the PyTorch
reference: odd sizes, GQA 1/4/7, left padding, a prefix offset, -1 holes, an lse gradient."""

import pytest
import torch

from sparse_rl.sparse.ops import shared_to_per_query
from sparse_rl.sparse.ops.sparse_attention import keymajor, union
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

from .test_kernels import shared_rows_case


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30))


def _grads(q, k, v, rows, per, tune, **kw):
    """(out, lse, dq, dk, dv) of the Triton op with dk/dv launch `tune`, and the same of the reference on `per`,
    with an upstream gradient on out and lse."""
    g = torch.Generator().manual_seed(7)
    go, gl = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)
    res = []
    for fn in (lambda a, b, c: sparse_attention(a, b, c, rows, tune={"dkdv": tune}, **kw),
               lambda a, b, c: sparse_attention_naive(a, b, c, per)):
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
        o, lse = fn(qs, ks, vs)
        fin = torch.isfinite(lse)
        ((o * go).sum() + (lse.masked_fill(~fin, 0) * gl.masked_fill(~fin, 0)).sum()).backward()
        res.append((o, lse, qs.grad, ks.grad, vs.grad))
    return res


@pytest.mark.parametrize("H,H_kv,group,T,left,tune", [
    (8, 2, 8, 27, 0, (16, 4, 1, "dt")),
    (7, 1, 16, 40, 5, (32, 4, 1, "dt")),
    (3, 3, 4, 21, 3, (32, 4, 1, "dt")),
    (8, 2, 8, 45, 2, (64, 4, 1, "dt")),
])
def test_dkdv_forms_match_reference_on_shared_rows(H, H_kv, group, T, left, tune):
    _, q, k, v, sh, q_off = shared_rows_case(H, H_kv, group, T, left)  # row 1 left-padded
    got, ref = _grads(q, k, v, sh, shared_to_per_query(sh, group, T, q_off), tune, query_group=group, q_offset=q_off)
    fin = torch.isfinite(ref[1])
    torch.testing.assert_close(got[1][fin], ref[1][fin], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("tune", [(32, 4, 1, "rows"), (16, 4, 1, "dt")])
def test_dkdv_forms_match_reference_on_per_query_union_tiles(tune):
    g = torch.Generator().manual_seed(3)
    B, T, S, H, H_kv, D, K = 1, 40, 75, 8, 2, 16, 20
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, H), (S, H_kv), (S, H_kv)))
    idx = torch.rand(B, T, S, generator=g).argsort(-1)[..., :K].to(torch.int32)
    idx[torch.rand(B, T, K, generator=g) < 0.3] = -1
    idx[0, 5] = -1  # an empty row
    got, ref = _grads(q, k, v, idx, idx, tune, fwd_path="tile", bwd_path="tile")
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("BN", [16, 32, 64])
def test_key_tile_lists_name_exactly_the_touched_tiles(BN):
    g = torch.Generator().manual_seed(BN)
    T, S, K, BT = 50, 150, 9, 8
    idx = torch.rand(1, T, S, generator=g).argsort(-1)[..., :K].to(torch.int32)
    sel = union.build_union(idx, S, BT)
    off, lst, nnz = keymajor.key_tile_lists(sel, T, S, BN)
    for j in range(-(-S // BN)):
        want = [t for t in range(-(-T // BT)) if ((idx[0, t * BT:(t + 1) * BT] // BN) == j).any()]
        assert lst[off[j]:off[j + 1]].tolist() == want
    assert nnz == int(off[-1])


def test_bwd_delta_matches_torch_on_strided_inputs():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(2, 5, 3, 20, generator=g)
    do = torch.randn(2, 3, 5, 20, generator=g).transpose(1, 2)  # non-contiguous
    dlse = torch.randn(2, 5, 3, generator=g)
    torch.testing.assert_close(keymajor.bwd_delta(o, do, dlse), (o * do).sum(-1) - dlse, atol=1e-5, rtol=1e-5)


def test_bad_forms_are_errors():
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 1, 16)
    sel = union.shared_tiles(torch.zeros(1, 1, 2, dtype=torch.int32), 8, 8, 8)
    lse = torch.zeros(1, 8, 4)
    for tune in ((32, 4, 1, "fast"), (48, 4, 1, "dt")):
        with pytest.raises(ValueError, match="key_major_dkdv"):
            keymajor.key_major_dkdv(q, k, k, sel, q, lse, lse, 0.25, 2, tune=tune)
