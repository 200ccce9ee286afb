"""LoRA distillation of the sparse rollout policy mu = pi_sparse(theta, phi) onto the dense pi_theta.

Where the adapter lives (design choice): ONE model object holds theta (the base weights) and phi
(peft LoRA layers on the attention projections). The adapter is active only in sparse mode:

- rollouts (engine in sparse mode) and the distillation student run with the adapter enabled;
- every dense pass (pi_theta's log-probs for the policy loss, the distillation teacher, dense
  eval) runs inside peft's `disable_adapter()` context, which bypasses the LoRA branch exactly.

Why not a separate peft-wrapped copy for mu whose base weights are refreshed from theta each step:
that doubles the weight memory and copies every weight every step, and the rollout engine already
runs the model's own modules (peft layers included), so with one object "refresh the engine's
weights" is free: optimizer steps update theta and phi in place and the next rollout sees them.
The copy would only pay off for an out-of-process rollout server, which receives theta (and phi,
merged, via `RolloutEngine.load_lora`) through the rollout interface's `sync_weights` anyway.

The GRPO optimizer holds theta (indexer weights and phi excluded); the distillation optimizer
holds phi alone; during distillation theta is frozen (requires_grad off) so the backward pass
computes no base-weight gradients.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from sparse_rl.errors import UsageError
from sparse_rl.rl.algos import DISTILL_LOSSES, lookup
from sparse_rl.rl.grpo.batch import Batch, forward_logits, logprobs_of
from sparse_rl.sparse.layer import get_attention, set_attention, sparse_config


def attach_adapter(model, cfg):
    """Wrap `model` with a fresh LoRA adapter (B = 0, so mu starts as the plain sparse policy).
    Returns the peft model; theta stays trainable. cfg: DistillConfig."""
    import warnings

    from peft import LoraConfig, get_peft_model

    lc = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.dropout,
                    target_modules=list(cfg.lora_targets), bias="none")
    try:
        with warnings.catch_warnings():
            # peft probes a deprecated transformers property while wrapping; not ours to fix
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            pm = get_peft_model(model, lc)
    except ValueError as e:
        raise UsageError(f"distill.lora_targets {list(cfg.lora_targets)}: {' '.join(str(e).split())[:200]}") from None
    for p in theta_params(pm):
        p.requires_grad_(True)
    return pm


def has_adapter(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def theta_params(model) -> list[torch.nn.Parameter]:
    """The policy's trainable weights: everything but the indexers (trained by `indexer train`, frozen
    here) and the LoRA adapter."""
    return [p for n, p in model.named_parameters() if "lora_" not in n and ".indexer." not in n]


def lora_params(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "lora_" in n]


def _has_selector(model) -> bool:
    return sparse_config(model) is not None


@contextlib.contextmanager
def policy_mode(model, mode: str):
    """Run the block as pi_theta ("dense": dense attention, adapter bypassed) or as mu ("sparse":
    sparse attention, adapter on). The model's previous attention mode is restored afterwards."""
    sel = _has_selector(model)
    prev = get_attention(model) if sel else "dense"
    if mode == "sparse" or sel:
        set_attention(model, mode)
    try:
        if mode == "dense" and has_adapter(model):
            with model.disable_adapter():
                yield
        else:
            yield
    finally:
        if sel:
            set_attention(model, prev)


@contextlib.contextmanager
def frozen(params: list[torch.nn.Parameter]):
    """requires_grad off for `params` inside the block (theta during distillation)."""
    before = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, r in zip(params, before):
            p.requires_grad_(r)


def distill(model, batch: Batch, optimizer: torch.optim.Optimizer, cfg, *, temperature: float, global_tokens: float,
            reduce_grads: Callable[[list[torch.nn.Parameter]], None], grad_clip: float = 0.0,
            all_sum: Callable[[float], float] = lambda x: x) -> dict:
    """Train phi for `cfg.steps` updates so that mu (sparse + adapter) matches pi_theta (dense) on `batch`'s
    rollout tokens; theta is frozen. cfg: DistillConfig (loss k3 | k2 | full, micro_batch, ...).

    The loss is the global token mean over all processes: each micro-batch's masked mean is weighted
    by its token count / `global_tokens`, and `reduce_grads` sums phi's gradients across processes.
    Returns floats: distill_loss_before / distill_kl_before (at the first update), distill_loss_after /
    distill_kl_after (one more no-grad sparse forward after the last update, if cfg.measure_after),
    distill_grad_norm, time_distill_measure (seconds spent on the "after" forward).
    """
    loss_fn = lookup(DISTILL_LOSSES, cfg.loss, "distill.loss")
    full = bool(loss_fn.needs_logits)
    phi = lora_params(model)
    mbs = [batch.slice(i, i + cfg.micro_batch) for i in range(0, len(batch), cfg.micro_batch)]
    # teacher: pi_theta after this step's update, dense, no adapter; the same for every distill step
    teachers = []
    with torch.no_grad(), policy_mode(model, "dense"):
        for mb in mbs:
            logits = forward_logits(model, mb, temperature)
            teachers.append(logits if full else logprobs_of(logits, mb))

    def student_loss(mb, teacher):
        logits = forward_logits(model, mb, temperature)
        student = logits if full else logprobs_of(logits, mb)
        return loss_fn(student, teacher, mb.response(mb.mask), chunk_size=cfg.chunk_size)

    def weighted_pass(backward: bool) -> tuple[float, float]:
        """Loss and KL summed over micro-batches, each weighted by its share of the global tokens."""
        loss_sum, kl_sum = 0.0, 0.0
        for mb, teacher in zip(mbs, teachers):
            w = mb.num_tokens() / max(global_tokens, 1.0)
            if w == 0:
                continue
            loss, stats = student_loss(mb, teacher)
            if backward:
                (loss * w).backward()
            loss_sum += float(loss.detach()) * w
            kl_sum += float(stats["kl"]) * w
        return loss_sum, kl_sum

    out: dict = {}
    with frozen(theta_params(model)), policy_mode(model, "sparse"):
        for s in range(cfg.steps):
            optimizer.zero_grad(set_to_none=True)
            loss_sum, kl_sum = weighted_pass(backward=True)
            reduce_grads(phi)
            gn = torch.nn.utils.clip_grad_norm_(phi, grad_clip if grad_clip > 0 else float("inf"))
            if s == 0:
                out["distill_loss_before"] = all_sum(loss_sum)
                out["distill_kl_before"] = all_sum(kl_sum)
            out["distill_grad_norm"] = float(gn)
            if torch.isfinite(gn):  # a non-finite adapter gradient skips the update rather than poisoning phi
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if cfg.measure_after:
            dev = batch.input_ids.device
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            with torch.no_grad():
                loss_sum, kl_sum = weighted_pass(backward=False)
            out["distill_loss_after"] = all_sum(loss_sum)
            out["distill_kl_after"] = all_sum(kl_sum)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            # the "after" measurement is logging, not training: reported apart so the overhead of
            # distillation proper is time_distill - time_distill_measure
            out["time_distill_measure"] = time.perf_counter() - t0
    return out
