"""GRPO's pure-function core (verl `core_algos` style): every option is a function registered by name.

Resolve a config name with `lookup(REGISTRY, name, "config.key")` (UsageError on unknown names).

| registry | names | signature |
|---|---|---|
| ADVANTAGES | grpo, dr_grpo | (rewards [G,n] or [N], group_ids=None, *, eps) -> same shape |
| LOSS_AGG | token_mean, seq_mean, dr_grpo | (loss [B,T], mask, *, num_tokens, num_seqs, max_len) -> scalar |
| POLICY_LOSSES | ppo_clip | (logp, logp_old, adv, mask, *, eps_low, eps_high, dual_clip, weights, agg, ...) -> (loss, stats) |
| MISMATCH | none, tis, mis_token, geo_rs, mis_seq, opsm | (logp_pi, logp_mu, mask, adv, *, cap, lo, hi, delta) -> (weights [B,T], stats) |
| KL_ESTIMATORS | k1, k2, k3 | (logp, logp_ref) -> [B,T] |
| DISTILL_LOSSES | k3, k2, full | (student, teacher, mask, *, chunk_size) -> (loss, stats); fn.needs_logits |

Also: `sampling_support` / `support_logprobs` (Keep Sampling Mask: pi over mu's top-p/top-k support),
`mismatch_metrics` (mean token KL(mu || pi), 5th percentile of min(1, pi/mu)), `KLController` /
`adaptive_kl_coef`, `token_logprobs`, `token_entropy` / `masked_entropy` (chunked over T), and the
`masked_mean` / `masked_sum` reductions. Reward shaping (`SHAPING`) and reward functions live in
`sparse_rl.rl.rewards`, oversampling in `sparse_rl.rl.oversample`.
"""

from sparse_rl.rl.algos.advantages import ADVANTAGES, dr_grpo_advantages, grpo_advantages
from sparse_rl.rl.algos.distill import (
    DISTILL_LOSSES,
    distill_full_reverse_kl,
    distill_sampled_k2,
    distill_sampled_k3,
    masked_entropy,
    token_entropy,
    token_logprobs,
)
from sparse_rl.rl.algos.losses import (
    KL_ESTIMATORS,
    LOSS_AGG,
    POLICY_LOSSES,
    KLController,
    adaptive_kl_coef,
    agg_dr_grpo,
    agg_seq_mean_token_mean,
    agg_token_mean,
    kl_k1,
    kl_k2,
    kl_k3,
    ppo_clip_loss,
)
from sparse_rl.rl.algos.mismatch import (
    MISMATCH,
    geometric_rejection,
    masked_is_sequence,
    masked_is_token,
    mismatch_metrics,
    no_correction,
    off_policy_sequence_mask,
    sampling_support,
    support_logprobs,
    truncated_is,
)
from sparse_rl.rl.algos.registry import Registry, lookup, masked_mean, masked_sum

__all__ = [
    "ADVANTAGES", "DISTILL_LOSSES", "KL_ESTIMATORS", "LOSS_AGG", "MISMATCH", "POLICY_LOSSES",
    "KLController", "Registry", "adaptive_kl_coef", "agg_dr_grpo", "agg_seq_mean_token_mean",
    "agg_token_mean", "distill_full_reverse_kl", "distill_sampled_k2", "distill_sampled_k3",
    "dr_grpo_advantages", "geometric_rejection", "grpo_advantages", "kl_k1", "kl_k2", "kl_k3", "lookup", "masked_entropy",
    "masked_is_sequence", "masked_is_token", "masked_mean", "masked_sum", "mismatch_metrics",
    "no_correction", "off_policy_sequence_mask", "ppo_clip_loss", "sampling_support", "support_logprobs", "token_entropy", "token_logprobs", "truncated_is",
]
