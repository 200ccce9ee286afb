"""The trainer's view of the rollout engine: a small Protocol, and the in-process implementation.

`RolloutBackend` is all the trainer calls, so an external rollout server (vLLM, SGLang) can plug in
by implementing these two methods: `generate` returns one `Completion` per sample with the
sampling distribution's per-token log-probs (mu's, needed for the mismatch correction and
metrics), and `sync_weights` makes the server's weights equal to the trainer's current theta (+ phi
merged) after each update. No such client is built here.

`InProcessRollout` wraps `sparse_rl.rl.rollout.RolloutEngine`, which runs the trainer's own model
modules: optimizer steps update the weights in place, so `sync_weights` has nothing to copy.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from sparse_rl.rl.rollout import Completion, RolloutEngine, SamplingParams


@runtime_checkable
class RolloutBackend(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, attention: str) -> list[Completion]:
        """`params.samples` samples per prompt (token ids), ordered (prompt, sample). attention: "dense" = pi_theta
        (no adapter), "sparse" = mu (sparse attention with the LoRA adapter if the policy has one)."""
        ...

    def sync_weights(self, model) -> None:
        """Called after every update of theta/phi (and after a resume loaded weights)."""
        ...


class InProcessRollout:
    """`RolloutBackend` over a `RolloutEngine` sharing the trainer's model object."""

    def __init__(self, model, tokenizer, max_batch: int, compile: bool | None = None, runner_options=None):
        self.model = model
        self.engine = RolloutEngine(model, tokenizer, max_batch=max_batch, compile=compile,
                                    runner_options=runner_options)
        self._dense_graphs_with_adapter = False

    def generate(self, prompts, params, attention):
        from sparse_rl.rl.grpo.distill import has_adapter

        self.engine.set_attention(attention)
        if attention == "dense" and has_adapter(self.model):
            # CUDA graphs record whether the LoRA branch ran; graphs captured under
            # disable_adapter() must not be replayed for mu, so drop them on both sides.
            self.engine.refresh()
            try:
                with self.model.disable_adapter():
                    return self.engine.generate(prompts, params)
            finally:
                self.engine.refresh()
        return self.engine.generate(prompts, params)

    def sync_weights(self, model) -> None:
        # In-place updates are visible to the engine (it runs the same modules, CUDA graphs hold the
        # parameters' addresses); nothing to copy.
        return None
