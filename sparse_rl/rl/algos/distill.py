"""Distillation of the sparse rollout policy onto the dense one, and entropy from logits.

Student = mu_phi (sparse attention + LoRA adapter phi, trainable), teacher = pi_theta (dense,
frozen: detached here). The tokens were sampled from mu at rollout time, so sampled-token
estimators of the *reverse* KL(mu || pi) are on-policy for the student (DistillSparse's on-policy
distillation; Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", GKD with beta = 1 is the reverse KL).

Registry `DISTILL_LOSSES`: `fn(student, teacher, mask, *, chunk_size=512) -> (loss scalar, stats)`.
The attribute `fn.needs_logits` says what student/teacher are: False -> log-probs of the sampled
tokens `[B, T]`; True -> logits `[B, T, V]`. Logits should already be temperature-scaled the way
the rollout sampled them. stats: {"kl": 0-dim float32 estimate of the masked-mean reverse KL}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sparse_rl.rl.algos.losses import LOG_RATIO_BOUND
from sparse_rl.rl.algos.registry import Registry, masked_mean

DISTILL_LOSSES = Registry("distillation loss")


def _k3_reverse(logp_student: torch.Tensor, logp_teacher: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(student || teacher) at tokens drawn from the student. `[B, T]`."""
    log_r = (logp_teacher.detach().float() - logp_student.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return log_r.exp() - 1.0 - log_r


def _register(name: str, needs_logits: bool):
    def deco(fn):
        fn.needs_logits = needs_logits
        return DISTILL_LOSSES.register(name)(fn)

    return deco


@_register("k3", needs_logits=False)
def distill_sampled_k3(logp_student: torch.Tensor, logp_teacher: torch.Tensor, mask: torch.Tensor, *,
                       chunk_size: int = 512) -> tuple[torch.Tensor, dict]:
    """Reverse KL(mu || pi) from the sampled tokens, k3 form: mean_t [(r - 1) - log r], r = pi/mu (Schulman 2020).

    Its value is an unbiased, non-negative estimate of the reverse KL; its gradient in expectation
    is that of the forward KL(pi || mu) (d/dphi = (1 - r) grad log mu), so it also vanishes only
    at mu = pi: a low-variance matching objective. logp_student (grad), logp_teacher, mask: `[B, T]`.
    """
    per_token = _k3_reverse(logp_student, logp_teacher)
    loss = masked_mean(per_token, mask)
    return loss, {"kl": loss.detach()}


@_register("k2", needs_logits=False)
def distill_sampled_k2(logp_student: torch.Tensor, logp_teacher: torch.Tensor, mask: torch.Tensor, *,
                       chunk_size: int = 512) -> tuple[torch.Tensor, dict]:
    """Reverse KL(mu || pi) from the sampled tokens, k2 form: mean_t (log mu - log pi)^2 / 2 (Schulman 2020).

    Its gradient (log mu - log pi) grad log mu is, per position, the exact score-function gradient
    of the reverse KL at on-policy tokens. The reported "kl" is the k3 value (k2's own value is a
    biased KL estimate). logp_student (grad), logp_teacher, mask: `[B, T]`.
    """
    diff = logp_student.float() - logp_teacher.detach().float()
    loss = masked_mean(0.5 * diff**2, mask)
    with torch.no_grad():
        kl = masked_mean(_k3_reverse(logp_student, logp_teacher), mask)
    return loss, {"kl": kl}


def _reverse_kl_chunk(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    ls = F.log_softmax(student.float(), dim=-1)
    lt = F.log_softmax(teacher.float(), dim=-1)
    return (ls.exp() * (ls - lt)).sum(-1)


def _entropy_chunk(logits: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    logp = F.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _chunked_over_t(fn, chunk_size: int, *tensors: torch.Tensor) -> torch.Tensor:
    """Apply fn to `[B, t:t+chunk, V]` slices and concatenate `[B, T]`.

    The float32 softmax intermediates exist for one chunk at a time; under autograd each chunk is
    checkpointed (recomputed in backward) so they are not kept for the whole sequence either.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    outs = []
    for s in range(0, tensors[0].shape[1], chunk_size):
        parts = [t[:, s : s + chunk_size] for t in tensors]
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if grad else fn(*parts))
    return torch.cat(outs, dim=1)


@_register("full", needs_logits=True)
def distill_full_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *,
                            chunk_size: int = 512) -> tuple[torch.Tensor, dict]:
    """Exact reverse KL(mu || pi) = sum_v mu_v (log mu_v - log pi_v) per position, masked mean over tokens.

    The full-vocabulary form has no sampling noise (GKD with beta = 1, Agarwal et al. 2024).
    student_logits (grad), teacher_logits: `[B, T, V]` (any float dtype, computed in float32 in
    chunks of `chunk_size` positions); mask `[B, T]`.
    """
    per_token = _chunked_over_t(_reverse_kl_chunk, chunk_size, student_logits, teacher_logits.detach())
    loss = masked_mean(per_token, mask)
    return loss, {"kl": loss.detach()}


def _gather_logprob_chunk(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, chunk_size: int = 512) -> torch.Tensor:
    """log softmax(logits)[token] per position, in float32, chunked over T (differentiable).

    logits `[B, T, V]` (position t predicts tokens[:, t], i.e. already shifted), tokens `[B, T]` long
    -> `[B, T]` float32.
    """
    return _chunked_over_t(_gather_logprob_chunk, chunk_size, logits, tokens)


def token_entropy(logits: torch.Tensor, *, chunk_size: int = 512) -> torch.Tensor:
    """Entropy of the next-token distribution, -sum_v p_v log p_v, per position. `[B, T, V]` -> `[B, T]` float32."""
    return _chunked_over_t(_entropy_chunk, chunk_size, logits)


def masked_entropy(logits: torch.Tensor, mask: torch.Tensor, *, chunk_size: int = 512) -> torch.Tensor:
    """Mean next-token entropy over valid positions. logits `[B, T, V]`, mask `[B, T]` -> scalar float32."""
    return masked_mean(token_entropy(logits, chunk_size=chunk_size), mask)
