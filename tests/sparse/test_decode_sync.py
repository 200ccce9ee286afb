"""The one-launch decode select (`impl="sync"`, decode_sync.py) against the reference under TRITON_INTERPRET=1, where
its five stages run as five launches (the barrier's place taken by the launch boundary; the GPU runs the same code
in one launch, checked by benchmarks/gpu_sync_session15.py): exact ties over all 32 bits (integer inputs, ReLU
zeros), rows resolved early (a digit's keys all kept), rows with at most K keys, forced keys filling the budget,
left padding, fp8 and bf16 keys, one and many chunks a row."""

import pytest
import torch

from sparse_rl.sparse.ops.indexer_topk import decode as itd
from sparse_rl.sparse.ops.indexer_topk import decode_sync as ds
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive, quantize_index_keys


def _ints(B, HI, DI, S, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (B, HI, DI), generator=g).float()
    w = torch.randint(-1, 3, (B, HI), generator=g).float()
    k = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    return q, w, k, g


@pytest.mark.parametrize("B,HI,DI,S,K,sink,window,chunk,starts", [
    (3, 4, 16, 100, 24, 2, 3, 32, None),  # several chunks, heavy ties
    (5, 3, 20, 257, 40, 0, 0, 64, None),  # S not a multiple of the chunk, odd head count and dim
    (2, 5, 8, 70, 100, 1, 1, 32, None),  # K above every row's visible count: all kept, -1 padding
    (4, 3, 16, 200, 24, 2, 3, 16, [0, 3, 0, 40]),  # left padding, 13 chunks a row
    (2, 2, 16, 96, 8, 0, 0, None, None),  # the chunking rule's own choice
])
def test_sync_select_equals_reference_exactly(B, HI, DI, S, K, sink, window, chunk, starts):
    """Integer-valued inputs make every score exact: the kernel must keep exactly the reference's keys, its tie rule
    included (among equal scores the later key), resolved down to the last of the 32 bits."""
    q, w, k, g = _ints(B, HI, DI, S, B * S + K)
    pos = torch.randint(0, S, (B,), generator=g)
    pos[0] = S - 1
    kvs = None if starts is None else torch.tensor(starts)
    if kvs is not None:
        pos = torch.maximum(pos, kvs)
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=sink, window=window, kv_start=kvs)
    got = itd.indexer_topk_decode(q, w, k, pos, K, sink=sink, window=window, kv_start=kvs, chunk=chunk, impl="sync")
    assert got.dtype == torch.int32 and torch.equal(got, ref)


@pytest.mark.parametrize("K", [60, 150, 250])
def test_sync_select_relu_zeros(K):
    """Weights (1, -1) over two heads: ~1/4 of the keys score exactly 0 (one tie block of ~70 keys a row), tiny
    nonzero scores of either sign beside them; the k-th key above the zeros (K 60), among them (150), below (250)."""
    g = torch.Generator().manual_seed(K)
    B, S = 3, 300
    q, k = torch.randn(B, 2, 16, generator=g), torch.randn(B, S, 16, generator=g)
    w = torch.tensor([[1.0, -1.0]]).expand(B, 2).contiguous()
    k[:, 7::37] *= 1e-7
    pos = torch.tensor([S - 1, 280, 270])
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=2, window=3)
    assert torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=3, impl="sync", chunk=32), ref)


def test_sync_select_forced_and_equal_scores():
    """Forced keys filling the whole budget; every score equal (the threshold is one tie block: the latest kept)."""
    q, w, k, _ = _ints(4, 3, 16, 200, 5)
    pos = torch.tensor([199, 150, 12, 100])
    for qq, K, sink, window in ((q, 8, 3, 5), (torch.zeros_like(q), 20, 1, 1)):
        ref = indexer_topk_decode_naive(qq, w, k, pos, K, sink=sink, window=window)
        assert torch.equal(itd.indexer_topk_decode(qq, w, k, pos, K, sink=sink, window=window, impl="sync"), ref)


