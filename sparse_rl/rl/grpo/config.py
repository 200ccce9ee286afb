"""`GRPOConfig`: the one source of truth for `sparse-rl grpo` (YAML recipe < flags).

Sections map to nested YAML mappings (`rollout:`, `loss:`, ...); a flag such as `--set loss.eps_high=0.28`
overrides one key. Every registered-function name (advantage, aggregation, mismatch correction, KL
estimator, distillation loss, reward shaping) is checked against its registry here, so a typo fails
before any model is loaded, with the key and the valid names in the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sparse_rl.errors import UsageError
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT

MODES = ("dense", "sparse", "sparse+distill")


@dataclass
class DataConfig:
    tasks: str = ""  # tasks JSONL: {"id", "prompt"|"messages", "answer"?, "task", ...}
    prompts_per_step: int = 8  # prompts per step over all processes (groups before filtering)
    shuffle: bool = True  # reshuffle the task order every epoch (seeded)
    chat_template: bool = True  # wrap a plain "prompt" string as one user message through the chat template
    system_prompt: str | None = None  # prepended as a system message when chat_template is on


@dataclass
class RolloutConfig:
    mode: str = "dense"  # dense | sparse (naive: no distillation) | sparse+distill
    samples: int = 8  # completions sampled per prompt (M)
    keep: int = 4  # completions kept per prompt (top-n by reward; keep == samples disables oversampling)
    temperature: float = 1.0
    # mu's recorded log-probs are those of the distribution sampled from (after top-k/top-p
    # filtering); pi's are of logits / temperature, so filtering shows up as rollout mismatch
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    max_batch: int = 256  # engine slots (sequences decoded together)
    compile: bool | None = None  # torch.compile the engine's decode step (None: SPARSE_RL_COMPILE, else off)
    backend: str | None = None  # sparse kernels: auto | torch | triton (None: the model's default)
    # the engine's kernel choices (same outputs): the indexer's decode select after the score pass (fine |
    # auto | chunked | row | split | bits | bsearch | sync | cuda; auto: row up to 8192 keys, decode_long beyond), its score pass's key step
    # (0: the select's own; defaults: decode_select.ENGINE_SELECT) and the fused q/k/v weight's zero-row padding
    decode_select: str = ENGINE_SELECT.impl
    decode_long: str = ENGINE_SELECT.long
    score_block: int = ENGINE_SELECT.score_block
    # batches of at least this many rows take the one-launch sync select instead (0: never; DecodeSelect.sync_min_batch)
    sync_min_batch: int = ENGINE_SELECT.sync_min_batch
    qkv_pad: int = 64
    # programmatic dependent launch of the decode step's Triton kernels (ModelRunner.pdl: 0 / 1 / 2, False / True;
    # None: the engine's default; off wherever the GPU / Triton cannot)
    pdl: int | None = None
    # the sparse layers' select + attention in this many row groups, each on its own CUDA stream (ModelRunner)
    select_streams: int = 1

    def runner_options(self) -> dict:
        """`RolloutEngine(runner_options=...)` of these choices (raises ValueError for an unknown select)."""
        from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

        return {"decode_select": DecodeSelect(self.decode_select, long=self.decode_long, score_block=self.score_block,
                                              sync_min_batch=self.sync_min_batch),
                "qkv_pad": self.qkv_pad, "pdl": self.pdl, "select_streams": self.select_streams}


@dataclass
class RewardConfig:
    fn: str = "math"  # built-in math | synth, or module:function / path/file.py:function
    shaping: str = "none"  # none | overlong | length (added to the verifier reward)
    shaping_coef: float = 1.0
    overlong_cache: int = 32  # overlong: soft buffer (tokens) before rollout.max_new_tokens
    correct_threshold: float = 1.0  # a completion counts as correct when its verifier reward >= this


@dataclass
class LossConfig:
    advantage: str = "grpo"  # grpo (std-normalised) | dr_grpo (no std)
    agg: str = "token_mean"  # token_mean (DAPO) | seq_mean (GRPO) | dr_grpo (constant normaliser)
    policy_loss: str = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher
    dual_clip: float | None = None
    mismatch: str = "none"  # none | tis | mis_token | geo_rs | mis_seq | opsm
    is_cap: float = 2.0  # tis: weights capped at this
    is_lo: float = 0.5  # mis_token / geo_rs / mis_seq: kept ratio range [lo, hi]
    is_hi: float = 2.0
    opsm_delta: float = 0.1  # opsm: mean log(mu/pi) threshold for negative-advantage sequences
    kl_coef: float = 0.0  # KL to the frozen initial policy in the loss; 0 = off
    log_kl_ref: bool = False  # with kl_coef 0: still load the reference (one more model copy) to log kl_ref
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_target: float | None = None  # adaptive coefficient toward this KL (None: fixed)
    kl_horizon: float = 10000.0
    dynamic_sampling: bool = False  # drop groups whose kept rewards are all equal, refill with more prompts
    max_refills: int = 3  # refill rounds per step at most


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    epochs: int = 1  # optimizer steps per rollout batch (1: on-policy, old log-probs = current ones detached)
    micro_batch: int = 8  # sequences per forward/backward (gradient accumulation)


@dataclass
class DistillConfig:
    """LoRA settings are spelled as in indexer training (`lora_r`, `lora_alpha`, `lora_targets`); the
    old `rank` / `alpha` / `target_modules` still load (run dirs written before), with a warning."""

    RENAMED: ClassVar[dict[str, str]] = {"rank": "lora_r", "alpha": "lora_alpha", "target_modules": "lora_targets"}
    loss: str = "k3"  # k3 | k2 (sampled-token reverse KL) | full (full-vocabulary reverse KL)
    lora_r: int = 16
    lora_alpha: float = 32.0
    dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    lr: float = 1e-4
    steps: int = 1  # adapter updates per GRPO step on the step's rollout tokens
    micro_batch: int = 8
    measure_after: bool = True  # one more sparse forward to log the distill loss after the update
    chunk_size: int = 512  # positions per chunk in the full-vocabulary KL


@dataclass
class EvalConfig:
    tasks: str | None = None  # held-out tasks JSONL; None = no eval
    every: int = 0  # eval after every N steps (and after the last); 0 = only after the last
    greedy: bool = True  # temperature 0; else rollout.temperature/top_p
    samples: int = 1  # completions per task when sampling
    max_new_tokens: int | None = None  # default rollout.max_new_tokens
    limit: int = 0  # first N tasks only; 0 = all
    attention: str = "rollout"  # rollout (the rollout policy mu) | dense (pi_theta)


@dataclass
class CheckpointConfig:
    every: int = 10  # save checkpoints/step-N every N steps (and after the last)
    keep: int = 2  # newest checkpoints kept; 0 = keep all


@dataclass
class GRPOConfig:
    model: str = ""  # model dir (dense, or sparse from `sparse-rl convert` for the sparse modes)
    out: str = ""  # run dir
    steps: int = 100
    seed: int = 0
    device: str = "auto"
    # auto: bf16 on CUDA, fp32 on CPU. Weights are updated in their own dtype (no fp32 master copy):
    # with bf16, updates far below 1e-3 of a weight round away; use float32 for tiny learning rates
    dtype: str = "auto"
    plot_every: int = 10  # redraw curves.png every N steps (and at the end)
    # multi-process layout (torchrun / accelerate launch): ddp = whole policy on every process, gradients
    # summed by all-reduce; fsdp = theta sharded with FSDP2 (LoRA phi replicated), see grpo/parallel.py
    parallel: str = "ddp"
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        validate(self)

    @property
    def sparse_rollout(self) -> bool:
        return self.rollout.mode != "dense"

    @property
    def distill_on(self) -> bool:
        return self.rollout.mode == "sparse+distill"


def _positive(value, key: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(c: GRPOConfig) -> None:
    """Range and name checks; a UsageError names the key. Runs on construction (`load_config`)."""
    from sparse_rl.rl.algos import ADVANTAGES, DISTILL_LOSSES, KL_ESTIMATORS, LOSS_AGG, MISMATCH, POLICY_LOSSES, lookup
    from sparse_rl.rl.rewards import SHAPING

    r, lo, o, d = c.rollout, c.loss, c.optim, c.distill
    from sparse_rl.rl.grpo.parallel import PARALLEL

    if c.parallel not in PARALLEL:
        raise UsageError(f"parallel: {c.parallel!r} is not one of {', '.join(PARALLEL)}")
    if r.mode not in MODES:
        raise UsageError(f"rollout.mode: {r.mode!r} is not one of {', '.join(MODES)}")
    _positive(c.steps, "steps")
    _positive(c.data.prompts_per_step, "data.prompts_per_step")
    _positive(r.keep, "rollout.keep")
    _positive(r.qkv_pad, "rollout.qkv_pad")
    _positive(r.select_streams, "rollout.select_streams")
    _positive(r.score_block, "rollout.score_block", allow_zero=True)
    if r.pdl not in (None, 0, 1, 2):
        raise UsageError(f"rollout.pdl {r.pdl!r}: expected 0, 1, 2 (false / true) or null (the engine's default)")
    try:
        r.runner_options()
    except ValueError as e:
        raise UsageError(f"rollout.decode_select / decode_long / score_block / sync_min_batch: {e}") from None
    if r.samples < r.keep:
        raise UsageError(f"rollout.samples ({r.samples}) must be >= rollout.keep ({r.keep}): samples are drawn, the best keep kept")
    if r.keep < 2:
        raise UsageError("rollout.keep must be >= 2: group-relative advantages need at least two completions a prompt")
    _positive(r.max_new_tokens, "rollout.max_new_tokens")
    _positive(r.temperature, "rollout.temperature")  # 0 (greedy) would make the m samples identical
    _positive(r.max_batch, "rollout.max_batch")
    lookup(ADVANTAGES, lo.advantage, "loss.advantage")
    lookup(LOSS_AGG, lo.agg, "loss.agg")
    lookup(POLICY_LOSSES, lo.policy_loss, "loss.policy_loss")
    lookup(MISMATCH, lo.mismatch, "loss.mismatch")
    lookup(KL_ESTIMATORS, lo.kl_estimator, "loss.kl_estimator")
    lookup(DISTILL_LOSSES, d.loss, "distill.loss")
    if c.reward.shaping != "none":
        lookup(SHAPING, c.reward.shaping, "reward.shaping")
        if c.reward.shaping == "overlong" and not 0 < c.reward.overlong_cache <= r.max_new_tokens:
            raise UsageError(f"reward.overlong_cache: must be in 1..rollout.max_new_tokens ({r.max_new_tokens}), "
                             f"got {c.reward.overlong_cache}")
    _positive(lo.kl_coef, "loss.kl_coef", allow_zero=True)
    if lo.kl_target is not None and lo.kl_coef <= 0:
        raise UsageError("loss.kl_target: the adaptive KL coefficient needs loss.kl_coef > 0 to start from")
    _positive(lo.max_refills, "loss.max_refills", allow_zero=True)
    _positive(o.lr, "optim.lr", allow_zero=True)
    _positive(o.epochs, "optim.epochs")
    _positive(o.micro_batch, "optim.micro_batch")
    _positive(o.grad_clip, "optim.grad_clip", allow_zero=True)
    if len(o.betas) != 2:
        raise UsageError(f"optim.betas: expected two numbers, got {o.betas}")
    _positive(d.lora_r, "distill.lora_r")
    _positive(d.lora_alpha, "distill.lora_alpha")
    _positive(d.lr, "distill.lr", allow_zero=True)
    _positive(d.steps, "distill.steps")
    _positive(d.micro_batch, "distill.micro_batch")
    if not d.lora_targets:
        raise UsageError("distill.lora_targets: name at least one module (e.g. q_proj)")
    if c.eval.attention not in ("rollout", "dense"):
        raise UsageError(f"eval.attention: {c.eval.attention!r} is not one of rollout, dense")
    _positive(c.eval.every, "eval.every", allow_zero=True)
    _positive(c.eval.samples, "eval.samples")
    _positive(c.checkpoint.every, "checkpoint.every")
    _positive(c.checkpoint.keep, "checkpoint.keep", allow_zero=True)
    _positive(c.plot_every, "plot_every")
