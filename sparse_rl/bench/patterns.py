"""Index selections the sparse-attention benchmark times, besides the random indexer and the block
pattern (bench/attention.py): how much neighbouring queries share decides what the GQA-packed tile
kernels gain (union/pairs), so each pattern is printed with it.

- `local_retrieval`: every query takes a few sinks, a local window, the retrieval spans that lie
  before it (shared by all later queries, like a document the whole answer reads) and fills the
  rest of its budget with random visible keys (per-query noise).
- `trained`: the top-k of a lightning indexer trained in the same run. The data is synthetic: hidden
  states from a slowly drifting AR(1) process with spans copied from earlier positions (so a query
  resembles its neighbours and the source of its span); the teacher is one random-projection
  attention head over them; the indexer (4 x 64, the benchmark's shape) is trained by KL to the
  teacher's distribution on short crops, then selects on the full length. No language model is
  involved: this shows what a smooth learned scorer selects, not what a trained LLM's indexer does.
"""

from __future__ import annotations

import math


def _topk_rows(score_fn, L: int, K: int, device, chunk: int = 2048):
    """`[1, L, K]` int32: per query the K highest-scoring visible keys (score_fn(t0, t1) -> `[t1-t0, L]`,
    -inf where not selectable), -1 where fewer are visible."""
    import torch

    out = torch.empty(1, L, K, dtype=torch.int32, device=device)
    for t0 in range(0, L, chunk):
        t1 = min(L, t0 + chunk)
        s = score_fn(t0, t1)
        vals, idx = s.topk(min(K, L), -1)
        idx = torch.where(torch.isfinite(vals), idx, -1).to(torch.int32)
        if idx.shape[-1] < K:
            idx = torch.cat([idx, idx.new_full((t1 - t0, K - idx.shape[-1]), -1)], -1)
        out[0, t0:t1] = idx
    return out


def local_retrieval(L: int, K: int, device, generator=None, sinks: int = 4, window: int = 512, spans: int = 8,
                    span_len: int = 128):
    """Sinks + local window + shared retrieval spans + per-query random noise, `[1, L, K]` int32."""
    import torch

    starts = torch.randint(0, max(1, L - span_len), (spans,), device=device, generator=generator)
    in_span = torch.zeros(L, dtype=torch.bool, device=device)
    for s0 in starts.tolist():
        in_span[s0:s0 + span_len] = True
    keys = torch.arange(L, device=device)

    def score(t0, t1):
        t = torch.arange(t0, t1, device=device)[:, None]
        noise = torch.rand(t1 - t0, L, device=device, generator=generator)
        forced = (keys < sinks) | (keys > t - window) | in_span[None, :]
        s = noise + 2.0 * forced
        return s.masked_fill(keys > t, float("-inf"))

    return _topk_rows(score, L, K, device)


