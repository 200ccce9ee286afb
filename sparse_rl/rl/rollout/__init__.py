"""Rollout engine: batched KV-cache sampling, dense or sparse, with per-token log-probs."""

from sparse_rl.rl.rollout.engine import (Completion, RolloutEngine, encode_prompt, generate_texts, load_engine,
                                         make_generate_fn)
from sparse_rl.rl.rollout.sampler import SamplingParams, process_logits

__all__ = ["RolloutEngine", "SamplingParams", "Completion", "process_logits", "generate_texts", "make_generate_fn",
           "load_engine", "encode_prompt"]
