"""GRPO with dense or sparse rollouts, mismatch correction, LoRA distillation of the sparse policy and
reward-aware oversampling (`sparse-rl grpo`).

- `config.GRPOConfig`: the stage's one config dataclass (recipes in `recipes/grpo_*.yaml`);
- `trainer.run(cfg, resume=False)`: the loop; `trainer.Trainer` for step-level use;
- `collect`: a step's rollouts (sample, score, oversample, dynamic-sampling refills) as functions;
- `update`: the advantages, the dense forward and the policy update of theta as functions;
- `backend.RolloutBackend`: the Protocol an external rollout server would implement;
- `distill`: the adapter placement (one model, `disable_adapter()` for dense passes) and the phi update;
- `checkpoint`: what a GRPO checkpoint holds (the run dir itself is `sparse_rl.runs`');
- `metrics`: `StepMetrics` (the one list of metric names), metrics.jsonl and curves.png.
"""

from sparse_rl.rl.grpo.config import GRPOConfig

__all__ = ["GRPOConfig"]
