"""The GRPO loop (docs/DESIGN.md, "RL contract"), one step:

1. rollout: M completions per prompt from mu (dense pi_theta, or sparse attention [+ LoRA phi]),
   recording mu's per-token log-probs;
2. rewards (built-in math / synth verifier or a user `module:function`) + shaping;
3. reward-aware oversampling: the top-n of the M by reward (ties random, seeded);
4. dynamic sampling (optional): drop groups whose kept rewards are all equal, refill with prompts;
5. group advantages; 6. dense forward for pi_theta's log-probs (old = current, detached, with one
   optimizer step per batch); 7. policy loss (clip-higher, aggregation, mismatch correction, optional
   KL to the frozen initial policy); 8. update theta;
9. sparse+distill: freeze theta, train phi so mu matches pi_theta on the same tokens (distill.py);
10. sync the rollout backend's weights; log, eval, checkpoint.

Data parallel (accelerate / torch.distributed): each process rolls out its own slice of the step's
prompts and computes its loss with the GLOBAL normalisers (token and sequence counts summed over
processes), and the gradients are summed across processes with one all-reduce per update. So the
update equals the single-process update on the union of the slices, without wrapping the model in
DDP (whose hooks assume one fixed set of trainable parameters, while theta and phi train in turn).
With `parallel: fsdp`, theta is sharded with FSDP2 instead (parallel.FSDPPolicy): the backward's
reduce-scatter sums theta's gradients (no manual all-reduce), rollouts and eval run inside
`FSDPPolicy.gathered()` (full weights), checkpoints gather the full weights for rank 0.

Determinism: every random choice of a step (sampling noise, oversampling ties) is seeded from
(seed, step, rank, refill round), so a resumed run repeats exactly what the uninterrupted run did;
the RNG states are checkpointed as well.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.rl.grpo import checkpoint as ckpt
from sparse_rl.rl.grpo import metrics as M
from sparse_rl.rl.grpo.batch import Batch, forward_logits, logprobs_of, make_batch
from sparse_rl.rl.grpo.config import GRPOConfig
from sparse_rl.rl.grpo.data import DataCursor, encode_task, load_tasks, prompt_text
from sparse_rl.rl.grpo.distill import attach_adapter, distill, lora_params, policy_mode, theta_params
from sparse_rl.rl.grpo.parallel import Dist, FSDPPolicy, Timer, mix_seed


class NaNLossError(SparseRLError):
    """The policy loss or its gradient became NaN/inf: the run stops before the update."""


# ----------------------------------------------------------------------------- rollouts


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
    kept_groups: list = field(default_factory=list)


class Trainer:
    def __init__(self, cfg: GRPOConfig, resume: bool = False, log=None, backend=None):
        """backend: a `RolloutBackend` to sample with (e.g. a client of an external rollout server); by
        default an in-process `RolloutEngine` over the trainer's own model."""
        from sparse_rl.rl.algos import KLController
        from sparse_rl.rl.rewards import load_reward_fn
        from sparse_rl.sparse.loader import check_model_dir, load_model, load_tokenizer, sparse_config_of

        self.cfg = cfg
        self.log = log or (lambda msg: None)
        self.run_dir = Path(cfg.out)
        self.dist = Dist(cfg.device)
        self.device = self.dist.device
        if cfg.data.prompts_per_step % self.dist.world:
            raise UsageError(f"data.prompts_per_step ({cfg.data.prompts_per_step}) must be divisible by the number "
                             f"of processes ({self.dist.world})")
        self.per_rank = cfg.data.prompts_per_step // self.dist.world
        if cfg.rollout.max_batch < cfg.rollout.m:
            raise UsageError(f"rollout.max_batch ({cfg.rollout.max_batch}) must be >= rollout.m ({cfg.rollout.m})")
        self._check_run_dir(resume)

        check_model_dir(cfg.model, "MODEL")
        if cfg.sparse_rollout and sparse_config_of(cfg.model) is None:
            raise SparseRLError(f"MODEL {cfg.model}: rollout.mode {cfg.rollout.mode} needs a sparse model dir "
                                "(no sparse_config.json); run `sparse-rl convert` first, or use rollout.mode dense")
        self.reward_fn = load_reward_fn(cfg.reward.fn, key="reward.fn")
        self.tasks = load_tasks(cfg.data.tasks, cfg.reward.fn, "--tasks")
        self.eval_tasks = load_tasks(cfg.eval.tasks, cfg.reward.fn, "eval.tasks") if cfg.eval.tasks else None
        if self.eval_tasks and cfg.eval.limit:
            self.eval_tasks = self.eval_tasks[:cfg.eval.limit]

        torch.manual_seed(cfg.seed)  # same LoRA initialisation on every process
        self.tokenizer = load_tokenizer(cfg.model)
        model = load_model(cfg.model, attention="dense", device=str(self.device), dtype=cfg.dtype)
        if cfg.rollout.backend is not None and cfg.sparse_rollout:
            from sparse_rl.sparse.layer import set_attention

            set_attention(model, "dense", backend=cfg.rollout.backend)
        self.model = attach_adapter(model, cfg.distill) if cfg.distill_on else model
        self.model.eval()  # no dropout: the policy's log-probs must match the rollout's
        # one process has nothing to shard over: parallel=fsdp then runs the plain (ddp) path
        self.fsdp = FSDPPolicy(self.dist) if cfg.parallel == "fsdp" and self.dist.world > 1 else None
        if self.fsdp is not None:  # after peft wrapped the model; phi stays replicated (see FSDPPolicy)
            self.fsdp.shard(self.model, replicated=lora_params(self.model))
        self.theta = theta_params(self.model)
        for p in self.theta:
            p.requires_grad_(True)
        self.phi = lora_params(self.model) if cfg.distill_on else []
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.theta, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.dopt = torch.optim.AdamW(self.phi, lr=cfg.distill.lr, weight_decay=0.0) if self.phi else None
        self.ref = None
        if cfg.loss.kl_coef > 0 or cfg.loss.log_kl_ref:
            self.ref = load_model(cfg.model, attention="dense", device=str(self.device), dtype=cfg.dtype)
            self.ref.requires_grad_(False)
            if self.fsdp is not None:
                self.fsdp.shard(self.ref)
        self.kl = KLController(cfg.loss.kl_coef, cfg.loss.kl_target, cfg.loss.kl_horizon)

        from sparse_rl.rl.grpo.backend import InProcessRollout

        self.rollout = backend or InProcessRollout(self.model, self.tokenizer, max_batch=cfg.rollout.max_batch,
                                                      compile=cfg.rollout.compile)
        if self.fsdp is not None and isinstance(self.rollout, InProcessRollout):
            # every all-gather gives the full weights new storages: drop CUDA graphs captured on the old ones
            self.fsdp.on_gather.append(self.rollout.engine.refresh)
        self.cursor = DataCursor(len(self.tasks), cfg.seed, cfg.data.shuffle)
        self._prompt_cache: dict[int, list[int]] = {}
        self.step = 0
        self.keep_rate: float | None = None  # dynamic sampling: observed fraction of informative groups
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._create_run_dir()
        if resume:
            self._resume()

    # ------------------------------------------------------------------ run dir
    def _check_run_dir(self, resume: bool) -> None:
        d = self.run_dir
        if resume:
            if not (d / "config.yaml").is_file():
                raise UsageError(f"--resume: {d} is not a GRPO run dir (no config.yaml); start a new run without --resume")
        elif d.exists() and any(d.iterdir()):
            raise UsageError(f"--out {d}: exists and is not empty; pass --resume to continue that run or choose a new dir")

    def _create_run_dir(self) -> None:
        """Written only once the inputs are checked and the model loaded, so a failed start leaves no run dir."""
        from sparse_rl.config import save_config

        self.dist.barrier()
        if self.dist.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / "config.yaml")
        self.dist.barrier()

    def _resume(self) -> None:
        found = ckpt.latest(self.run_dir)
        if found is None:
            self.log(f"[yellow]resume: no checkpoint in {self.run_dir}/checkpoints; starting at step 0")
            if self.dist.main:
                M.truncate(self.run_dir, 0)
            return
        step, path = found
        opts = {"policy": self.opt, "distill": self.dopt}
        loaders = None
        if self.fsdp is not None:
            loaders = {"policy": lambda opt, state: self.fsdp.load_optim_state(self.model, opt, state)}
        meta, rng = ckpt.load(path, model=self.model, optimizers=opts, rank=self.dist.rank, world=self.dist.world,
                              parallel=self._layout(), optim_loaders=loaders)
        self.step = int(meta["step"])
        self.cursor.load_state_dict(meta["cursor"])
        self.kl.load_state_dict(meta["kl"])
        self.keep_rate = meta.get("keep_rate")
        ckpt.set_rng_state(rng)
        self._sync_rollout()
        self.dist.barrier()
        if self.dist.main:
            M.truncate(self.run_dir, self.step)
        self.log(f"resumed from {path} (step {self.step})")

    def _layout(self) -> str:
        """The effective layout: "fsdp" only when theta is actually sharded."""
        return "fsdp" if self.fsdp is not None else "ddp"

    def _full_weights(self):
        """Context with the full policy weights in the modules (FSDP: all-gathered; otherwise a no-op)."""
        return self.fsdp.gathered(self.model) if self.fsdp is not None else contextlib.nullcontext()

    def _sync_rollout(self) -> None:
        from sparse_rl.rl.grpo.backend import InProcessRollout

        if self.fsdp is not None and not isinstance(self.rollout, InProcessRollout):
            with self._full_weights():  # an external server needs the full weights
                self.rollout.sync_weights(self.model)
        else:
            self.rollout.sync_weights(self.model)

    # ------------------------------------------------------------------ rollouts
    def _prompt_ids(self, i: int) -> list[int]:
        if i not in self._prompt_cache:
            d = self.cfg.data
            self._prompt_cache[i] = encode_task(self.tokenizer, self.tasks[i], d.chat_template, d.system_prompt)
        return self._prompt_cache[i]

    def _sampling(self, seed: int, n: int, greedy: bool = False, max_new: int | None = None):
        from sparse_rl.rl.rollout import SamplingParams

        r = self.cfg.rollout
        return SamplingParams(n=n, temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p,
                              top_k=0 if greedy else r.top_k, max_new_tokens=max_new or r.max_new_tokens,
                              stop=list(r.stop), seed=seed, logprobs=True)

    def _rollout_attention(self) -> str:
        return "sparse" if self.cfg.sparse_rollout else "dense"

    def _score(self, tasks: list[dict], comps) -> list[float | None]:
        recs = [{"id": t["id"], "prompt": prompt_text(t), "completion": c.text, "tokens": len(c.tokens),
                 "finish_reason": c.finish_reason} for t, c in zip(tasks, comps)]
        return self.reward_fn(recs, tasks)

    def _collect_round(self, idx: list[int], rnd: int, st: RolloutStats, timer: Timer) -> list[Group]:
        """Roll out M samples for the prompts `idx`, score, oversample; returns the kept groups."""
        from sparse_rl.rl.oversample import select_top_n
        from sparse_rl.rl.rewards import SHAPING

        cfg, m, n = self.cfg, self.cfg.rollout.m, self.cfg.rollout.n
        if not idx:
            return []
        prompts = [self._prompt_ids(i) for i in idx]
        seed = mix_seed(cfg.seed, self.step, self.dist.rank, rnd)
        with timer("rollout"), self._full_weights():
            comps = self.rollout.generate(prompts, self._sampling(seed, m), self._rollout_attention())
        tasks = [self.tasks[i] for i in idx for _ in range(m)]
        with timer("reward"):
            raw = self._score(tasks, comps)
        lengths = [len(c.tokens) for c in comps]
        shaped: list[float | None] = list(raw)
        if cfg.reward.shaping != "none":
            pen = SHAPING[cfg.reward.shaping](lengths, max_len=cfg.rollout.max_new_tokens,
                                              cache_len=cfg.reward.overlong_cache, coef=cfg.reward.shaping_coef)
            shaped = [None if r is None else r + float(p) for r, p in zip(raw, pen.tolist())]
        st.sampled += len(comps)
        st.tokens += sum(lengths)
        st.truncated += sum(c.finish_reason == "length" for c in comps)
        st.groups_sampled += len(idx)
        gen = torch.Generator().manual_seed(mix_seed(cfg.seed, self.step, self.dist.rank, rnd, 1))
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
            groups.append(Group(self.tasks[i], prompts[g], [cs[k].tokens for k in kept],
                                [cs[k].logprobs for k in kept], [r_sh[k] for k in kept], [r_raw[k] for k in kept]))
        return groups

    def collect(self, timer: Timer) -> tuple[list[Group], RolloutStats]:
        """This process's groups for the step (dynamic sampling refills until the batch is full)."""
        from sparse_rl.rl.oversample import informative_groups, prompts_to_refill

        cfg = self.cfg
        st = RolloutStats()
        groups = self._collect_round(self.cursor.take_shard(self.per_rank, self.dist.rank, self.dist.world), 0, st,
                                     timer)
        if not cfg.loss.dynamic_sampling:
            return groups, st
        kept: list[Group] = []
        rnd = 0
        while True:
            if groups:
                mask = informative_groups(torch.tensor([g.rewards for g in groups])).tolist()
                kept += [g for g, keep in zip(groups, mask) if keep]
                seen, good = self.dist.sum([len(groups), sum(mask)])
                if seen:
                    rate = good / seen
                    self.keep_rate = rate if self.keep_rate is None else 0.5 * self.keep_rate + 0.5 * rate
            else:
                self.dist.sum([0, 0])
            if rnd >= cfg.loss.max_refills:
                break
            # every process must take the same number of prompts from the shared stream
            need = int(self.dist.max([prompts_to_refill(len(kept), self.per_rank, self.keep_rate)])[0])
            if need == 0:
                break
            rnd += 1
            st.refills += 1
            groups = self._collect_round(self.cursor.take_shard(need, self.dist.rank, self.dist.world), rnd, st, timer)
        return kept[:self.per_rank], st

    # ------------------------------------------------------------------ policy update
    def _batch(self, groups: list[Group]) -> Batch:
        from sparse_rl.rl.algos import ADVANTAGES, lookup

        adv_fn = lookup(ADVANTAGES, self.cfg.loss.advantage, "loss.advantage")
        prompts, toks, lps, advs = [], [], [], []
        for g in groups:
            a = adv_fn(torch.tensor([g.rewards]))[0].tolist()
            for t, lp, av in zip(g.tokens, g.logprobs, a):
                prompts.append(g.prompt_ids)
                toks.append(t)
                lps.append(lp)
                advs.append(av)
        return make_batch(prompts, toks, lps, advs, self.pad_id, self.device)

    def _micro(self, batch: Batch, size: int) -> list[Batch]:
        return [batch.slice(i, i + size) for i in range(0, len(batch), size)]

    def update(self, batch: Batch, timer: Timer, global_tokens: float, global_seqs: float) -> dict:
        """The policy-gradient update(s) of theta on this process's batch; returns summed stats."""
        from sparse_rl.rl.algos import KL_ESTIMATORS, LOSS_AGG, MISMATCH, POLICY_LOSSES, lookup, masked_entropy

        cfg, lc = self.cfg, self.cfg.loss
        temp = cfg.rollout.temperature
        mbs = self._micro(batch, cfg.optim.micro_batch)
        policy_loss = lookup(POLICY_LOSSES, lc.policy_loss, "loss.policy_loss")
        correction = lookup(MISMATCH, lc.mismatch, "loss.mismatch")
        kl_est = lookup(KL_ESTIMATORS, lc.kl_estimator, "loss.kl_estimator")
        agg = lookup(LOSS_AGG, lc.agg, "loss.agg")
        norm = {"num_tokens": global_tokens, "num_seqs": global_seqs, "max_len": cfg.rollout.max_new_tokens}
        need_ref = self.ref is not None
        old: list[torch.Tensor | None] = [None] * len(mbs)
        ref: list[torch.Tensor | None] = [None] * len(mbs)
        if cfg.optim.epochs > 1 or need_ref:
            with timer("dense_forward"), torch.no_grad():
                for i, mb in enumerate(mbs):
                    if cfg.optim.epochs > 1:
                        with policy_mode(self.model, "dense"):
                            old[i] = logprobs_of(forward_logits(self.model, mb, temp), mb)
                    if need_ref:
                        ref[i] = logprobs_of(forward_logits(self.ref, mb, temp), mb)
        # sums over tokens (weighted by token count) so that processes and micro-batches combine exactly
        acc = {k: 0.0 for k in ("loss", "entropy", "kl_ref", "clip_frac", "clip_frac_low", "clip_frac_high",
                                "approx_kl", "ratio_mean", "is_mean_weight", "is_frac_masked", "is_frac_truncated")}
        tokens_local = float(sum(mb.num_tokens() for mb in mbs))
        pis, mus, masks = [], [], []
        grad_norm = 0.0
        for epoch in range(cfg.optim.epochs):
            self.opt.zero_grad(set_to_none=True)
            bad = 0.0
            for i, mb in enumerate(mbs):
                ntok = mb.num_tokens()
                mask = mb.response(mb.mask)
                with policy_mode(self.model, "dense"):
                    with timer("dense_forward"):
                        logits = forward_logits(self.model, mb, temp)
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
                        if ref[i] is not None:
                            kl_tok = kl_est(logp, ref[i])
                            if self.kl.coef > 0:
                                loss = loss + self.kl.coef * agg(kl_tok, mask, **norm)
                        if not torch.isfinite(loss):
                            bad = 1.0
                        loss.backward()
                if epoch == 0:
                    with torch.no_grad():
                        acc["loss"] += float(loss.detach())  # already globally normalised: a plain sum
                        acc["entropy"] += float(masked_entropy(logits.detach(), mask)) * ntok
                        if kl_tok is not None:
                            acc["kl_ref"] += float((kl_tok.detach() * mask).sum())
                        for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean"):
                            acc[k] += float(stats[k]) * ntok
                        for k in ("mean_weight", "frac_masked", "frac_truncated"):
                            acc["is_" + k] += float(wstats[k]) * ntok
                        pis.append(lp_old.detach()[mask.bool()].cpu())
                        mus.append(lp_mu[mask.bool()].cpu())
                del logits, logp, loss
            with timer("update"):
                if self.fsdp is None:
                    self.dist.reduce_grads(self.theta)
                else:  # FSDP's backward already summed the shards' gradients; unused params count as zero
                    for p in self.theta:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                gn = torch.nn.utils.clip_grad_norm_(self.theta, cfg.optim.grad_clip if cfg.optim.grad_clip > 0
                                                    else float("inf"))
                if self.fsdp is not None:
                    gn = self.fsdp.grad_norm(gn)
                bad = self.dist.max([bad])[0]
                if bad or not torch.isfinite(gn):
                    self.opt.zero_grad(set_to_none=True)
                    raise NaNLossError("non-finite")
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            if epoch == 0:
                grad_norm = float(gn)
        out = dict(acc)
        out["tokens_local"] = tokens_local
        out["grad_norm"] = grad_norm
        out["pis"], out["mus"] = pis, mus
        return out

    # ------------------------------------------------------------------ step
    def train_step(self) -> dict:
        cfg = self.cfg
        timer = Timer(self.device)
        t0 = time.perf_counter()
        groups, st = self.collect(timer)
        batch = self._batch(groups)
        n_tok, n_seq = self.dist.sum([float(batch.num_tokens()), float(len(batch))])
        rec: dict = {}
        if n_seq > 0:
            u = self.update(batch, timer, n_tok, n_seq)
            sums = self.dist.sum([u[k] for k in ("loss", "entropy", "kl_ref", "clip_frac", "clip_frac_low",
                                                 "clip_frac_high", "approx_kl", "ratio_mean", "is_mean_weight",
                                                 "is_frac_masked", "is_frac_truncated")])
            rec["loss"] = sums[0]
            for k, v in zip(("entropy", "kl_ref", "clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl",
                             "ratio_mean", "is_mean_weight", "is_frac_masked", "is_frac_truncated"), sums[1:]):
                rec[k] = v / max(n_tok, 1.0)
            if self.ref is None:
                rec["kl_ref"] = None
            rec["grad_norm"] = u["grad_norm"]
            rec.update(self._mismatch(u["pis"], u["mus"]))
            if self.ref is not None:
                rec["kl_coef"] = self.kl.coef
                self.kl.update(rec["kl_ref"], n_steps=int(n_seq))
            if cfg.distill_on:
                with timer("distill"):
                    rec.update(distill(self.model, batch, self.dopt, cfg.distill, temperature=cfg.rollout.temperature,
                                       global_tokens=n_tok, reduce_grads=self.dist.reduce_grads,
                                       grad_clip=cfg.optim.grad_clip, all_sum=lambda x: self.dist.sum([x])[0]))
            self._sync_rollout()
        else:
            self.log(f"[yellow]step {self.step + 1}: no informative groups; no update this step")
        self.step += 1
        elapsed = time.perf_counter() - t0
        s = self.dist.sum([st.sampled, st.tokens, st.reward_sum, st.correct, st.truncated, st.groups_sampled,
                           st.groups_skipped, sum(sum(g.rewards) for g in groups), sum(
                               sum(r >= cfg.reward.correct_threshold for r in g.raw) for g in groups),
                           sum(len(t) for g in groups for t in g.tokens)])
        times = self.dist.max([timer.t.get(k, 0.0) for k in ("rollout", "reward", "dense_forward", "update",
                                                                "distill")] + [elapsed])
        sampled_scored = s[0] - cfg.rollout.m * s[6]
        rec.update({
            "step": self.step, "epoch": self.cursor.epoch, "prompts_seen": self.cursor.epoch * len(self.tasks)
            + self.cursor.pos, "groups": int(round(n_seq / cfg.rollout.n)), "groups_sampled": int(s[5]),
            "groups_skipped": int(s[6]), "refills": st.refills,
            "reward": s[2] / sampled_scored if sampled_scored else None,
            "accuracy": s[3] / sampled_scored if sampled_scored else None,
            "response_length": s[1] / s[0] if s[0] else None, "truncated_frac": s[4] / s[0] if s[0] else None,
            "reward_kept": s[7] / n_seq if n_seq else None, "accuracy_kept": s[8] / n_seq if n_seq else None,
            "response_length_kept": s[9] / n_seq if n_seq else None,
            "rollout_tokens": int(s[1]), "rollout_tokens_per_s": s[1] / times[0] if times[0] > 0 else None,
            "time_rollout": times[0], "time_reward": times[1], "time_dense_forward": times[2],
            "time_update": times[3], "time_distill": times[4] if cfg.distill_on else None, "time_step": times[5],
        })
        rec["distill_time_frac"] = times[4] / times[5] if cfg.distill_on and times[5] > 0 else None
        return {k: rec.get(k) for k in M.STEP_KEYS}

    def _mismatch(self, pis: list[torch.Tensor], mus: list[torch.Tensor]) -> dict:
        from sparse_rl.rl.algos import mismatch_metrics

        pi = torch.cat(pis) if pis else torch.zeros(0)
        mu = torch.cat(mus) if mus else torch.zeros(0)
        parts = self.dist.gather((pi, mu))
        pi = torch.cat([p for p, _ in parts])
        mu = torch.cat([q for _, q in parts])
        mm = mismatch_metrics(pi[None], mu[None], torch.ones(1, pi.numel()))
        return {"mismatch_kl": mm["mismatch_kl"], "mismatch_kl_k1": mm["mismatch_kl_k1"],
                "mismatch_p5_ratio": mm["p5_min_ratio"]}

    # ------------------------------------------------------------------ eval
    def evaluate(self) -> dict:
        """Held-out accuracy: greedy (or sampled) completions of the eval tasks, sharded over processes."""
        cfg, ev = self.cfg, self.cfg.eval
        tasks = self.eval_tasks or []
        mine = tasks[self.dist.rank::self.dist.world]
        d = cfg.data
        prompts = [encode_task(self.tokenizer, t, d.chat_template, d.system_prompt) for t in mine]
        n = 1 if ev.greedy else ev.samples
        attention = self._rollout_attention() if ev.attention == "rollout" else "dense"
        correct = reward = length = 0.0
        count = 0
        comps = []
        # FSDP's all-gather is a collective: every rank takes part, even one without eval tasks
        with self._full_weights():
            if prompts:
                params = self._sampling(mix_seed(cfg.seed, self.step, self.dist.rank, 7919), n, greedy=ev.greedy,
                                        max_new=ev.max_new_tokens)
                comps = self.rollout.generate(prompts, params, attention)
        if prompts:
            rtasks = [t for t in mine for _ in range(n)]
            rs = self._score(rtasks, comps)
            for r, c in zip(rs, comps):
                if r is None:
                    continue
                count += 1
                correct += r >= cfg.reward.correct_threshold
                reward += r
                length += len(c.tokens)
        s = self.dist.sum([correct, reward, length, count])
        return {"eval_accuracy": s[0] / s[3] if s[3] else None, "eval_reward": s[1] / s[3] if s[3] else None,
                "eval_response_length": s[2] / s[3] if s[3] else None, "eval_tasks": len(tasks)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path | None:
        rngs = self.dist.gather(ckpt.rng_state())
        self._check_in_sync()
        full = optim = None
        if self.fsdp is not None:  # collectives: every rank takes part, rank 0 receives the full tensors
            full = self.fsdp.full_state(self.model)
            optim = {"policy": self.fsdp.optim_state(self.model, self.opt)}
        path = None
        if self.dist.main:
            meta = {"cursor": self.cursor.state_dict(), "kl": self.kl.state_dict(), "keep_rate": self.keep_rate,
                    "world_size": self.dist.world, "parallel": self._layout(), "mode": self.cfg.rollout.mode,
                    "model": str(self.cfg.model), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            path = ckpt.save(self.run_dir, self.step, model=self.model, tokenizer=self.tokenizer,
                             optimizers={"policy": self.opt, "distill": self.dopt}, rng_states=rngs, meta=meta,
                             keep=self.cfg.checkpoint.keep, full_state=full, optim_states=optim)
        self.dist.barrier()
        return path

    def _check_in_sync(self) -> None:
        """Data-parallel replicas must hold identical weights; a checksum mismatch is a bug, not noise."""
        if self.dist.world == 1:
            return
        # FSDP: theta's shards differ by design; the replicated adapter must still agree
        params = self.phi if self.fsdp is not None else self.theta + self.phi
        if not params:
            return
        with torch.no_grad():
            cs = float(sum(p.double().sum() for p in params))
        lo, hi = -self.dist.max([-cs])[0], self.dist.max([cs])[0]
        if lo != hi:
            raise SparseRLError(f"step {self.step}: the data-parallel replicas' weights diverged (checksums {lo} vs {hi})")

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        cfg = self.cfg
        last: dict = {}
        while self.step < cfg.steps:
            try:
                rec = self.train_step()
            except NaNLossError:
                found = ckpt.latest(self.run_dir)
                where = f"the last good checkpoint is {found[1]}" if found else "no checkpoint was saved yet"
                raise NaNLossError(f"step {self.step + 1}: the policy loss or its gradient is NaN/inf; the run stopped "
                                   f"before updating the weights and {where} (lower optim.lr, set optim.grad_clip, or "
                                   "check the rewards)") from None
            final = self.step == cfg.steps
            if self.eval_tasks and ((cfg.eval.every and self.step % cfg.eval.every == 0) or final):
                rec.update(self.evaluate())
            if self.dist.main:
                M.append(self.run_dir, rec)
                self.log(_summary(rec))
            if self.step % cfg.checkpoint.every == 0 or final:
                self.save_checkpoint()
            if self.dist.main and (self.step % cfg.plot_every == 0 or final):
                M.plot(self.run_dir)
            last = rec
        self.dist.close()
        return last


def _fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def _summary(r: dict) -> str:
    parts = [f"step {r['step']}", f"reward {_fmt(r['reward'])}", f"acc {_fmt(r['accuracy'])}",
             f"len {_fmt(r['response_length'], '.1f')}", f"mismatch {_fmt(r['mismatch_kl'], '.4f')}",
             f"tok/s {_fmt(r['rollout_tokens_per_s'], '.0f')}", f"step {_fmt(r['time_step'], '.2f')}s"]
    if r.get("distill_kl_before") is not None:
        parts.append(f"distill {_fmt(r['distill_kl_before'], '.4f')}->{_fmt(r.get('distill_kl_after'), '.4f')}")
    if r.get("eval_accuracy") is not None:
        parts.append(f"eval acc {_fmt(r['eval_accuracy'])}")
    return " | ".join(parts)


def run(cfg: GRPOConfig, resume: bool = False, log=None, backend=None) -> dict:
    """Train; returns the last step's metrics record. Output: the run dir (see docs/DESIGN.md, "Run dir").
    backend: optional `RolloutBackend` (default: the in-process engine)."""
    trainer = Trainer(cfg, resume=resume, log=log, backend=backend)
    if trainer.step >= cfg.steps:
        trainer.log(f"nothing to do: the run is at step {trainer.step} of {cfg.steps}")
        return {}
    return trainer.train()
