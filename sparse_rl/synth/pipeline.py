"""`synth math` and `synth agent` as plain functions over one config dataclass each.

Both are deterministic for a seed (each task has its own RNG keyed by (seed, kind, index)); the
HTTP policy is deterministic only as far as the server honours the per-request `seed`.
Outputs are returned, not written: the CLI writes them atomically once everything succeeded.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Callable, Literal, Optional

from sparse_rl.errors import UsageError
from sparse_rl.synth import filters as F
from sparse_rl.synth.math_tasks import GENERATORS, corrupt_answer, make_math_task, verify_math


@dataclasses.dataclass
class SynthMathConfig:
    n: int = 100                     # tasks to keep (before the optional calibration band)
    seed: int = 0
    families: list[str] = dataclasses.field(default_factory=lambda: ["arith", "word", "vartrack"])
    reasoning_gym: list[str] = dataclasses.field(default_factory=list)  # reasoning-gym dataset names (optional dep)
    min_level: int = 1
    max_level: int = 5
    length: int = 512                # vartrack: filler words
    dedup_threshold: float = 0.85    # MinHash Jaccard at or above which a prompt is a near-duplicate
    # Optional calibration: K attempts per task by a model behind an OpenAI-compatible endpoint;
    # the pass rate becomes `difficulty` (the level stays in meta.level) and a band filters tasks.
    policy: Literal["none", "endpoint"] = "none"
    endpoint: Optional[str] = None
    model: Optional[str] = None
    temperature: float = 0.7
    max_tokens: int = 1024
    request_timeout: float = 120.0
    attempts: int = 4
    min_pass: float = 0.0
    max_pass: float = 1.0
    out: str = "-"                   # tasks JSONL
    stats: Optional[str] = None      # stats JSON (default: stdout when --out is a file)

    def __post_init__(self):
        if self.policy == "endpoint" and not (self.endpoint and self.model):
            raise UsageError("--endpoint and --model are required with --policy endpoint")
        if self.attempts < 1:
            raise UsageError(f"attempts: must be at least 1, got {self.attempts}")
        if not 0.0 <= self.min_pass <= self.max_pass <= 1.0:
            raise UsageError(f"min_pass/max_pass: need 0 <= min_pass <= max_pass <= 1, got {self.min_pass}, {self.max_pass}")
        if self.n < 1:
            raise UsageError(f"n: must be at least 1, got {self.n}")
        if not 1 <= self.min_level <= self.max_level:
            raise UsageError(f"min_level/max_level: need 1 <= min_level <= max_level, got {self.min_level}, {self.max_level}")
        for f in self.families:
            if f not in GENERATORS:
                raise UsageError(f"families: unknown family '{f}' (known: {', '.join(GENERATORS)})")
        if not self.families and not self.reasoning_gym:
            raise UsageError("families: empty, and no reasoning_gym datasets either: nothing to generate")
        if self.length < 0:
            raise UsageError(f"length: must be >= 0, got {self.length}")


def run_math(cfg: SynthMathConfig, progress: Callable[[int], None] | None = None) -> tuple[list[dict], dict]:
    sources = list(cfg.families) + [f"rg:{d}" for d in cfg.reasoning_gym]
    quota = {s: cfg.n // len(sources) + (i < cfg.n % len(sources)) for i, s in enumerate(sources)}
    dedup = F.Deduper(cfg.dedup_threshold)
    dropped: Counter = Counter()
    kept: list[dict] = []
    generated = 0
    for src, want in quota.items():
        if src.startswith("rg:"):
            from sparse_rl.synth.rg_adapter import make_rg_tasks

            # reasoning-gym has its own verifier; we only deduplicate.
            cands = iter(make_rg_tasks(src[3:], want * 2, cfg.seed))
        else:
            cands = _math_candidates(cfg, src, want)
        got = 0
        for task in cands:
            if got >= want:
                break
            generated += 1
            if not src.startswith("rg:") and not (verify_math(task["answer"], f"\\boxed{{{task['answer']}}}") == 1.0
                                                   and verify_math(task["answer"], f"\\boxed{{{corrupt_answer(task['answer'])}}}") == 0.0):
                dropped["self_check"] += 1
                continue
            why = dedup.add(F.task_text(task))
            if why:
                dropped[why] += 1
                continue
            kept.append(task)
            got += 1
            if progress:
                progress(1)
    hist = None
    if cfg.policy == "endpoint":
        kept, hist = _calibrate_math(cfg, kept, dropped)
    by_task = Counter(t["task"] for t in kept)
    by_level = Counter(str(t["meta"].get("level")) for t in kept if "level" in t["meta"])
    stats = {"stage": "synth math", "seed": cfg.seed, "tasks": {"generated": generated, "kept": len(kept),
             "dropped": dict(sorted(dropped.items()))}, "by_task": dict(sorted(by_task.items())),
             "by_level": dict(sorted(by_level.items()))}
    if hist is not None:
        stats["pass_rate_histogram"] = hist
    return kept, stats


def _calibrate_math(cfg: SynthMathConfig, tasks: list[dict], dropped: Counter) -> tuple[list[dict], dict]:
    """K single-turn attempts per task through the endpoint; keep tasks whose pass rate is in band."""
    from sparse_rl.synth.agent import OpenAIChatPolicy
    from sparse_rl.synth.verify import verify

    hist: Counter = Counter()
    out = []
    for task in tasks:
        passes = 0
        for k in range(cfg.attempts):
            seed = int.from_bytes(random.Random(f"{cfg.seed}:{task['id']}:{k}").randbytes(4), "little")
            pol = OpenAIChatPolicy(cfg.endpoint, cfg.model, cfg.temperature, cfg.max_tokens, seed, cfg.request_timeout)
            reply = pol.chat([{"role": "user", "content": task["prompt"]}], [])
            passes += verify(task, reply.get("content") or "") == 1.0
        hist[f"{passes}/{cfg.attempts}"] += 1
        rate = passes / cfg.attempts
        if not F.in_band(rate, cfg.min_pass, cfg.max_pass):
            dropped["pass_band"] += 1
            continue
        out.append({**task, "difficulty": rate, "meta": {**task["meta"], "pass_rate": rate, "attempts": cfg.attempts}})
    return out, {f"{i}/{cfg.attempts}": hist.get(f"{i}/{cfg.attempts}", 0) for i in range(cfg.attempts + 1)}


def _math_candidates(cfg: SynthMathConfig, family: str, want: int):
    # Candidates beyond `want` replace ones the filters drop; 4x is never reached in practice.
    for i in range(want * 4):
        level = random.Random(f"{cfg.seed}:level:{family}:{i}").randint(cfg.min_level, cfg.max_level)
        yield make_math_task(family, cfg.seed, i, level, cfg.length)


# ------------------------------------------------------------------------------------- agent


@dataclasses.dataclass
class SynthAgentConfig:
    n: int = 20                      # tasks to generate (before calibration)
    seed: int = 0
    envs: list[str] = dataclasses.field(default_factory=lambda: ["fs", "sql", "calendar", "code", "combo"])
    min_level: int = 1
    max_level: int = 4
    tasks_in: Optional[str] = None   # sample trajectories for these tool tasks instead of generating
    policy: Literal["scripted", "endpoint"] = "scripted"
    endpoint: Optional[str] = None   # OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1
    model: Optional[str] = None
    temperature: float = 0.7
    max_tokens: int = 1024
    request_timeout: float = 120.0
    attempts: int = 4                # K attempts per task
    max_turns: int = 12
    keep_failures: bool = True       # keep informative failures, labelled
    min_pass: float = 0.0            # calibration band on the pass rate over K attempts
    max_pass: float = 1.0
    reviewer: bool = False           # score kept trajectories with a reviewer model through the endpoint
    reviewer_model: Optional[str] = None
    min_review: float = 0.5
    dedup_threshold: float = 0.85
    out: str = "-"                   # tasks JSONL (kept tasks, difficulty = pass rate)
    trajectories: Optional[str] = None
    stats: Optional[str] = None

    def __post_init__(self):
        from sparse_rl.synth.tool_tasks import TEMPLATES

        for e in self.envs:
            if e not in TEMPLATES:
                raise UsageError(f"envs: unknown environment '{e}' (known: {', '.join(TEMPLATES)})")
        if not self.envs and not self.tasks_in:
            raise UsageError("envs: empty and no tasks_in: nothing to do")
        if self.n < 1 or self.attempts < 1 or self.max_turns < 1:
            raise UsageError("n, attempts and max_turns must be at least 1")
        if not 1 <= self.min_level <= self.max_level:
            raise UsageError(f"min_level/max_level: need 1 <= min_level <= max_level, got {self.min_level}, {self.max_level}")
        if not 0.0 <= self.min_pass <= self.max_pass <= 1.0:
            raise UsageError(f"min_pass/max_pass: need 0 <= min_pass <= max_pass <= 1, got {self.min_pass}, {self.max_pass}")
        if (self.policy == "endpoint" or self.reviewer) and not (self.endpoint and (self.model or self.reviewer_model)):
            raise UsageError("--endpoint and --model are required with --policy endpoint or --reviewer")


def generate_tool_tasks(cfg: SynthAgentConfig) -> tuple[list[dict], Counter]:
    from sparse_rl.synth.tool_tasks import make_tool_task

    tasks, dropped = [], Counter()
    for i in range(cfg.n):
        env = cfg.envs[i % len(cfg.envs)]
        level = random.Random(f"{cfg.seed}:level:{env}:{i}").randint(cfg.min_level, cfg.max_level)
        task = None
        for retry in range(4):  # a template may be unsatisfiable for this draw: redraw with a new index
            task = make_tool_task(env, cfg.seed, i + retry * 1_000_000, level)
            if task is not None:
                break
            dropped["self_check"] += 1
        if task is not None:
            tasks.append(task)
    return tasks, dropped


def _policy_for(cfg: SynthAgentConfig, task: dict, k: int):
    from sparse_rl.synth.agent import OpenAIChatPolicy, ScriptedPolicy

    if cfg.policy == "scripted":
        return ScriptedPolicy(task)
    seed = int.from_bytes(random.Random(f"{cfg.seed}:{task['id']}:{k}").randbytes(4), "little")
    return OpenAIChatPolicy(cfg.endpoint, cfg.model, cfg.temperature, cfg.max_tokens, seed, cfg.request_timeout)


def run_agent(cfg: SynthAgentConfig, tasks: list[dict] | None = None, task_drops: Counter | None = None,
              progress: Callable[[int], None] | None = None) -> tuple[list[dict], list[dict], dict]:
    """Generate (or take) tool tasks, sample K trajectories each, filter, calibrate.

    `task_drops` carries counts from an earlier `generate_tool_tasks` call into the stats.
    Returns (kept tasks, kept trajectories, stats).
    """
    from sparse_rl.synth.agent import OpenAIChatPolicy, run_episode

    task_drops = Counter(task_drops or {})
    if tasks is None:
        tasks, task_drops = generate_tool_tasks(cfg)
    generated = len(tasks) + task_drops["self_check"]
    dedup_tasks = F.Deduper(cfg.dedup_threshold)
    uniq = []
    for t in tasks:
        why = dedup_tasks.add(F.task_text(t))
        if why:
            task_drops[why] += 1
        else:
            uniq.append(t)
    reviewer = None
    if cfg.reviewer:
        reviewer = OpenAIChatPolicy(cfg.endpoint, cfg.reviewer_model or cfg.model, 0.0, 64, cfg.seed, cfg.request_timeout)

    traj_drops: Counter = Counter()
    labels: Counter = Counter()
    hist: Counter = Counter()
    kept_tasks, kept_trajs = [], []
    sampled = 0
    for task in uniq:
        attempts = []
        for k in range(cfg.attempts):
            traj = run_episode(task, _policy_for(cfg, task, k), cfg.max_turns)
            traj["id"] = f"{task['id']}-a{k}"
            traj["tools"] = task["meta"]["tools"]
            attempts.append(traj)
            sampled += 1
            if progress:
                progress(1)
        passes = 0
        survivors = []
        # Duplicates are judged among one task's attempts with the same label: a success and a
        # failure that share their calls are a contrastive pair, not duplicates.
        dedup_traj: dict[str, F.Deduper] = {}
        for traj in attempts:
            rules = F.rule_checks(traj, task["meta"]["tools"])
            execution = F.execution_check(task, traj)
            traj["reward"] = execution
            traj["checks"].update(rules)
            traj["checks"]["execution"] = execution == 1.0
            passes += execution == 1.0
            bad = [r for r in F.RULES if not rules[r]]
            if bad:
                traj_drops[bad[0]] += 1
                continue
            if execution == 1.0:
                traj["label"] = "success:recovered" if traj["meta"]["tool_errors"] else "success"
            else:
                lab = F.label_failure(traj) if cfg.keep_failures else None
                if lab is None:
                    traj_drops["uninformative_failure" if cfg.keep_failures else "failure"] += 1
                    continue
                traj["label"] = lab
            why = dedup_traj.setdefault(traj["label"], F.Deduper(cfg.dedup_threshold)).add(F.trajectory_text(traj))
            if why:
                traj_drops["duplicate"] += 1
                continue
            if reviewer is not None:  # last: the only filter that costs a model call
                score = F.review_score(reviewer, task, traj)
                traj["checks"]["reviewer"] = score
                if score is None or score < cfg.min_review:
                    traj_drops["reviewer"] += 1
                    continue
            survivors.append(traj)
        rate = passes / cfg.attempts
        hist[f"{passes}/{cfg.attempts}"] += 1
        if not F.in_band(rate, cfg.min_pass, cfg.max_pass):
            task_drops["pass_band"] += 1
            traj_drops["pass_band"] += len(survivors)
            continue
        kept = dict(task)
        kept["difficulty"] = rate
        kept["meta"] = {**task["meta"], "pass_rate": rate, "attempts": cfg.attempts}
        kept_tasks.append(kept)
        for t in survivors:
            labels[t["label"]] += 1
        kept_trajs.extend(survivors)
    stats = {"stage": "synth agent", "seed": cfg.seed, "policy": cfg.policy,
             "tasks": {"generated": generated, "kept": len(kept_tasks), "dropped": dict(sorted(task_drops.items()))},
             "trajectories": {"sampled": sampled, "kept": len(kept_trajs), "dropped": dict(sorted(traj_drops.items())),
                              "labels": dict(sorted(labels.items()))},
             "pass_rate_histogram": {f"{i}/{cfg.attempts}": hist.get(f"{i}/{cfg.attempts}", 0)
                                     for i in range(cfg.attempts + 1)},
             "by_env": dict(sorted(Counter(t["meta"]["env"] for t in kept_tasks).items()))}
    return kept_tasks, kept_trajs, stats
