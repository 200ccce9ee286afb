"""Rollout engine: batched KV-cache sampling, dense or sparse, with per-token log-probs.

    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams
    eng = RolloutEngine(model, tokenizer, max_batch=64, max_seq_len=4096)   # model: loader.load_model(...)
    eng.set_attention("sparse")                                             # or "dense"
    outs = eng.generate(prompt_token_lists_or_strings,
                        SamplingParams(samples=8, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024,
                                       stop=[], seed=step, logprobs=True))
    for c in outs:  # ordered by (prompt_index, sample_index)
        c.tokens, c.logprobs, c.text, c.finish_reason, c.prompt_index, c.sample_index, c.prompt_tokens

- `c.logprobs[i]` is mu: the log-prob of `c.tokens[i]` under the distribution it was sampled from
  (logits / temperature, then top-k, then top-p, renormalised; raw log-softmax when temperature = 0).
- Seeds: the draw for (seed, prompt_index * n + sample_index, step) is fixed, so results do not depend
  on batch size or scheduling (up to floating-point differences of the logits).
- Weights: the engine runs the model's own modules; in-place updates are live. To run a separate
  rollout copy: `eng.load_state_dict(trainer_state)` then `eng.load_lora(peft_model)` (merges
  W + B @ A * scaling into the copy) each step; `eng.refresh()` if parameters were replaced by new tensors.
- Other stages: `make_generate_fn(model_dir, attention)` -> greedy `fn(prompts, max_new_tokens) -> texts`
  (eval niah); `generate_texts(model_dir, prompts, ...)`; `load_engine(model_dir, ...)`.
"""

from sparse_rl.rl.rollout.engine import (Completion, RolloutEngine, encode_prompt, generate_texts, load_engine,
                                         make_generate_fn, render_prompt)
from sparse_rl.rl.rollout.sampler import SamplingParams, process_logits

__all__ = ["RolloutEngine", "SamplingParams", "Completion", "process_logits", "generate_texts", "make_generate_fn",
           "load_engine", "encode_prompt", "render_prompt"]