def synthetic_hidden(L: int, d: int, device, generator=None, rho: float = 0.995, copies: int = 16,
                     copy_len: int = 256):
    """`[1, L, d]` AR(1) hidden states (correlation rho between neighbours) with `copies` spans copied
    from random earlier positions."""
    import torch

    eps = torch.randn(L, d, device=device, generator=generator) * math.sqrt(1 - rho * rho)
    # x_t = rho x_{t-1} + eps_t as a scan in blocks (a plain loop over L would be slow on the host)
    x = torch.empty(L, d, device=device)
    prev = torch.randn(d, device=device, generator=generator)
    blk = 256
    powers = rho ** torch.arange(1, blk + 1, device=device, dtype=torch.float32)
    w = torch.tril(rho ** (torch.arange(blk, device=device)[:, None] - torch.arange(blk, device=device)[None, :])
                   .clamp(min=0).float())
    for b0 in range(0, L, blk):
        e = eps[b0:b0 + blk]
        n = e.shape[0]
        x[b0:b0 + n] = w[:n, :n] @ e + powers[:n, None] * prev
        prev = x[b0 + n - 1]
    copy_len = min(copy_len, L // 8)
    for _ in range(copies if copy_len else 0):
        dst = int(torch.randint(copy_len, max(copy_len + 1, L - copy_len), (1,), generator=generator,
                                device=device))
        src = int(torch.randint(0, max(1, dst - copy_len), (1,), generator=generator, device=device))
        x[dst:dst + copy_len] = x[src:src + copy_len]
    return x[None]


def train_indexer(device, generator=None, index_heads: int = 4, index_dim: int = 64, d: int = 128,
                  steps: int = 200, crop: int = 1024, lr: float = 3e-3, log=None, teacher: dict | None = None):
    """An indexer trained here (see the module docstring) -> (indexer module, final KL to the teacher on a
    held-out crop). `teacher`, if given, receives the teacher's projections and temperature {"wq", "wk",
    "temp"} (`teacher_probs` scores a selection's attention recall with them)."""
    import torch

    from sparse_rl.sparse.indexer import LightningIndexer
    from sparse_rl.sparse.ops import indexer_scores

    L = 8 * crop
    x = synthetic_hidden(L, d, device, generator)
    wq = torch.randn(d, 64, device=device, generator=generator) / math.sqrt(d)
    wk = torch.randn(d, 64, device=device, generator=generator) / math.sqrt(d)
    temp = 4.0  # sharpens the teacher: a few hundred keys hold most of its mass
    if teacher is not None:
        teacher.update(wq=wq, wk=wk, temp=temp)
    ix = LightningIndexer(d, index_heads, index_dim, rope_dim=0).to(device)
    with torch.no_grad():
        for lin in (ix.wq, ix.wk, ix.ww):
            lin.weight.copy_(torch.randn(lin.weight.shape, device=device, generator=generator)
                             * lin.in_features ** -0.5)
    opt = torch.optim.Adam(ix.parameters(), lr=lr)
    ones = torch.ones(1, crop, 2, device=device)  # rotary tables, unused with rope_dim 0
    future = torch.ones(crop, crop, dtype=torch.bool, device=device).triu(1)

    def kl_on(x0):
        with torch.no_grad():
            p = (temp * (x0 @ wq) @ (x0 @ wk).transpose(1, 2) / 8.0).masked_fill(future, -1e9).softmax(-1)
        qi, w, ki = ix(x0, ones, ones)
        logq = torch.log_softmax(indexer_scores(qi, w, ki), -1).clamp(min=-1e4)
        return (p * (torch.log(p.clamp(min=1e-30)) - logq)).sum(-1).mean()

    def pick():
        return int(torch.randint(0, L - 2 * crop, (1,), generator=generator, device=device))

    for step in range(steps):
        t0 = pick()
        loss = kl_on(x[:, t0:t0 + crop])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log and step % 100 == 0:
            log(f"trained indexer: step {step} KL {loss.item():.3f}")
    with torch.no_grad():
        kl = kl_on(x[:, L - crop:]).item()  # the last crop was never trained on
    return ix, kl


def teacher_probs(teacher: dict, x, t0: int):
    """The teacher's causal attention `[B, L - t0, L]` fp32 of queries t0.. over hidden states x `[B, L, d]`
    (as `train_indexer`'s loss: logits temp * q.k / 8, masked after each query)."""
    import torch

    xf = x.float()
    qt, kt = xf[:, t0:] @ teacher["wq"].float(), xf @ teacher["wk"].float()
    logits = teacher["temp"] * qt @ kt.transpose(1, 2) / 8.0
    L = x.shape[1]
    future = torch.arange(L, device=x.device)[None, :] > torch.arange(t0, L, device=x.device)[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(-1)


def trained_index(ix, L: int, device, generator=None, d: int = 128, hidden=None):
    """The trained indexer's (q_I `[1, L, H_I, d_I]`, w `[1, L, H_I]`, k_I `[1, L, d_I]`) on fresh synthetic
    hidden states of length L (bf16 on CUDA)."""
    import torch

    x = synthetic_hidden(L, d, device, generator) if hidden is None else hidden
    ones = torch.ones(1, L, 2, device=device)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.no_grad():
        return tuple(t.to(dt) for t in ix(x, ones, ones))


def trained_selection(ix, L: int, K: int, device, generator=None, d: int = 128):
    """Top-K `[1, L, K]` int32 of the trained indexer on fresh synthetic hidden states of length L."""
    from sparse_rl.sparse.ops import indexer_topk

    qi, w, ki = trained_index(ix, L, device, generator, d)
    return indexer_topk(qi, w, ki, K, sink=min(4, K // 4), window=min(64, K // 2))