@pytest.mark.parametrize("dtype", ["fp8", torch.bfloat16])
def test_sync_select_fp8_and_bf16_keys(dtype):
    g = torch.Generator().manual_seed(3)
    q, w, k = torch.randn(2, 4, 32, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 500, 32, generator=g)
    pos = torch.tensor([499, 321])
    if dtype == "fp8":
        k8, sc = quantize_index_keys(k)
        ref = indexer_topk_decode_naive(q, w, k8, pos, 64, sink=2, window=8, k_scale=sc)
        got = itd.indexer_topk_decode(q, w, k8, pos, 64, sink=2, window=8, k_scale=sc, impl="sync")
    else:
        q, w, k = q.to(dtype), w.to(dtype), k.to(dtype)
        ref = indexer_topk_decode_naive(q, w, k, pos, 64, sink=2, window=8)
        got = itd.indexer_topk_decode(q, w, k, pos, 64, sink=2, window=8, impl="sync")
    assert torch.equal(got, ref)


def test_sync_chunks_keep_the_grid_resident():
    """The chunking rule: at most `programs` programs in all (every row's programs resident at once), at most
    MAX_CHUNKS a row, at least MIN_CHUNK keys a chunk where the row has them, chunks a multiple of the block."""
    for B, S, programs in ((32, 16384, 528), (32, 2304, 528), (1, 16384, 528), (16, 32768, 132), (64, 100, 10)):
        ch, p = ds.sync_chunks(B, S, programs, 64)
        assert ch % 64 == 0 and p * ch >= S and (p - 1) * ch < S
        assert p <= ds.MAX_CHUNKS and (B * p <= programs or p == 1)
        assert ch >= min(ds.MIN_CHUNK, S) or p == 1
    assert ds.sync_chunks(32, 16384, 528, 64) == (1024, 16)


def test_sync_per_sm_is_checked_and_carried():
    with pytest.raises(ValueError, match="sync_per_sm"):
        itd.DecodeSelect("sync", sync_per_sm=40)
    with pytest.raises(ValueError, match="sync_split"):
        itd.DecodeSelect("sync", sync_split=3)
    with pytest.raises(ValueError, match="sync_max_chunks"):
        itd.DecodeSelect("sync", sync_max_chunks=33)
    with pytest.raises(ValueError, match="sync_block"):
        itd.DecodeSelect("sync", sync_block=96)
    kw = itd.DecodeSelect("sync", sync_per_sm=2, sync_block=128, sync_keep=False, sync_split=2).as_kwargs()
    assert kw["impl"] == "sync" and kw["sync_per_sm"] == 2 and kw["sync_block"] == 128
    assert kw["sync_keep"] is False and kw["sync_split"] == 2
    assert itd.DecodeSelect("sync").sync_keep  # the measured default form (session 16)


def test_sync_forms_reach_the_kernel_through_the_select(monkeypatch):
    """DecodeSelect's sync_keep / sync_split / sync_max_chunks / sync_block / sync_coop reach `sync_select`
    through `indexer_topk_decode` (the engine's path) and the compiled step's opaque op, and select the reference's
    keys."""
    from sparse_rl.rl.rollout import compiled

    seen = []
    real = ds.sync_select

    def spy(*a, **kw):
        seen.append({k: kw[k] for k in ("keep", "split", "max_chunks", "block", "coop")})
        return real(*a, **kw)

    monkeypatch.setattr(ds, "sync_select", spy)
    q, w, k, _ = _ints(3, 3, 16, 200, 4)
    pos = torch.tensor([199, 120, 60])
    ref = indexer_topk_decode_naive(q, w, k, pos, 30, sink=1, window=2)
    sel = itd.DecodeSelect("sync", sync_keep=False, sync_split=2, sync_max_chunks=3, sync_block=32,
                           score_block=64, sync_coop=False)
    assert torch.equal(itd.indexer_topk_decode(q, w, k, pos, 30, sink=1, window=2, **sel.as_kwargs()), ref)
    got = compiled.indexer_topk_decode(q, w, k, pos, 200, 30, 1, 2, "triton", select=sel)
    assert torch.equal(got, ref)
    assert seen == [dict(keep=False, split=2, max_chunks=3, block=32, coop=False)] * 2  # score_block: not sync's
    itd.indexer_topk_decode(q, w, k, pos, 30, sink=1, window=2, **itd.DecodeSelect("sync").as_kwargs())
    assert seen[-1] == dict(keep=True, split=0, max_chunks=None, block=0, coop=True)  # 0 / None: the kernel's own


@pytest.mark.parametrize("opts", [dict(split=2, keep=False), dict(split=4, chunk=128, keep=False), dict(keep=False),
                                  dict(), dict(split=2), dict(prefetch=True, rescan=16, keep=False), dict(max_chunks=4),
                                  dict(max_chunks=4, keep=False)])
