"""SFT data: records -> token ids with a loss mask -> packed rows with per-document position ids.

Record formats (one JSON object per line; the first field present wins):
  * `messages`: chat turns rendered with the tokenizer's chat template; the loss is on the
    assistant turns only (their content and the end-of-turn token, not the role header);
  * `prompt` + `completion` (strings): the prompt as a user turn, the completion as the assistant
    turn (a synth task with a worked `solution` is read the same way: `prompt` + `solution`, or
    `messages` ending in a user turn + `solution`, which becomes the assistant turn);
  * `text`: plain language modelling, loss on every token (this is how the recipe pre-trains).

Assistant spans are found by rendering prefixes: the tokens of turn i are the difference between
the conversation rendered up to turn i and up to turn i-1 with the generation prompt. This works
with any template whose rendering of a prefix is a prefix of the whole (ChatML, Llama 3, Qwen);
a template that is not gets a one-line error naming the record. TRL's `assistant_only_loss` uses the
template's `{% generation %}` markers instead, which most stock templates lack.

Packing (as TRL's `packing_strategy="bfd"` with `padding_free`): whole documents go into rows of
`seq_len` tokens by best-fit decreasing, each document's position ids restart at 0, and no attention
mask is passed, so transformers' masking (`find_packed_sequence_indices`) builds a block-diagonal
causal mask: no token attends across documents. A row's unused tail is padding with label -100 and
its own position ids. Unlike TRL, which truncates documents longer than `seq_len`, we drop them and
count them (a truncated SFT example loses its answer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError, UsageError

IGNORE = -100


@dataclass
class Document:
    ids: list[int]
    mask: list[bool]  # True where the token is a training target


def _chat(tokenizer, msgs: list[dict], **kw) -> list[int]:
    out = tokenizer.apply_chat_template(msgs, tokenize=True, **kw)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def encode_messages(tokenizer, msgs: list[dict], where: str) -> Document:
    """Token ids of a conversation and the mask of its assistant tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise SparseRLError(f"{where}: 'messages' needs a chat template, and the model's tokenizer has none")
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(msgs):
        full = _chat(tokenizer, msgs[: i + 1])
        if m["role"] == "assistant":
            head = _chat(tokenizer, msgs[:i], add_generation_prompt=True) if i else _chat(
                tokenizer, [], add_generation_prompt=True)
            if full[: len(head)] != head or head[: len(ids)] != ids:
                raise SparseRLError(f"{where}: the chat template does not render a conversation's prefix as its "
                                    "prefix; cannot find the assistant tokens")
            span = full[len(head):]
            n_target = _through_eos(span, tokenizer.eos_token_id)
            ids, mask = full, mask + [False] * (len(head) - len(ids)) + [True] * n_target + [False] * (
                len(span) - n_target)
        else:
            if full[: len(ids)] != ids:
                raise SparseRLError(f"{where}: the chat template does not render a conversation's prefix as its "
                                    "prefix; cannot find the assistant tokens")
            mask += [False] * (len(full) - len(ids))
            ids = full
    return Document(ids, mask)


def _through_eos(span: list[int], eos: int | None) -> int:
    """How many tokens of an assistant turn are targets: through its end-of-turn token (the template's
    trailing newline after it is not), or all of them when the turn has none."""
    if eos is not None and eos in span:
        return len(span) - span[::-1].index(eos)
    return len(span)


def _messages_of(rec: dict, where: str) -> list[dict] | None:
    target = "completion" if "completion" in rec else "solution" if "solution" in rec else None
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
            raise SparseRLError(f"{where}: field 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        if msgs[-1]["role"] != "assistant" and isinstance(rec.get(target), str):
            msgs = msgs + [{"role": "assistant", "content": rec[target]}]  # a chat task with its worked solution
        if not any(m["role"] == "assistant" for m in msgs):
            raise SparseRLError(f"{where}: 'messages' has no assistant turn (nothing to train on)")
        return msgs
    if "prompt" in rec and target:
        if not isinstance(rec["prompt"], str) or not isinstance(rec[target], str):
            raise SparseRLError(f"{where}: 'prompt' and '{target}' must be strings")
        return [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec[target]}]
    return None


