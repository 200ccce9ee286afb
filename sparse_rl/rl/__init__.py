"""RL side: rollout engine, GRPO losses/advantages as pure functions, distillation, oversampling, trainer."""
