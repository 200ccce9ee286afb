"""sparse-rl: LLM post-training with trainable sparse attention and sparse-rollout GRPO."""

__version__ = "0.1.0"
