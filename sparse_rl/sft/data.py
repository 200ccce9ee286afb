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

import bisect
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


def _render(tokenizer, msgs: list[dict], **kw) -> str:
    return tokenizer.apply_chat_template(msgs, tokenize=False, **kw)


def _tokenize(tokenizer, text: str) -> list[int]:
    # as apply_chat_template(tokenize=True) does: the template writes the special tokens itself
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _needed_texts(tokenizer, msgs: list[dict]) -> list[str]:
    """The renderings `encode_messages` tokenizes: every prefix, and the generation-prompt head of
    every assistant turn (so a file's texts can be tokenized in one batched call)."""
    out = []
    for i, m in enumerate(msgs):
        out.append(_render(tokenizer, msgs[: i + 1]))
        if m["role"] == "assistant":
            out.append(_render(tokenizer, msgs[:i], add_generation_prompt=True))
    return out


def encode_messages(tokenizer, msgs: list[dict], where: str, ids_of=None, texts: list[str] | None = None) -> Document:
    """Token ids of a conversation and the mask of its assistant tokens. `ids_of(text)` tokenizes a
    rendering (default: the tokenizer, one text at a time; `read_documents` passes a batched table),
    `texts` are the renderings already made (`_needed_texts`' order), else they are rendered here."""
    if not getattr(tokenizer, "chat_template", None):
        raise SparseRLError(f"{where}: 'messages' needs a chat template, and the model's tokenizer has none")
    ids_of = ids_of or (lambda text: _tokenize(tokenizer, text))
    rendered = iter(texts if texts is not None else _needed_texts(tokenizer, msgs))
    ids: list[int] = []
    mask: list[bool] = []
    for m in msgs:
        full = ids_of(next(rendered))
        if m["role"] == "assistant":
            head = ids_of(next(rendered))
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


def encode_record(rec: dict, tokenizer, where: str, ids_of=None, texts: list[str] | None = None) -> Document:
    ids_of = ids_of or (lambda text: _tokenize(tokenizer, text))
    msgs = _messages_of(rec, where)
    if msgs is not None:
        return encode_messages(tokenizer, msgs, where, ids_of, texts)
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise SparseRLError(f"{where}: field 'text' must be a string")
        ids = ids_of(rec["text"])
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]  # the model learns where a document ends
        return Document(ids, [True] * len(ids))
    raise SparseRLError(f"{where}: needs 'messages', 'prompt' + 'completion' (or 'solution'), or 'text'")


def read_documents(path: str | Path, tokenizer, loss_on: str = "assistant") -> list[Document]:
    """Every record of a JSONL file, encoded; an unreadable or malformed record names its line.
    loss_on "all" makes every token a target (pre-training on the rendered conversations).

    Two passes: the records are read and their chat renderings collected, then every distinct
    text is tokenized in batched calls (a fast tokenizer runs them in parallel; one call per text
    was ~2 ms a record, most of a 20K-record file's load time)."""
    from sparse_rl.io import iter_jsonl

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--data {p}: no such file")
    recs: list[tuple[dict, str, list[dict] | None, list[str] | None]] = []
    texts: dict[str, None] = {}

    def collect(rec: dict, name: str, lineno: int) -> dict:
        where = f"{name} line {lineno}"
        msgs = _messages_of(rec, where)  # parsed once, kept for the second pass
        mine = None
        if msgs is not None and getattr(tokenizer, "chat_template", None):
            mine = _needed_texts(tokenizer, msgs)  # rendered once, kept for the second pass
            texts.update(dict.fromkeys(mine))
        elif msgs is None and isinstance(rec.get("text"), str):
            texts[rec["text"]] = None
        recs.append((rec, where, msgs, mine))
        return rec

    for _ in iter_jsonl(p, check=collect, flag="--data"):
        pass
    if not recs:
        raise SparseRLError(f"--data {p}: no records")
    table = _tokenize_all(tokenizer, list(texts))
    docs = []
    for rec, where, msgs, mine in recs:
        doc = (encode_messages(tokenizer, msgs, where, table.__getitem__, mine) if msgs is not None
               else encode_record(rec, tokenizer, where, table.__getitem__))
        docs.append(Document(doc.ids, [True] * len(doc.ids)) if loss_on == "all" else doc)
    return docs


def _tokenize_all(tokenizer, texts: list[str], chunk: int = 2048) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in range(0, len(texts), chunk):
        part = texts[i:i + chunk]
        out.update(zip(part, (list(x) for x in tokenizer(part, add_special_tokens=False)["input_ids"])))
    return out


def pack(docs: list[Document], seq_len: int, pad_id: int) -> tuple[dict[str, torch.Tensor], int]:
    """Best-fit-decreasing packing of whole documents into rows of `seq_len`.

    Returns ({"input_ids", "labels", "position_ids"}, each `[N, seq_len]` long) and the number of
    documents dropped for being longer than `seq_len`. Labels are the input ids where the mask is
    set, -100 elsewhere (the shift to next-token targets happens in the loss)."""
    fit = [d for d in docs if len(d.ids) <= seq_len]
    order = sorted(range(len(fit)), key=lambda i: (-len(fit[i].ids), i))
    bins: list[list[int]] = []
    by_free: list[tuple[int, int]] = []  # (free tokens, bin) sorted: the best fit is one bisect away
    for i in order:
        n = len(fit[i].ids)
        at = bisect.bisect_left(by_free, (n, -1))  # the fullest bin that still fits; the oldest on ties
        if at == len(by_free):
            bins.append([i])
            bisect.insort(by_free, (seq_len - n, len(bins) - 1))
        else:
            free, j = by_free.pop(at)
            bins[j].append(i)
            bisect.insort(by_free, (free - n, j))
    rows_ids, rows_lab, rows_pos = [], [], []  # plain lists, one tensor each at the end
    for members in bins:
        ids_r: list[int] = []
        lab_r: list[int] = []
        pos_r: list[int] = []
        for i in members:
            d = fit[i]
            ids_r += d.ids
            lab_r += [t if m else IGNORE for t, m in zip(d.ids, d.mask)]
            pos_r += range(len(d.ids))
        tail = seq_len - len(ids_r)
        rows_ids.append(ids_r + [pad_id] * tail)
        rows_lab.append(lab_r + [IGNORE] * tail)
        rows_pos.append(pos_r + list(range(tail)))  # the padding is a document of its own
    ids, labels, pos = (torch.tensor(x, dtype=torch.long).reshape(len(bins), seq_len)
                        for x in (rows_ids, rows_lab, rows_pos))
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
