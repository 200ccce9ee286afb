"""Loss aggregation, the clipped policy loss, KL-to-reference estimators and the adaptive KL coefficient.

Registries:
- `LOSS_AGG`: `fn(loss [B, T], mask [B, T], *, num_tokens=None, num_seqs=None, max_len=None) -> scalar`.
  The optional counts let a trainer that splits a batch into micro-batches (or data-parallel ranks)
  pass the *global* normaliser so that the summed micro-batch losses equal the full-batch loss.
- `POLICY_LOSSES`: `fn(logp, logp_old, advantages, mask, *, eps_low, eps_high, dual_clip, weights,
  agg, num_tokens, num_seqs, max_len) -> (loss scalar, stats dict of 0-dim float32 tensors)`.
- `KL_ESTIMATORS`: `fn(logp, logp_ref) -> [B, T]` per-token estimate of KL(pi_theta || pi_ref) from
  tokens sampled from pi_theta.
"""

from __future__ import annotations

import dataclasses

import torch

from sparse_rl.rl.algos.registry import Registry, lookup, masked_mean, masked_sum

LOSS_AGG = Registry("loss aggregation")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator")

# exp(20) ~ 4.9e8: bounds log-ratios before exponentiating so one wild token cannot overflow to inf.
LOG_RATIO_BOUND = 20.0


# ----------------------------------------------------------------------------- loss aggregation


@LOSS_AGG.register("token_mean")
def agg_token_mean(loss: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | None = None,
                   num_seqs: float | None = None, max_len: int | None = None) -> torch.Tensor:
    """Mean over all valid tokens of the batch (DAPO, Yu et al. 2025, eq. 8 "token-level policy gradient loss").

    sum_{i,t} mask*loss / sum_{i,t} mask (or / num_tokens). Long sequences weigh in proportion to
    their length. loss, mask: `[B, T]` -> scalar float32.
    """
    denom = mask.float().sum() if num_tokens is None else torch.as_tensor(float(num_tokens))
    return masked_sum(loss, mask) / denom.clamp_min(1.0)


