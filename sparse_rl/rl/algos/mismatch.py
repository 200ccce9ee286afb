"""Rollout-vs-training mismatch: per-token correction weights and the mismatch metrics.

The rollout policy mu (sparse attention, maybe a LoRA adapter, another kernel) sampled the tokens;
the loss is computed under the dense training policy pi. Registry `MISMATCH` entries share one
signature so a config can switch between them:

    fn(logp_pi, logp_mu, mask, advantages, *, cap=2.0, lo=0.5, hi=2.0, delta=0.1)
        -> (weights [B, T] float32, detached, 0 on padding; stats)

logp_pi: `[B, T]` log-probs of the sampled tokens under pi (the behaviour-aligned "old" dense
policy, before the update); logp_mu: `[B, T]` the same tokens under mu, recorded at rollout;
mask: `[B, T]` 0/1; advantages: `[B]` or `[B, T]`. Each function reads only the keywords it needs.
The weights multiply the per-token policy loss (`ppo_clip_loss(weights=...)`); a weight of 0
removes the token's gradient while the loss normaliser is unchanged (as in DeepSeek-V3.2's mask).
stats (0-dim float32 tensors, over valid tokens): mean_weight, frac_masked (weight set to 0 by the
rule), frac_truncated (weight capped, TIS only).
"""

from __future__ import annotations

import torch

from sparse_rl.rl.algos.losses import LOG_RATIO_BOUND
from sparse_rl.rl.algos.registry import Registry, masked_mean

MISMATCH = Registry("mismatch correction")


