"""The GRPO loop (docs/DESIGN.md, "RL contract"), one step:

Steps 1-4 are `collect.collect`, 5-8 `update.build_batch` + `update.policy_update`, 9 `distill.distill`;
this module holds the state between steps (model, optimizers, data cursor, KL controller) and the loop.

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
processes), scaled by `Dist.grad_scale` (= world), and the gradients are averaged across processes
with one all-reduce per update: the sum of the shares. So the update equals the single-process
update on the union of the slices, without wrapping the model in DDP (whose hooks assume one fixed
set of trainable parameters, while theta and phi train in turn). With `parallel: fsdp`, theta is
sharded with FSDP2 instead (parallel.FSDPPolicy): the backward's reduce-scatter averages theta's
gradients (no manual all-reduce), rollouts and eval run inside
`FSDPPolicy.gathered()` (full weights), checkpoints gather the full weights for rank 0.

Determinism: every random choice of a step (sampling noise, oversampling ties) is seeded from
(seed, step, rank, refill round), so a resumed run repeats exactly what the uninterrupted run did;
the RNG states are checkpointed as well.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from sparse_rl import runs
from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.rl.grpo import checkpoint as ckpt
from sparse_rl.rl.grpo import metrics as M
from sparse_rl.rl.grpo.collect import Collector, Group, RolloutStats, collect, sampling_params, score_completions
from sparse_rl.rl.grpo.config import GRPOConfig
from sparse_rl.rl.grpo.data import DataCursor, encode_task, load_tasks
from sparse_rl.rl.grpo.distill import attach_adapter, distill, lora_params, theta_params
from sparse_rl.rl.grpo.metrics import StepMetrics
from sparse_rl.rl.grpo.update import NaNLossError, build_batch, policy_update
from sparse_rl.distributed import Dist
from sparse_rl.rl.grpo.parallel import FSDPPolicy, Timer, mix_seed


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
        if cfg.rollout.max_batch < cfg.rollout.samples:
            raise UsageError(f"rollout.max_batch ({cfg.rollout.max_batch}) must be >= rollout.samples ({cfg.rollout.samples})")
        resume = self._check_run_dir(resume)

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
                                                      compile=cfg.rollout.compile,
                                                      runner_options=cfg.rollout.runner_options())
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
    def _check_run_dir(self, resume: bool) -> bool:
        """Whether there is a run to resume. `--resume` on a dir that holds no run yet (no config.yaml,
        no checkpoint, no metrics: killed before its first write) starts one, as indexer training does."""
        d = self.run_dir
        if resume and not (d / "config.yaml").is_file():
            if (d / runs.METRICS).exists() or runs.list_checkpoints(d):
                raise UsageError(f"--resume: {d} holds metrics or checkpoints but no config.yaml; restore it, or "
                                 "start a new run dir")
            self.log(f"[yellow]--resume: {d} holds no run yet (no config.yaml); starting a new one")
            resume = False
            if d.exists() and any(p for p in d.iterdir() if not _temporary(p)):
                raise UsageError(f"--out {d}: exists and is not empty; choose a new dir")
        elif not resume and d.exists() and any(d.iterdir()):
            raise UsageError(f"--out {d}: exists and is not empty; pass --resume to continue that run or choose a new dir")
        return resume

    def _create_run_dir(self) -> None:
        """Written only once the inputs are checked and the model loaded, so a failed start leaves no run dir."""
        from sparse_rl.config import save_config

        self.dist.barrier()
        if self.dist.main:
            runs.clean_orphans(self.run_dir, log=self._warn)  # what a killed run of this dir left behind
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / "config.yaml")
        self.dist.barrier()

    def _resume(self) -> None:
        found = runs.latest(self.run_dir)
        if found is None:
            self.log(f"[yellow]resume: no checkpoint in {self.run_dir}/checkpoints; starting at step 0")
            if self.dist.main:
                M.truncate(self.run_dir, 0, log=self._warn)
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
        runs.set_rng_state(rng)
        self._sync_rollout()
        self.dist.barrier()
        if self.dist.main:
            M.truncate(self.run_dir, self.step, log=self._warn)
        self.log(f"resumed from {path} (step {self.step})")

    def _warn(self, msg: str) -> None:
        self.log(f"[yellow]{msg}")

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

    def _rollout_attention(self) -> str:
        return "sparse" if self.cfg.sparse_rollout else "dense"

    def _collector(self) -> Collector:
        return Collector(self.cfg, self.rollout, self.tasks, self._prompt_ids,
                         lambda tasks, comps: score_completions(self.reward_fn, tasks, comps), self.dist,
                         self._rollout_attention(), self._full_weights)

    # ------------------------------------------------------------------ step
    def train_step(self) -> dict:
        cfg = self.cfg
        timer = Timer(self.device)
        t0 = time.perf_counter()
        groups, st = collect(self._collector(), self.cursor, self.per_rank, self.step, self.keep_rate, timer)
        self.keep_rate = st.keep_rate
        batch = build_batch(groups, cfg.loss.advantage, self.pad_id, self.device)
        n_tok, n_seq = self.dist.sum([float(batch.num_tokens()), float(len(batch))])
        rec = StepMetrics()
        if n_seq > 0:
            u = policy_update(cfg, self.model, self.ref, self.opt, self.theta, batch, dist=self.dist, fsdp=self.fsdp,
                              kl_coef=self.kl.coef, timer=timer, global_tokens=n_tok, global_seqs=n_seq)
            sums = self.dist.sum_named(u.sums)
            rec.set({k: v / max(n_tok, 1.0) for k, v in sums.items() if k in M.TOKEN_MEAN})
            rec.loss, rec.grad_norm = sums["loss"], u.grad_norm
            if self.ref is None:
                rec.kl_ref = None
            rec.set(self._mismatch(u.pis, u.mus))
            if self.ref is not None:
                rec.kl_coef = self.kl.coef
                self.kl.update(rec.kl_ref, n_steps=int(n_seq))
            if cfg.distill_on:
                with timer("distill"):
                    rec.set(distill(self.model, batch, self.dopt, cfg.distill, temperature=cfg.rollout.temperature,
                                    global_tokens=n_tok, reduce_grads=self._reduce_global,
                                    grad_clip=cfg.optim.grad_clip, all_sum=lambda x: self.dist.sum([x])[0]))
            self._sync_rollout()
        else:
            self.log(f"[yellow]step {self.step + 1}: no informative groups; no update this step")
        self.step += 1
        self._rollout_metrics(rec, groups, st, n_seq)
        self._time_metrics(rec, timer, time.perf_counter() - t0)
        return rec.record()

    def _rollout_metrics(self, rec: StepMetrics, groups: list[Group], st: RolloutStats, n_seq: float) -> None:
        cfg = self.cfg
        s = self.dist.sum_named({
            "sampled": st.sampled, "tokens": st.tokens, "reward": st.reward_sum, "correct": st.correct,
            "truncated": st.truncated, "groups_sampled": st.groups_sampled, "groups_skipped": st.groups_skipped,
            "reward_kept": sum(sum(g.rewards) for g in groups),
            "correct_kept": sum(sum(r >= cfg.reward.correct_threshold for r in g.raw) for g in groups),
            "length_kept": sum(len(t) for g in groups for t in g.tokens)})
        scored = s["sampled"] - cfg.rollout.samples * s["groups_skipped"]  # completions of groups with a verdict
        rec.step, rec.epoch = self.step, self.cursor.epoch
        rec.prompts_seen = self.cursor.epoch * len(self.tasks) + self.cursor.pos
        rec.groups, rec.refills = int(round(n_seq / cfg.rollout.keep)), st.refills
        rec.groups_sampled, rec.groups_skipped = int(s["groups_sampled"]), int(s["groups_skipped"])
        rec.reward = s["reward"] / scored if scored else None
        rec.accuracy = s["correct"] / scored if scored else None
        rec.response_length = s["tokens"] / s["sampled"] if s["sampled"] else None
        rec.truncated_frac = s["truncated"] / s["sampled"] if s["sampled"] else None
        rec.reward_kept = s["reward_kept"] / n_seq if n_seq else None
        rec.accuracy_kept = s["correct_kept"] / n_seq if n_seq else None
        rec.response_length_kept = s["length_kept"] / n_seq if n_seq else None
        rec.rollout_tokens = int(s["tokens"])

    def _time_metrics(self, rec: StepMetrics, timer: Timer, elapsed: float) -> None:
        distill_on = self.cfg.distill_on
        t = self.dist.max_named({k: timer.t.get(k, 0.0) for k in ("rollout", "reward", "dense_forward", "update",
                                                                  "distill")} | {"step": elapsed})
        rec.rollout_tokens_per_s = rec.rollout_tokens / t["rollout"] if t["rollout"] > 0 else None
        rec.time_rollout, rec.time_reward, rec.time_dense_forward = t["rollout"], t["reward"], t["dense_forward"]
        rec.time_update, rec.time_step = t["update"], t["step"]
        rec.time_distill = t["distill"] if distill_on else None
        rec.distill_time_frac = t["distill"] / t["step"] if distill_on and t["step"] > 0 else None

    def _reduce_global(self, params: list[torch.nn.Parameter]) -> None:
        """Sync gradients of a loss normalised by global counts (distillation's): scaled by
        `grad_scale`, then averaged, so the result is their sum over processes."""
        if self.dist.world > 1:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.dist.grad_scale)
        self.dist.reduce_grads(params)

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
                params = sampling_params(cfg, mix_seed(cfg.seed, self.step, self.dist.rank, 7919), n, greedy=ev.greedy,
                                         max_new=ev.max_new_tokens)
                comps = self.rollout.generate(prompts, params, attention)
        if prompts:
            rtasks = [t for t in mine for _ in range(n)]
            rs = score_completions(self.reward_fn, rtasks, comps)
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
        rngs = self.dist.gather(runs.rng_state())
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
                found = runs.latest(self.run_dir)
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


def _temporary(p: Path) -> bool:
    """A leftover of an atomic write (cleaned by `runs.clean_orphans`), not a file of the user's."""
    return p.name.startswith(".") and (".tmp" in p.name or ".old-" in p.name)


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