@LOSS_AGG.register("seq_mean")
def agg_seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | None = None,
                            num_seqs: float | None = None, max_len: int | None = None) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (original GRPO, Shao et al. 2024, eq. 3: 1/G sum_i 1/|o_i| sum_t).

    Sequences with no valid token are left out of the count (or pass num_seqs). loss, mask: `[B, T]` -> scalar.
    """
    per_seq = masked_mean(loss, mask, dim=-1)  # [B]
    valid = (mask.float().sum(-1) > 0).float()
    denom = valid.sum() if num_seqs is None else torch.as_tensor(float(num_seqs))
    return (per_seq * valid).sum() / denom.clamp_min(1.0)


@LOSS_AGG.register("dr_grpo")
def agg_dr_grpo(loss: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | None = None,
                num_seqs: float | None = None, max_len: int | None = None) -> torch.Tensor:
    """Constant normaliser sum_{i,t} mask*loss / (num_seqs * max_len) (Dr. GRPO, Liu et al. 2025, sec. 3.1).

    Dividing by |o_i| biases GRPO toward long wrong answers; a constant removes the length bias.
    num_seqs defaults to B and max_len to T (pass the generation limit to keep it constant across
    batches). loss, mask: `[B, T]` -> scalar.
    """
    b, t = mask.shape[0], mask.shape[-1]
    n = float(b if num_seqs is None else num_seqs)
    length = float(t if max_len is None else max_len)
    return masked_sum(loss, mask) / max(n * length, 1.0)


# ----------------------------------------------------------------------------- policy loss


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with decoupled bounds and optional dual clip.

    Per token, r = exp(logp - logp_old) and
        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    Clip-higher: eps_high > eps_low leaves room for low-probability tokens to rise (DAPO, Yu et al.
    2025, sec. 3.1, 0.2 / 0.28). Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA
    Games", eq. 5): for A < 0, l = min(l, -A * dual_clip) bounds the loss when r explodes.
    `weights` `[B, T]` (detached here) multiply the per-token loss: the rollout-vs-training mismatch
    correction. The tokens are then aggregated with `LOSS_AGG[agg]`.

    logp (grad), logp_old, mask: `[B, T]`; advantages `[B]` or `[B, T]`. Returns (loss scalar, stats)
    with stats (0-dim float32, over valid tokens): clip_frac (either bound active), clip_frac_low
    (A < 0 and r < 1 - eps_low), clip_frac_high (A > 0 and r > 1 + eps_high), dual_clip_frac,
    approx_kl (k3 estimate of KL(old || new)), approx_kl_k1 (mean of logp_old - logp), ratio_mean.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand(mask.shape)
    log_ratio = (logp.float() - logp_old.float().detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    l_unclipped = -adv * ratio
    l_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(l_unclipped, l_clipped)
    if dual_clip is not None:
        l_dual = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > l_dual)
        per_token = torch.where(adv < 0, torch.minimum(per_token, l_dual), per_token)
    else:
        dual_active = torch.zeros_like(mask, dtype=torch.bool)
    if weights is not None:
        per_token = per_token * weights.detach().float()
    loss = lookup(LOSS_AGG, agg, "loss_agg")(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)

    with torch.no_grad():
        r = ratio.detach()
        low = (adv < 0) & (r < 1.0 - eps_low)
        high = (adv > 0) & (r > 1.0 + eps_high)
        neg = -log_ratio.detach()  # log(old / new)
        stats = {
            "clip_frac": masked_mean((low | high).float(), mask),
            "clip_frac_low": masked_mean(low.float(), mask),
            "clip_frac_high": masked_mean(high.float(), mask),
            "dual_clip_frac": masked_mean(dual_active.float(), mask),
            # x ~ pi_old, ratio new/old = exp(-neg): k3 = (r - 1) - log r, always >= 0.
            "approx_kl": masked_mean(r - 1.0 + neg, mask),
            "approx_kl_k1": masked_mean(neg, mask),
            "ratio_mean": masked_mean(r, mask),
        }
    return loss, stats


# ----------------------------------------------------------------------------- KL to reference
# Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html): with x ~ q
# and r = p(x)/q(x), KL(q || p) is estimated by k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r.
# Here q = pi_theta (which sampled the tokens) and p = pi_ref, so log r = logp_ref - logp.


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k1 = logp - logp_ref: unbiased, high variance, can be negative. `[B, T]` -> `[B, T]` float32."""
    return logp.float() - logp_ref.float()


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - logp_ref)^2 / 2: biased, low variance, >= 0. `[B, T]` -> `[B, T]` float32."""
    return 0.5 * (logp.float() - logp_ref.float()) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 = exp(logp_ref - logp) - 1 - (logp_ref - logp): unbiased, low variance, >= 0 (used by GRPO, Shao et al. 2024, eq. 4).

    The log-ratio is bounded to +-20 before exp. `[B, T]` -> `[B, T]` float32.
    """
    log_r = (logp_ref.float() - logp.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return log_r.exp() - 1.0 - log_r


def adaptive_kl_coef(coef: float, current_kl: float, *, target: float, horizon: float, n_steps: int) -> float:
    """One update of the adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences", sec. 2.2).

    e = clip(current_kl / target - 1, -0.2, 0.2); coef <- coef * (1 + e * n_steps / horizon).
    n_steps is the number of samples (or steps) since the last update; horizon sets how fast coef
    moves (the paper's K_beta = n_steps / horizon).
    """
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
    err = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + err * n_steps / horizon)


@dataclasses.dataclass
class KLController:
    """The KL coefficient across steps: fixed when `target` is None, else adaptive (`adaptive_kl_coef`).

    Its whole state is `coef`; `state_dict`/`load_state_dict` let checkpoints resume it exactly.
    """

    coef: float
    target: float | None = None
    horizon: float = 10000.0

    def update(self, current_kl: float, n_steps: int) -> float:
        if self.target is not None:
            self.coef = adaptive_kl_coef(self.coef, float(current_kl), target=self.target, horizon=self.horizon, n_steps=n_steps)
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