def test_sync_select_forms_equal_reference(opts):
    """The forms: scores in a launch of their own (split: M score chunks a chunk, level 0 summed from them), the
    chunk's keys held in registers past the score stage (keep, the default) or rescanned, the next key tile prefetched, a short rescan step,
    fewer chunks a row; integer ties, left padding, a row shorter than K."""
    q, w, k, _ = _ints(4, 3, 16, 300, 9)
    pos = torch.tensor([299, 210, 20, 150], dtype=torch.int32)
    kvs = torch.tensor([0, 7, 0, 33], dtype=torch.int32)
    ref = indexer_topk_decode_naive(q, w, k, pos, 40, sink=2, window=4, kv_start=kvs)
    got = ds.sync_select(q, w, k, None, pos, kvs, 40, 2, 4, True, **opts)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("shared,per_sm", [(20_000, 4), (90_000, 2), (200_000, 1)])
def test_resident_plan_fits_what_the_compiled_kernel_allows(monkeypatch, shared, per_sm):
    """The GPU grid: planned for 4 programs an SM, and planned again for fewer where the compiled kernel's shared
    memory lets an SM hold fewer (a GPU with less shared memory than the H200's), so that every row's programs
    are resident at once (the barriers' premise). The compiled kernel is a stand-in with the driver's fields."""
    from types import SimpleNamespace

    class Compiled:
        n_regs = 128
        metadata = SimpleNamespace(shared=shared)

        def _init_handles(self):
            pass

    props = SimpleNamespace(multi_processor_count=132, regs_per_multiprocessor=65536,
                            shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    compiled = []
    monkeypatch.setattr(ds._sync_select, "warmup", lambda *a, grid, **kw: compiled.append(grid) or Compiled(),
                        raising=False)
    monkeypatch.setattr(ds, "_RESIDENT", {})
    for B, S in ((32, 16384), (16, 32768), (1, 16384), (64, 2304)):
        ch, p, cmax, br, kp = ds._resident_plan(B, S, 128, ds.DEFAULT_CHUNKS, True, ds.MAXNREG, 0, 0,
                                                torch.device("cpu"), {"num_warps": 4}, lambda ch, cmax: ())
        assert B * p <= 132 * per_sm or p == 1
        assert p * ch >= S and p <= min(cmax, ds.DEFAULT_CHUNKS) and ch % 128 == 0
        assert kp == (ch <= ds.KEEP_MAX) and (br >= ch if kp else br == ds.RESCAN)
    assert ds._resident_plan(32, 16384, 128, 16, True, 128, 0, 0, torch.device("cpu"), {"num_warps": 4},
                             lambda ch, cmax: ())[:2] == ((1024, 16) if per_sm == 4 else (2048, 8) if per_sm == 2
                                                          else (4096, 4))
    n = len(compiled)
    ds._resident_plan(32, 16384, 128, 16, True, 128, 0, 0, torch.device("cpu"), {"num_warps": 4}, lambda ch, cmax: ())
    assert len(compiled) == n  # planned once: the second call reads what the first compiled


def test_batches_from_sync_min_batch_take_the_sync_select(monkeypatch):
    """`sync_min_batch`: a batch of at least that many rows runs the sync select whatever impl says (the engine's
    select stays fine below it), through the compiled step's op too; every batch keeps the reference's keys."""
    from sparse_rl.rl.rollout import compiled

    calls = []
    real = ds.sync_select
    monkeypatch.setattr(ds, "sync_select", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    sel = itd.DecodeSelect("fine", sync_min_batch=3)
    for B in (2, 3, 4):
        q, w, k, _ = _ints(B, 3, 16, 150, B)
        pos = torch.arange(149, 149 - 20 * B, -20)[:B]
        ref = indexer_topk_decode_naive(q, w, k, pos, 24, sink=1, window=2)
        assert torch.equal(itd.indexer_topk_decode(q, w, k, pos, 24, sink=1, window=2, **sel.as_kwargs()), ref)
        assert torch.equal(compiled.indexer_topk_decode(q, w, k, pos, 150, 24, 1, 2, "triton", select=sel), ref)
    assert calls == [3, 3, 4, 4]
    with pytest.raises(ValueError, match="sync_min_batch"):
        itd.DecodeSelect("fine", sync_min_batch=-1)
