"""Sampling parameters, logit processing and counter-based sampling.

The log-prob recorded for a generated token (the trainer's mu) is the log-probability of that token
under the distribution it was actually drawn from:

    logp = log_softmax(filter_top_p(filter_top_k(logits / temperature)))[token]

(temperature, then top-k, then top-p, the order of HF's warpers; filtered tokens get -inf and the
rest are renormalised). With temperature 0 (greedy) the token is the argmax of the raw logits and
the recorded log-prob is `log_softmax(logits)[token]`, the model's own probability of it.

Determinism: the random draw for the token at step `t` of request `r` (r = prompt_index * n +
sample_index) is a function of (seed, r, t) only: Gumbel noise from a counter-based integer hash
(murmur3's finaliser) of (seed, r, t, vocab id). So a given seed reproduces the same completions
whatever the batch size, slot assignment or order of admission, up to floating-point differences
in the logits themselves (batched matmuls may round differently at different batch sizes).

Without top-k/top-p filtering, logits can be sampled by one fused Triton kernel (`sampler_triton.py`:
the same hash and arithmetic, no `[R, V]` temporaries; opt-in, SPARSE_RL_SAMPLER=triton|auto); the
PyTorch code here is its reference and the path for everything else.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

from sparse_rl.errors import UsageError


@dataclass
class SamplingParams:
    """samples: completions per prompt (sharing one prefill); temperature 0 = greedy; top_k 0 = off;
    top_p 1 = off; stop: strings that end a completion (cut from the text); ignore_eos: run to
    max_new_tokens (benchmarks); logprobs: record per-token log-probs."""

    samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    logprobs: bool = True
    ignore_eos: bool = False

    def __post_init__(self):
        if self.samples < 1:
            raise UsageError(f"--samples must be >= 1 (got {self.samples})")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (got {self.top_k})")
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        self.stop = [s for s in (self.stop or []) if s]


def process_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits `[R, V]` -> log-probs `[R, V]` float32 of the distribution sampled from (see module doc)."""
    x = logits.float()
    if p.temperature == 0:
        return torch.log_softmax(x, -1)
    if p.temperature != 1:
        x = x / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sx, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sx, -1)
        before = torch.cumsum(probs, -1) - probs  # mass strictly above each token
        drop = before >= p.top_p  # the token that crosses top_p is kept; the first always is
        drop[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(x, -1)


# murmur3 fmix32 on int32 tensors: logical right shifts emulated with masks, products wrap mod 2^32.
_M1, _M2 = 0x85EBCA6B - (1 << 32), 0xC2B2AE35 - (1 << 32)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (32 - s)) - 1)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _lsr(x, 16)
    x = x * _M1
    x = x ^ _lsr(x, 13)
    x = x * _M2
    return x ^ _lsr(x, 16)


def _fmix32_int(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def row_keys(seed: int, rids: list[int], steps: list[int]) -> torch.Tensor:
    """One 32-bit key per row from (seed, request id, step): `[R]` int32 on the CPU, the same chain as
    `_fmix32_int` (ids and steps taken mod 2^32), vectorised with `_fmix32`: a Python loop over the
    rows cost ~0.1 ms a decode step at batch 64."""
    r = torch.tensor(rids, dtype=torch.int64).to(torch.int32)  # the cast wraps mod 2^32
    t = torch.tensor(steps, dtype=torch.int64).to(torch.int32)
    s = _fmix32_int(seed)
    s = torch.tensor(s - (1 << 32) if s >= 1 << 31 else s, dtype=torch.int32)
    return _fmix32(_fmix32(s ^ r) ^ t)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor to `device` without a host-side wait: through pinned memory on CUDA (an
    asynchronous copy from pageable memory may wait for the stream, stalling the step queued ahead)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class Sampler:
    """Draws tokens for rows of logits with counter-based Gumbel noise (see module doc)."""

    def __init__(self, vocab: int, device):
        self.vocab_hash = _fmix32(torch.arange(vocab, dtype=torch.int32, device=device) * 0x27D4EB2F)
        self.device = device
        self.triton_error: str | None = None  # why the fused sampler was given up, if it was

    def gumbel(self, keys: torch.Tensor) -> torch.Tensor:
        """keys `[R]` int32 -> Gumbel(0, 1) noise `[R, V]` float32."""
        h = _fmix32(keys[:, None] ^ self.vocab_hash[None, :])
        u = (_lsr(h, 8).float() + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1), 24 bits
        return -torch.log(-torch.log(u))

    def sample(self, logits: torch.Tensor, p: SamplingParams, rids: list[int], steps: list[int],
               backend: str | None = None):
        """logits `[R, V]` -> (tokens `[R]` int64, logprobs `[R]` float32), both on the logits' device.
        backend: "torch" | "triton" (the fused kernel, `sampler_triton`, same draw; used only without
        top-k/top-p filtering) | "auto" (Triton for CUDA logits); None reads SPARSE_RL_SAMPLER, else
        "torch": the fused kernel stays opt-in until it has been timed and checked on a GPU."""
        from sparse_rl.sparse.ops._backend import resolve_backend

        if backend is None:
            backend = os.environ.get("SPARSE_RL_SAMPLER", "").strip().lower() or "torch"
            if backend not in ("auto", "torch", "triton"):
                raise UsageError(f"SPARSE_RL_SAMPLER={backend!r}: expected auto, torch or triton")
        unfiltered = (not p.top_k or p.top_k >= logits.shape[-1]) and p.top_p >= 1
        if unfiltered and self.triton_error is None and resolve_backend(backend, logits, True) == "triton":
            from sparse_rl.rl.rollout.sampler_triton import sample_triton

            keys = None if p.temperature == 0 else to_device(row_keys(p.seed, rids, steps), logits.device)
            try:
                return sample_triton(logits, keys, p.temperature)
            except Exception as e:  # a kernel that does not build here: the PyTorch path, for good
                first = (str(e).strip().splitlines() or [""])[0]
                self.triton_error = f"{type(e).__name__}: {first[:300]}"
                warnings.warn(f"Triton sampler failed, using the PyTorch path: {self.triton_error}", stacklevel=2)
        logp = process_logits(logits, p)
        if p.temperature == 0:
            tok = torch.argmax(logits.float(), -1)
        else:
            keys = to_device(row_keys(p.seed, rids, steps), logits.device)
            tok = torch.argmax(logp + self.gumbel(keys), -1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
