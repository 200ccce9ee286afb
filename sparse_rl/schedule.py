"""The trainers' learning-rate schedule (indexer training and SFT): linear warm-up, then cosine decay to
`min_lr_ratio` x the peak, transformers' `get_cosine_with_min_lr_schedule_with_warmup`, used as it is (HF Trainer's, TRL's and
torchtune's shape): step s of a warm-up of w steps runs at s / w of the peak (so step 0 of a warm-up
runs at 0), step w at the peak, and the cosine reaches the floor one step after the last of `total`.
Its `_lr_rate` sibling was not taken: without a warm-up it never runs at the peak, and a 1-step run
would run at the floor. The scheduler is a `LambdaLR`, so its state saves and resumes with the
optimizer's (`sparse.train.checkpoint`)."""

from __future__ import annotations

import torch


def lr_schedule(opt: torch.optim.Optimizer, warmup: int, total: int, min_lr_ratio: float):
    """Every parameter group of `opt` follows the same multiplier of its own initial lr."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup as cosine

    return cosine(opt, warmup, max(1, total), min_lr_rate=min_lr_ratio)
