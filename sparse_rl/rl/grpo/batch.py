"""Training batches from rollouts, and the log-prob forward pass shared by the policy update and distillation.

A batch holds B kept completions as right-padded full sequences (prompt + completion):

    input_ids [B, L], attention_mask [B, L]
    mask      [B, L-1]  1 where position t predicts a completion token (tokens[:, t+1])
    logp_mu   [B, L-1]  the rollout policy's log-probs of those tokens (0 elsewhere)
    advantages [B]

Right padding keeps causal attention exact for the real tokens (a real token never sees the
padding behind it), in dense and sparse mode alike. Only positions from the shortest prompt on get
logits (`logits_to_keep`), so prompt positions cost no vocabulary projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_rl.rl.algos import token_logprobs


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, L-1] float
    logp_mu: torch.Tensor  # [B, L-1] float32
    advantages: torch.Tensor  # [B] float32
    start: int  # first shifted position that can hold a completion token (min prompt length - 1)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, i: int, j: int) -> "Batch":
        return Batch(self.input_ids[i:j], self.attention_mask[i:j], self.mask[i:j], self.logp_mu[i:j],
                     self.advantages[i:j], self.start)

    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def response(self, x: torch.Tensor) -> torch.Tensor:
        """The `[B, L-1]` tensor restricted to the response window `[B, L-1-start]`."""
        return x[:, self.start:]


def make_batch(prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
               advantages: list[float], pad_id: int, device) -> Batch:
    """prompts[i] + completions[i] right-padded with `pad_id`; logprobs[i] aligned with completions[i]."""
    B = len(prompts)
    L = max((len(p) + len(c) for p, c in zip(prompts, completions)), default=2)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L - 1)
    lmu = torch.zeros(B, L - 1)
    for b, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        n = len(p) + len(c)
        ids[b, :n] = torch.tensor(p + c)
        attn[b, :n] = 1
        s = len(p) - 1
        mask[b, s:s + len(c)] = 1
        lmu[b, s:s + len(c)] = torch.tensor(lp, dtype=torch.float32)
    start = max(min((len(p) for p in prompts), default=1) - 1, 0)
    return Batch(ids.to(device), attn.to(device), mask.to(device), lmu.to(device),
                 torch.tensor(advantages, dtype=torch.float32, device=device), start)


def forward_logits(model, batch: Batch, temperature: float) -> torch.Tensor:
    """Temperature-scaled logits over the response window: `[B, L-1-start, V]` (position t predicts token t+1)."""
    L = batch.input_ids.shape[1]
    keep = L - batch.start  # last `keep` positions: start .. L-1; the very last one predicts nothing
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep, use_cache=False)
    logits = out.logits[:, :-1]
    return logits / temperature if temperature != 1.0 else logits


def window_tokens(batch: Batch) -> torch.Tensor:
    """The predicted tokens over the response window `[B, L-1-start]`."""
    return batch.input_ids[:, batch.start + 1:]


def logprobs_of(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """log-probs of the sampled tokens over the response window `[B, L-1-start]` float32 (differentiable)."""
    return token_logprobs(logits, window_tokens(batch))
