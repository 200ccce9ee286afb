"""Triton sampling for the common case (no top-k, no top-p): one program per row reads its logits twice
and returns the token and its log-prob, the same draw as `Sampler.sample`'s PyTorch path.

Why: the PyTorch path materialises `[R, V]` tensors for the log-softmax, the counter-based hash
(a dozen integer ops) and the Gumbel noise; at batch 64 over Qwen2's 152K-token vocabulary that is
~0.6 GB of memory traffic a decode step, paid by dense and sparse decoding alike. Here the hash is
recomputed in registers and nothing `[R, V]` is written.

Pass 1: the row's log-sum-exp of x / T (online max and sum). Pass 2: the argmax of
(x / T - lse) + g, with g = -log(-log(u)), u from murmur3's finaliser of (row key ^ vocab hash) as in
`sampler.py`, first index on ties (as `torch.argmax`); the log-prob is x_tok / T - lse. Greedy
(T = 0): the argmax of x, log-prob under the untempered softmax. Same arithmetic as the PyTorch path
in fp32; the libraries' exp/log may round differently in the last bit, so a draw sitting exactly on
a rounding tie could differ between the two paths (never within one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fmix32(x):
    """murmur3 fmix32 on uint32 (products wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _scaled(row, vid, V, t, DIV: tl.constexpr):
    """x / T in fp32, correctly rounded as torch's division (DIV: T != 1)."""
    x = tl.load(row + vid, mask=vid < V, other=float("-inf")).to(tl.float32)
    if DIV:
        x = tl.math.div_rn(x, t)
    return x


@triton.jit
def _sample_kernel(X, KEYS, TOK, LP, V, sx, t, GREEDY: tl.constexpr, DIV: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    row = X + r * sx
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        x = _scaled(row, v0 + offs, V, t, DIV)
        m_new = tl.maximum(m, x)
        # lanes that have seen only -inf keep s = 0 (exp(-inf - -inf) would be NaN)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - ref) + tl.exp(x - ref)
        m = m_new
    mx = tl.max(m, 0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
    key = tl.load(KEYS + r).to(tl.uint32, bitcast=True)
    best = float("-inf")
    best_i = 0
    best_x = 0.0
    for v0 in range(0, V, BLOCK):
        vid = v0 + offs
        x = _scaled(row, vid, V, t, DIV)
        if GREEDY:
            val = x
        else:
            h = _fmix32(key ^ _fmix32(vid.to(tl.uint32) * 0x27D4EB2F))
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            val = (x - lse) + (-tl.log(-tl.log(u)))
        val = tl.where(vid < V, val, float("-inf"))
        bm = tl.max(val, 0)
        bi = tl.argmax(val, 0)
        take = bm > best  # strictly: an earlier block keeps a tie (torch.argmax: first index)
        best_x = tl.where(take, tl.sum(tl.where(offs == bi, x, 0.0), 0), best_x)
        best_i = tl.where(take, v0 + bi, best_i)
        best = tl.where(take, bm, best)
    tl.store(TOK + r, best_i.to(tl.int64))
    tl.store(LP + r, best_x - lse)


def sample_triton(logits: torch.Tensor, keys: torch.Tensor | None, temperature: float):
    """logits `[R, V]` (last dim contiguous), keys `[R]` int32 (None when greedy), temperature (0 =
    greedy) -> (tokens `[R]` int64, log-probs `[R]` float32), as `Sampler.sample` with top-k 0, top-p 1."""
    R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    greedy = temperature == 0
    tok = torch.empty(R, dtype=torch.int64, device=logits.device)
    lp = torch.empty(R, dtype=torch.float32, device=logits.device)
    if R == 0:
        return tok, lp
    if keys is None:
        keys = torch.zeros(R, dtype=torch.int32, device=logits.device)
    interpret = not logits.is_cuda
    _sample_kernel[(R,)](logits, keys, tok, lp, V, logits.stride(0), float(temperature or 1.0), GREEDY=greedy,
                         DIV=not greedy and temperature != 1, BLOCK=256 if interpret else 2048,
                         num_warps=1 if interpret else 8)
    return tok, lp
