"""GRPO with dense or sparse rollouts, mismatch correction, LoRA distillation of the sparse policy and
reward-aware oversampling (`sparse-rl grpo`).

- `config.GRPOConfig`: the stage's one config dataclass (recipes in `recipes/grpo_*.yaml`);
- `trainer.run(cfg, resume=False)`: the loop; `trainer.Trainer` for step-level use;
- `backend.RolloutBackend`: the Protocol an external rollout server would implement;
- `distill`: the adapter placement (one model, `disable_adapter()` for dense passes) and the phi update;
- `checkpoint`, `metrics`: the run dir's checkpoints, metrics.jsonl and curves.png.
"""

from sparse_rl.rl.grpo.config import GRPOConfig

__all__ = ["GRPOConfig"]
