"""Rollout-vs-training mismatch: per-token correction weights and the mismatch metrics.

The rollout policy mu (sparse attention, maybe a LoRA adapter, another kernel) sampled the tokens;
the loss is computed under the dense training policy pi. Registry `MISMATCH` entries share one
signature so a config can switch between them:

    fn(logp_pi, logp_mu, mask, advantages, *, cap=2.0, lo=0.5, hi=2.0, delta=0.1)
        -> (weights [B, T] float32, detached, 0 on padding; stats)

Names: none, tis (token, truncated), mis_token (token, masked), geo_rs (sequence filter on the
geometric-mean ratio, weight 1), mis_seq (sequence filter and weight on the product ratio), opsm
(DeepSeek-V3.2 off-policy sequence masking). `sampling_support` / `support_logprobs` give pi over
the support mu sampled from (DeepSeek-V3.2's Keep Sampling Mask).

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
from sparse_rl.rl.algos.registry import Registry, masked_mean, masked_sum

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


def _seq_log_ratio(logp_pi, logp_mu, mask) -> torch.Tensor:
    """Per-sequence sum over valid tokens of log(pi/mu), float32, bounded to +-20. `[B, T]` -> `[B]`."""
    return masked_sum(_log_ratio(logp_pi, logp_mu), mask, dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _seq_weights(rho: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor):
    """Broadcast per-sequence `weight * keep` `[B]` to tokens `[B, T]`, with the stats."""
    w = (weight * keep.float())[:, None] * mask.float()
    keep_t = keep[:, None].expand(mask.shape)
    return w, _stats(w, mask, ~keep_t, torch.zeros_like(keep_t))


@MISMATCH.register("geo_rs")
def geometric_rejection(logp_pi, logp_mu, mask, advantages, *, cap: float = 2.0, lo: float = 0.5, hi: float = 2.0,
                        delta: float = 0.1):
    """Geometric-mean rejection sampling (Geo-RS; verl `rollout_rs="seq_mean_k1"`; Liu, Li et al. 2025,
    "When Speed Kills Stability", part 3): rho_geo_i = exp(mean_t log(pi/mu)) = (prod_t pi/mu)^(1/|o_i|).

    Sequence i keeps weight 1 on every token if lo <= rho_geo_i <= hi, else 0. A filter, not a
    correction: the kept tokens are not reweighted, so the criterion is length-invariant (the
    per-token drift), where the product ratio of a long sequence explodes or vanishes.
    Reads `lo`, `hi`. `[B, T]` -> `[B, T]`.
    """
    rho = masked_mean(_log_ratio(logp_pi, logp_mu), mask, dim=-1).exp()  # [B]
    keep = (rho >= lo) & (rho <= hi)
    return _seq_weights(rho, keep, mask, torch.ones_like(rho))


@MISMATCH.register("mis_seq")
def masked_is_sequence(logp_pi, logp_mu, mask, advantages, *, cap: float = 2.0, lo: float = 0.5, hi: float = 2.0,
                       delta: float = 0.1):
    """Sequence-level masked IS (Seq-MIS; verl `rollout_is="sequence"` + `rollout_rs="seq_sum_k1"`; same
    source as `mis_token`): rho_i = prod_t pi/mu over the valid tokens of sequence i.

    Every token of sequence i gets rho_i if lo <= rho_i <= hi, else 0 (the whole sequence is
    rejected instead of clipped). rho_i is the importance weight of the whole sequence, so the kept
    sequences are corrected toward pi exactly. Reads `lo`, `hi`. `[B, T]` -> `[B, T]`.
    """
    rho = _seq_log_ratio(logp_pi, logp_mu, mask).exp()  # [B]
    keep = (rho >= lo) & (rho <= hi)
    return _seq_weights(rho, keep, mask, rho)


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


# ----------------------------------------------------------------------------- Keep Sampling Mask
# DeepSeek-V3.2 (arXiv:2512.02556, "Keep Sampling Mask"): with top-p/top-k sampling, mu's log-probs
# are over the truncated support (renormalised) while pi's are over the whole vocabulary, so
# pi/mu < 1 on average even for identical policies: the truncation alone looks like mismatch.
# Taking pi over the same support (renormalised) removes that bias.


def sampling_support(logits: torch.Tensor, *, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The tokens the rollout could sample: top-k then top-p of `logits` (already temperature-scaled),
    by the sampler's own rule (`sparse_rl.rl.rollout.sampler.process_logits`). `[..., V]` -> bool `[..., V]`."""
    from sparse_rl.rl.rollout.sampler import SamplingParams, process_logits

    flat = logits.detach().reshape(-1, logits.shape[-1])
    kept = torch.isfinite(process_logits(flat, SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)))
    return kept.reshape(logits.shape)


def support_logprobs(logits: torch.Tensor, tokens: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """log-prob of `tokens` under softmax(logits) restricted to `support` and renormalised (differentiable).

    logits `[B, T, V]`, tokens `[B, T]` long, support `[B, T, V]` bool (the sampled token must be in
    it; padding positions may hold anything) -> `[B, T]` float32.
    """
    x = logits.float().masked_fill(~support, float("-inf"))
    lp = torch.log_softmax(x, -1).gather(-1, tokens[..., None].long()).squeeze(-1)
    return lp.nan_to_num(neginf=-LOG_RATIO_BOUND)  # a padded position whose token is outside the support


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
