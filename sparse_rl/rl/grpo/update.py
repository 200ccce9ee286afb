"""The GRPO policy update (steps 5-8 of the loop in trainer.py): group advantages, the dense forward
for pi_theta's log-probs, the policy loss with mismatch correction and optional KL to the frozen
reference, and the optimizer step(s) on theta. Functions over explicit arguments.

Data parallel: the loss is normalised by GLOBAL token / sequence counts, so each process's loss is
its share of the global loss; it is scaled by `Dist.grad_scale` before the backward and the
gradients are averaged (`Dist.reduce_grads`, or FSDP's reduce-scatter), which gives the
single-process gradient on the union of the processes' batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparse_rl.errors import SparseRLError
from sparse_rl.rl.grpo.batch import Batch, forward_logits, logprobs_of, make_batch
from sparse_rl.rl.grpo.collect import Group
from sparse_rl.rl.grpo.config import GRPOConfig
from sparse_rl.rl.grpo.distill import policy_mode
from sparse_rl.rl.grpo.metrics import CORRECTION_STATS, LOSS_STATS, TOKEN_MEAN
from sparse_rl.rl.grpo.parallel import Timer


class NaNLossError(SparseRLError):
    """The policy loss or its gradient became NaN/inf: the run stops before the update."""


@dataclass
class UpdateResult:
    """sums: "loss" (already globally normalised: a plain sum) and every `TOKEN_MEAN` metric summed
    over this process's response tokens (weighted by token count, so processes and micro-batches
    combine exactly); pis / mus: pi_theta's and mu's log-probs of the response tokens, for the
    mismatch metrics."""

    sums: dict[str, float]
    grad_norm: float = 0.0
    pis: list[torch.Tensor] = field(default_factory=list)
    mus: list[torch.Tensor] = field(default_factory=list)


def build_batch(groups: list[Group], advantage: str, pad_id: int, device) -> Batch:
    """One row per kept completion, with its group-relative advantage (`loss.advantage`)."""
    from sparse_rl.rl.algos import ADVANTAGES, lookup

    adv_fn = lookup(ADVANTAGES, advantage, "loss.advantage")
    prompts, toks, lps, advs = [], [], [], []
    for g in groups:
        a = adv_fn(torch.tensor([g.rewards]))[0].tolist()
        for t, lp, av in zip(g.tokens, g.logprobs, a):
            prompts.append(g.prompt_ids)
            toks.append(t)
            lps.append(lp)
            advs.append(av)
    return make_batch(prompts, toks, lps, advs, pad_id, device)


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    return [batch.slice(i, i + size) for i in range(0, len(batch), size)]


def _frozen_logprobs(cfg: GRPOConfig, model, ref, mbs: list[Batch], timer: Timer):
    """pi_old (when several epochs reuse the batch) and the reference's log-probs, without gradients."""
    temp = cfg.rollout.temperature
    old: list[torch.Tensor | None] = [None] * len(mbs)
    refs: list[torch.Tensor | None] = [None] * len(mbs)
    if cfg.optim.epochs > 1 or ref is not None:
        with timer("dense_forward"), torch.no_grad():
            for i, mb in enumerate(mbs):
                if cfg.optim.epochs > 1:
                    with policy_mode(model, "dense"):
                        old[i] = logprobs_of(forward_logits(model, mb, temp), mb)
                if ref is not None:
                    refs[i] = logprobs_of(forward_logits(ref, mb, temp), mb)
    return old, refs


