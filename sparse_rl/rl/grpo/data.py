"""Tasks for GRPO: loading with line-numbered checks, prompt encoding, and the seeded data cursor.

A task is `{"id", "prompt" | "messages", "answer"?, "task", ...}` (docs/DESIGN.md). The cursor walks a
per-epoch permutation of the tasks; its whole state is (epoch, position), so a checkpoint resumes
the exact prompt order. With several processes every step takes `k * world` prompts from one shared
stream and each rank keeps its own slice, so the union over ranks is what a single process sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_rl.errors import SparseRLError
from sparse_rl.io import iter_jsonl

# Rewards that compare against a gold answer (the synth verifier only for non-tool, non-rg tasks).
_NEEDS_ANSWER = {"math"}


def _needs_answer(reward: str, task: dict) -> bool:
    if reward in _NEEDS_ANSWER:
        return True
    if reward == "synth":
        kind = str(task.get("task", ""))
        return not (kind.startswith("tool/") or kind.startswith("rg/"))
    return False


def load_tasks(path: str, reward: str, flag: str = "--tasks") -> list[dict]:
    """Read and check a tasks JSONL. Every record needs an `id` and a `prompt` or `messages`; with the
    built-in math reward (or synth math tasks) an `answer`. Errors name the file and line."""
    if not path:
        raise SparseRLError(f"{flag}: no tasks file given (pass {flag} tasks.jsonl or set data.tasks)")

    def check(rec: dict, name: str, lineno: int) -> dict:
        if _needs_answer(reward, rec) and rec.get("answer") is None:
            raise SparseRLError(f"{name} line {lineno}: task {rec['id']!r} has no 'answer'; the {reward} reward "
                                "compares against it (add one, or use reward.fn module:function)")
        if "messages" in rec and not (isinstance(rec["messages"], list) and rec["messages"]):
            raise SparseRLError(f"{name} line {lineno}: 'messages' must be a non-empty list of chat messages")
        if "messages" not in rec and not isinstance(rec["prompt"], str):
            raise SparseRLError(f"{name} line {lineno}: 'prompt' must be a string")
        return rec

    recs = list(iter_jsonl(path, required=("id",), any_of=("prompt", "messages"), check=check, flag=flag))
    if not recs:
        raise SparseRLError(f"{'<stdin>' if path == '-' else path}: no tasks (the file is empty)")
    return recs


def encode_task(tokenizer, task: dict, chat_template: bool, system_prompt: str | None) -> list[int]:
    """Prompt token ids: `messages` (or a plain `prompt` wrapped as one user message when `chat_template`)
    through the tokenizer's chat template with the generation prompt; otherwise the raw prompt text."""
    from sparse_rl.rl.rollout import encode_prompt

    if "messages" in task:
        msgs = list(task["messages"])
    elif chat_template and getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": task["prompt"]}]
    else:
        return encode_prompt(tokenizer, {"prompt": task["prompt"]})
    if system_prompt and msgs[0].get("role") != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return encode_prompt(tokenizer, {"messages": msgs})


def prompt_text(task: dict) -> str:
    """The prompt as text for completion records (the last user message for chat tasks)."""
    if "messages" in task:
        users = [m.get("content") or "" for m in task["messages"] if m.get("role") == "user"]
        return users[-1] if users else ""
    return task["prompt"]


@dataclass
class DataCursor:
    """Seeded walk over `size` tasks: epoch e visits `randperm(size, seed + e)` (or 0..size-1)."""

    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    pos: int = 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        """The next k task indices (crossing into the next epoch's order when one runs out)."""
        out: list[int] = []
        while len(out) < k:
            order = self._order(self.epoch)
            grab = order[self.pos:self.pos + (k - len(out))]
            out += grab
            self.pos += len(grab)
            if self.pos >= self.size:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def take_shard(self, k: int, rank: int, world: int) -> list[int]:
        """Take k * world indices from the shared stream; return this rank's k."""
        allidx = self.take(k * world)
        return allidx[rank * k:(rank + 1) * k]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if int(state["size"]) != self.size:
            raise SparseRLError(f"the checkpoint's data cursor is for {state['size']} tasks but the tasks file has "
                                f"{self.size}; resume with the same tasks file")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