def encode_record(rec: dict, tokenizer, where: str) -> Document:
    msgs = _messages_of(rec, where)
    if msgs is not None:
        return encode_messages(tokenizer, msgs, where)
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise SparseRLError(f"{where}: field 'text' must be a string")
        ids = tokenizer(rec["text"], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]  # the model learns where a document ends
        return Document(ids, [True] * len(ids))
    raise SparseRLError(f"{where}: needs 'messages', 'prompt' + 'completion' (or 'solution'), or 'text'")


def read_documents(path: str | Path, tokenizer, loss_on: str = "assistant") -> list[Document]:
    """Every record of a JSONL file, encoded; an unreadable or malformed record names its line.
    loss_on "all" makes every token a target (pre-training on the rendered conversations)."""
    from sparse_rl.io import iter_jsonl

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--data {p}: no such file")
    docs: list[Document] = []

    def check(rec: dict, name: str, lineno: int) -> dict:
        doc = encode_record(rec, tokenizer, f"{name} line {lineno}")
        docs.append(Document(doc.ids, [True] * len(doc.ids)) if loss_on == "all" else doc)
        return rec

    for _ in iter_jsonl(p, check=check, flag="--data"):
        pass
    if not docs:
        raise SparseRLError(f"--data {p}: no records")
    return docs


def pack(docs: list[Document], seq_len: int, pad_id: int) -> tuple[dict[str, torch.Tensor], int]:
    """Best-fit-decreasing packing of whole documents into rows of `seq_len`.

    Returns ({"input_ids", "labels", "position_ids"}, each `[N, seq_len]` long) and the number of
    documents dropped for being longer than `seq_len`. Labels are the input ids where the mask is
    set, -100 elsewhere (the shift to next-token targets happens in the loss)."""
    fit = [d for d in docs if len(d.ids) <= seq_len]
    order = sorted(range(len(fit)), key=lambda i: (-len(fit[i].ids), i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = len(fit[i].ids)
        best = min((j for j in range(len(bins)) if free[j] >= n), key=lambda j: free[j], default=None)
        if best is None:
            bins.append([i])
            free.append(seq_len - n)
        else:
            bins[best].append(i)
            free[best] -= n
    ids = torch.full((len(bins), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(bins), seq_len), IGNORE, dtype=torch.long)
    pos = torch.zeros((len(bins), seq_len), dtype=torch.long)
    for r, members in enumerate(bins):
        off = 0
        for i in members:
            d, n = fit[i], len(fit[i].ids)
            ids[r, off:off + n] = torch.tensor(d.ids)
            labels[r, off:off + n] = torch.where(torch.tensor(d.mask), torch.tensor(d.ids), IGNORE)
            pos[r, off:off + n] = torch.arange(n)
            off += n
        pos[r, off:] = torch.arange(seq_len - off)  # the padding is a document of its own
    return {"input_ids": ids, "labels": labels, "position_ids": pos}, len(docs) - len(fit)


class Rows:
    """Packed rows served by a global cursor: a fresh permutation per epoch from the seed, so the rows
    at cursor g depend only on (seed, g) and a saved cursor resumes exactly on any number of processes."""

    def __init__(self, tensors: dict[str, torch.Tensor], seed: int):
        self.t = tensors
        self.n = tensors["input_ids"].shape[0]
        self.seed = seed
        self._perm: dict[int, list[int]] = {}

    def _index(self, g: int) -> int:
        epoch, i = divmod(g, self.n)
        if epoch not in self._perm:
            perm = list(range(self.n))
            random.Random(f"{self.seed}:{epoch}").shuffle(perm)
            self._perm = {epoch: perm}
        return self._perm[epoch][i]

    def batch(self, cursor: int, count: int) -> dict[str, torch.Tensor]:
        idx = torch.tensor([self._index(cursor + k) for k in range(count)])
        return {k: v[idx] for k, v in self.t.items()}