def policy_update(cfg: GRPOConfig, model, ref, opt: torch.optim.Optimizer, theta: list[torch.nn.Parameter],
                  batch: Batch, *, dist, fsdp, kl_coef: float, timer: Timer, global_tokens: float,
                  global_seqs: float) -> UpdateResult:
    """The policy-gradient update(s) of theta on this process's batch (cfg.optim.epochs passes);
    statistics from the first pass. Raises NaNLossError (weights untouched) on a non-finite loss or
    gradient norm on any process. fsdp: the FSDPPolicy sharding theta, or None."""
    from sparse_rl.rl.algos import KL_ESTIMATORS, LOSS_AGG, MISMATCH, POLICY_LOSSES, lookup, masked_entropy

    lc, temp = cfg.loss, cfg.rollout.temperature
    mbs = micro_batches(batch, cfg.optim.micro_batch)
    policy_loss = lookup(POLICY_LOSSES, lc.policy_loss, "loss.policy_loss")
    correction = lookup(MISMATCH, lc.mismatch, "loss.mismatch")
    kl_est = lookup(KL_ESTIMATORS, lc.kl_estimator, "loss.kl_estimator")
    agg = lookup(LOSS_AGG, lc.agg, "loss.agg")
    norm = {"num_tokens": global_tokens, "num_seqs": global_seqs, "max_len": cfg.rollout.max_new_tokens}
    old, refs = _frozen_logprobs(cfg, model, ref, mbs, timer)
    out = UpdateResult(sums={k: 0.0 for k in ("loss", *TOKEN_MEAN)})
    acc = out.sums
    for epoch in range(cfg.optim.epochs):
        opt.zero_grad(set_to_none=True)
        bad = 0.0
        for i, mb in enumerate(mbs):
            ntok = mb.num_tokens()
            mask = mb.response(mb.mask)
            with policy_mode(model, "dense"):
                with timer("dense_forward"):
                    logits = forward_logits(model, mb, temp)
                    logp = logprobs_of(logits, mb)
                with timer("update"):
                    lp_old = logp.detach() if old[i] is None else old[i]
                    lp_mu = mb.response(mb.logp_mu)
                    weights, wstats = correction(lp_old, lp_mu, mask, mb.advantages, cap=lc.is_cap, lo=lc.is_lo,
                                                 hi=lc.is_hi, delta=lc.opsm_delta)
                    loss, stats = policy_loss(logp, lp_old, mb.advantages, mask, eps_low=lc.eps_low,
                                              eps_high=lc.eps_high, dual_clip=lc.dual_clip, weights=weights,
                                              agg=lc.agg, **norm)
                    kl_tok = None
                    if refs[i] is not None:
                        kl_tok = kl_est(logp, refs[i])
                        if kl_coef > 0:
                            loss = loss + kl_coef * agg(kl_tok, mask, **norm)
                    if not torch.isfinite(loss):
                        bad = 1.0
                    (loss * dist.grad_scale).backward()  # averaged over processes: the sum of the shares
            if epoch == 0:
                with torch.no_grad():
                    acc["loss"] += float(loss.detach())  # already globally normalised: a plain sum
                    acc["entropy"] += float(masked_entropy(logits.detach(), mask)) * ntok
                    if kl_tok is not None:
                        acc["kl_ref"] += float((kl_tok.detach() * mask).sum())
                    for k in LOSS_STATS:
                        acc[k] += float(stats[k]) * ntok
                    for k, key in CORRECTION_STATS.items():
                        acc[k] += float(wstats[key]) * ntok
                    out.pis.append(lp_old.detach()[mask.bool()].cpu())
                    out.mus.append(lp_mu[mask.bool()].cpu())
            del logits, logp, loss
        with timer("update"):
            gn = _step(opt, theta, cfg.optim.grad_clip, dist, fsdp, bad)
        if epoch == 0:
            out.grad_norm = float(gn)
    return out


def _step(opt, theta, grad_clip: float, dist, fsdp, bad: float) -> torch.Tensor:
    """Sync theta's gradients, clip, and step, unless any process saw a non-finite loss or norm."""
    if fsdp is None:
        dist.reduce_grads(theta)
    else:  # FSDP's backward already reduced the shards' gradients; unused params count as zero
        for p in theta:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    gn = torch.nn.utils.clip_grad_norm_(theta, grad_clip if grad_clip > 0 else float("inf"))
    if fsdp is not None:
        gn = fsdp.grad_norm(gn)
    bad = dist.max([bad])[0]
    if bad or not torch.isfinite(gn):
        opt.zero_grad(set_to_none=True)
        raise NaNLossError("non-finite")
    opt.step()
    opt.zero_grad(set_to_none=True)
    return gn