def _log_ratio(logp_pi: torch.Tensor, logp_mu: torch.Tensor) -> torch.Tensor:
    """log(pi / mu) per token, float32, detached, bounded to +-20. `[B, T]`."""
    return (logp_pi.detach().float() - logp_mu.detach().float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _stats(weights: torch.Tensor, mask: torch.Tensor, masked: torch.Tensor, truncated: torch.Tensor) -> dict:
    return {
        "mean_weight": masked_mean(weights, mask),
        "frac_masked": masked_mean(masked.float(), mask),
        "frac_truncated": masked_mean(truncated.float(), mask),
    }


@MISMATCH.register("none")
def no_correction(logp_pi, logp_mu, mask, advantages, *, cap: float = 2.0, lo: float = 0.5, hi: float = 2.0,
                  delta: float = 0.1):
    """No correction: weight 1 on every valid token (treats mu's samples as if pi drew them)."""
    w = mask.float()
    none = torch.zeros_like(w, dtype=torch.bool)
    return w, _stats(w, mask, none, none)


@MISMATCH.register("tis")
def truncated_is(logp_pi, logp_mu, mask, advantages, *, cap: float = 2.0, lo: float = 0.5, hi: float = 2.0,
                 delta: float = 0.1):
    """Truncated importance sampling w_t = min(pi/mu, cap), detached (Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training"; truncation after Espeholt et al. 2018, IMPALA).

    Bounded weights trade a little bias for bounded variance. Reads `cap`. `[B, T]` -> `[B, T]`.
    """
    ratio = _log_ratio(logp_pi, logp_mu).exp()
    w = ratio.clamp_max(cap) * mask.float()
    return w, _stats(w, mask, torch.zeros_like(w, dtype=torch.bool), ratio > cap)


@MISMATCH.register("mis_token")
def masked_is_token(logp_pi, logp_mu, mask, advantages, *, cap: float = 2.0, lo: float = 0.5, hi: float = 2.0,
                    delta: float = 0.1):
    """Token-level masked IS: w_t = (pi/mu) * 1[lo <= pi/mu <= hi], detached.

    Importance weighting where the ratio is trusted, rejection (weight 0) where it is not (MIS = IS +
    rejection sampling; Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
    from the Training-Inference Mismatch"). Reads `lo`, `hi`. `[B, T]` -> `[B, T]`.
    """
    ratio = _log_ratio(logp_pi, logp_mu).exp()
    keep = (ratio >= lo) & (ratio <= hi)
    w = ratio * keep.float() * mask.float()
    return w, _stats(w, mask, ~keep, torch.zeros_like(keep))


@MISMATCH.register("mis_seq")
def masked_is_sequence(logp_pi, logp_mu, mask, advantages, *, cap: float = 2.0, lo: float = 0.5, hi: float = 2.0,
                       delta: float = 0.1):
    """Sequence-level masked IS with the geometric-mean ratio rho_i = exp(mean_t log(pi/mu)).

    Every token of sequence i gets rho_i if lo <= rho_i <= hi, else 0 (the whole sequence is
    dropped). The geometric mean keeps the criterion independent of length, where the product of
    token ratios would explode or vanish on long sequences (same source as `mis_token`; the
    "geometric" level of its reference implementation). Reads `lo`, `hi`. `[B, T]` -> `[B, T]`.
    """
    rho = masked_mean(_log_ratio(logp_pi, logp_mu), mask, dim=-1).exp()  # [B]
    keep = (rho >= lo) & (rho <= hi)
    w = (rho * keep.float())[:, None] * mask.float()
    keep_t = keep[:, None].expand(mask.shape)
    return w, _stats(w, mask, ~keep_t, torch.zeros_like(keep_t))


@MISMATCH.register("opsm")
def off_policy_sequence_mask(logp_pi, logp_mu, mask, advantages, *, cap: float = 2.0, lo: float = 0.5,
                             hi: float = 2.0, delta: float = 0.1):
    """DeepSeek-V3.2 off-policy sequence masking (DeepSeek-AI 2025, arXiv:2512.02556,
    "Scaling GRPO": Off-Policy Sequence Masking).

    M_{i,t} = 0 if A_{i,t} < 0 and (1/|o_i|) sum_t log(mu(o_t) / pi(o_t)) > delta, else 1; the
    paper's pi_old is the sampling (inference) policy, here mu, and pi_theta the training policy.
    Only negative-advantage sequences that drifted off-policy are silenced: pushing down tokens that
    the training policy already finds unlikely is what destabilises training. Weights are 0/1.
    Reads `delta`. advantages `[B]` or `[B, T]` -> weights `[B, T]`.
    """
    seq_kl = masked_mean(-_log_ratio(logp_pi, logp_mu), mask, dim=-1)  # [B], mean log(mu/pi)
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv[:, None]
    drop = (adv < 0) & (seq_kl > delta)[:, None]
    drop = drop.expand(mask.shape)
    w = (~drop).float() * mask.float()
    return w, _stats(w, mask, drop, torch.zeros_like(drop))


def mismatch_metrics(logp_pi: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor, *, q: float = 0.05) -> dict:
    """Sparse-vs-dense mismatch over valid tokens (tokens sampled from mu).

    - mismatch_kl: mean token KL(mu || pi), sampled-token k3 estimate (r - 1) - log r with
      r = pi/mu (Schulman 2020): unbiased under x ~ mu and never negative;
    - mismatch_kl_k1: mean of log(mu/pi) (the plain estimate, for reference);
    - p5_min_ratio: the q-quantile (default 5th percentile, linear interpolation as numpy's
      default) of min(1, pi/mu): how far the worst tokens fall below the dense policy.
    logp_pi, logp_mu, mask: `[B, T]`. Returns python floats; NaN when no token is valid.
    """
    lr = _log_ratio(logp_pi, logp_mu)
    valid = mask.bool()
    if not bool(valid.any()):
        return {"mismatch_kl": float("nan"), "mismatch_kl_k1": float("nan"), "p5_min_ratio": float("nan")}
    x = lr[valid]
    vals = torch.sort(x.exp().clamp_max(1.0)).values
    pos = q * (vals.numel() - 1)
    i = int(pos)
    j = min(i + 1, vals.numel() - 1)
    quant = vals[i] + (vals[j] - vals[i]) * (pos - i)
    return {
        "mismatch_kl": float((x.exp() - 1.0 - x).mean()),
        "mismatch_kl_k1": float((-x).mean()),
        "p5_min_ratio": float(quant),
    }
