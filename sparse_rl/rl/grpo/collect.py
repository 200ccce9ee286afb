"""Collecting a GRPO step's rollouts (steps 1-4 of the loop in trainer.py): sample M completions per
prompt with mu, score them, keep the top n per group, and (dynamic sampling) refill uniform groups.

Everything a round needs comes in explicitly as a `Collector` (the step's fixed inputs) and the
arguments; nothing here touches the trainer object. Every random choice is seeded from
(seed, step, rank, refill round), so a resumed run repeats the uninterrupted run's rollouts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from sparse_rl.distributed import Dist
from sparse_rl.rl.grpo.config import GRPOConfig
from sparse_rl.rl.grpo.data import DataCursor, prompt_text
from sparse_rl.rl.grpo.parallel import Timer, mix_seed


@dataclass
class Group:
    """One prompt's kept completions. The sampled-side statistics cover all M samples."""

    task: dict
    prompt_ids: list[int]
    tokens: list[list[int]]  # [n] kept completions
    logprobs: list[list[float]]
    rewards: list[float]  # shaped
    raw: list[float]  # verifier


@dataclass
class RolloutStats:
    sampled: int = 0  # completions sampled
    tokens: int = 0
    reward_sum: float = 0.0
    correct: int = 0
    truncated: int = 0
    groups_sampled: int = 0
    groups_skipped: int = 0
    refills: int = 0
    keep_rate: float | None = None  # dynamic sampling: running fraction of informative groups


@dataclass
class Collector:
    """The fixed inputs of rollout collection. prompt_ids(i): task i's prompt tokens; score(tasks,
    completions): rewards (None = no verdict); full_weights(): context with the full policy weights
    in the modules (FSDP) or a no-op."""

    cfg: GRPOConfig
    rollout: object  # RolloutBackend
    tasks: list[dict]
    prompt_ids: Callable[[int], list[int]]
    score: Callable[[list[dict], list], list[float | None]]
    dist: Dist
    attention: str = "dense"
    full_weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def sampling_params(cfg: GRPOConfig, seed: int, n: int, greedy: bool = False, max_new: int | None = None):
    from sparse_rl.rl.rollout import SamplingParams

    r = cfg.rollout
    return SamplingParams(samples=n, temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p,
                          top_k=0 if greedy else r.top_k, max_new_tokens=max_new or r.max_new_tokens,
                          stop=list(r.stop), seed=seed, logprobs=True)


def score_completions(reward_fn, tasks: list[dict], comps) -> list[float | None]:
    recs = [{"id": t["id"], "prompt": prompt_text(t), "completion": c.text, "tokens": len(c.tokens),
             "finish_reason": c.finish_reason} for t, c in zip(tasks, comps)]
    return reward_fn(recs, tasks)


def collect_round(c: Collector, idx: list[int], step: int, rnd: int, st: RolloutStats, timer: Timer) -> list[Group]:
    """Roll out M samples for the prompts `idx`, score, oversample; returns the kept groups."""
    from sparse_rl.rl.oversample import select_top_n
    from sparse_rl.rl.rewards import SHAPING

    cfg, m, n = c.cfg, c.cfg.rollout.samples, c.cfg.rollout.keep
    if not idx:
        return []
    prompts = [c.prompt_ids(i) for i in idx]
    seed = mix_seed(cfg.seed, step, c.dist.rank, rnd)
    with timer("rollout"), c.full_weights():
        comps = c.rollout.generate(prompts, sampling_params(cfg, seed, m), c.attention)
    tasks = [c.tasks[i] for i in idx for _ in range(m)]
    with timer("reward"):
        raw = c.score(tasks, comps)
    lengths = [len(x.tokens) for x in comps]
    shaped: list[float | None] = list(raw)
    if cfg.reward.shaping != "none":
        pen = SHAPING[cfg.reward.shaping](lengths, max_len=cfg.rollout.max_new_tokens,
                                          cache_len=cfg.reward.overlong_cache, coef=cfg.reward.shaping_coef)
        shaped = [None if r is None else r + float(p) for r, p in zip(raw, pen.tolist())]
    st.sampled += len(comps)
    st.tokens += sum(lengths)
    st.truncated += sum(x.finish_reason == "length" for x in comps)
    st.groups_sampled += len(idx)
    gen = torch.Generator().manual_seed(mix_seed(cfg.seed, step, c.dist.rank, rnd, 1))
    groups = []
    for g, i in enumerate(idx):
        sl = slice(g * m, (g + 1) * m)
        r_raw, r_sh = raw[sl], shaped[sl]
        if any(v is None for v in r_raw):  # the reward function gave no verdict: skip the task
            st.groups_skipped += 1
            continue
        st.reward_sum += sum(r_sh)
        st.correct += sum(v >= cfg.reward.correct_threshold for v in r_raw)
        kept = select_top_n(torch.tensor([r_sh]), n, generator=gen)[0].tolist()
        cs = comps[sl]
        groups.append(Group(c.tasks[i], prompts[g], [cs[k].tokens for k in kept],
                            [cs[k].logprobs for k in kept], [r_sh[k] for k in kept], [r_raw[k] for k in kept]))
    return groups


def collect(c: Collector, cursor: DataCursor, per_rank: int, step: int, keep_rate: float | None,
            timer: Timer) -> tuple[list[Group], RolloutStats]:
    """This process's groups for the step (dynamic sampling refills until the batch is full). keep_rate:
    the running informative-group rate so far; the updated one is returned in the stats."""
    from sparse_rl.rl.oversample import informative_groups, prompts_to_refill

    cfg, dist = c.cfg, c.dist
    st = RolloutStats(keep_rate=keep_rate)
    groups = collect_round(c, cursor.take_shard(per_rank, dist.rank, dist.world), step, 0, st, timer)
    if not cfg.loss.dynamic_sampling:
        return groups, st
    kept: list[Group] = []
    rnd = 0
    while True:
        if groups:
            mask = informative_groups(torch.tensor([g.rewards for g in groups])).tolist()
            kept += [g for g, keep in zip(groups, mask) if keep]
            seen, good = dist.sum([len(groups), sum(mask)])
            if seen:
                rate = good / seen
                st.keep_rate = rate if st.keep_rate is None else 0.5 * st.keep_rate + 0.5 * rate
        else:
            dist.sum([0, 0])
        if rnd >= cfg.loss.max_refills:
            break
        # every process must take the same number of prompts from the shared stream
        need = int(dist.max([prompts_to_refill(len(kept), per_rank, st.keep_rate)])[0])
        if need == 0:
            break
        rnd += 1
        st.refills += 1
        groups = collect_round(c, cursor.take_shard(need, dist.rank, dist.world), step, rnd, st, timer)
    return kept[:per_rank], st
