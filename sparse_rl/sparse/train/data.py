"""Training text for the indexer: read, tokenise, pack into `[N, seq_len]` rows, serve by cursor.

Sources:
  * a JSONL file whose records hold `text` (a string) or `messages` (chat turns, rendered with
    the tokenizer's chat template);
  * a plain `.txt` file (one document);
  * a Hugging Face `datasets` directory written by `save_to_disk` (a `text` or `messages` column;
    the `train` split of a DatasetDict); `datasets` is imported only here, it is optional;
  * `synthetic`: built-in long-context retrieval text. Every row states key-value facts in its first
    half ("The value of qzmfk is 4821.") between filler sentences and asks for them, in another
    order, in its second half ("What is the value of qzmfk? 4821."), so answering needs attention
    thousands of tokens back: what a trained indexer has to find.

Documents are tokenised without special tokens, each followed by EOS, concatenated and cut into
rows of exactly `seq_len` tokens (the tail is dropped); rows are not padded, so no attention mask
is needed. Row order is a fresh permutation per epoch, drawn from the seed: the sample served at
global position g depends only on (seed, g), so a saved cursor resumes exactly, on any number of
processes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from sparse_rl.errors import SparseRLError, UsageError

SYNTHETIC = "synthetic"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _doc_text(rec: dict, where: str, tokenizer) -> str:
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise SparseRLError(f"{where}: field 'text' must be a string")
        return rec["text"]
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise SparseRLError(f"{where}: field 'messages' must be a list of {{'role', 'content'}} objects")
        if not getattr(tokenizer, "chat_template", None):
            raise SparseRLError(f"{where}: 'messages' needs a chat template, and the model's tokenizer has none")
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    raise SparseRLError(f"{where}: needs a 'text' or 'messages' field")


def _load_datasets_dir(path: Path, tokenizer) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise SparseRLError(f"--data {path}: reading a datasets directory needs the optional package "
                            "'datasets' (pip install 'sparse-rl[data]'), or pass a .jsonl/.txt file") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several kinds for a wrong directory
        raise SparseRLError(f"--data {path}: not a datasets directory saved with save_to_disk "
                            f"({str(e).splitlines()[0][:160]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise SparseRLError(f"--data {path}: DatasetDict without a 'train' split (has {', '.join(ds)})")
        ds = ds["train"]
    cols = ds.column_names
    if "text" not in cols and "messages" not in cols:
        raise SparseRLError(f"--data {path}: needs a 'text' or 'messages' column (has {', '.join(cols)})")
    key = "text" if "text" in cols else "messages"
    return [_doc_text({key: v}, f"{path} row {i}", tokenizer) for i, v in enumerate(ds[key])]


def read_documents(source: str | Path, tokenizer) -> list[str]:
    """Documents (strings) of a JSONL file, a .txt file or a datasets directory."""
    from sparse_rl.io import iter_jsonl

    p = Path(source)
    if not p.exists():
        raise UsageError(f"--data {p}: no such file or directory (or pass 'synthetic' for the built-in source)")
    if p.is_dir():
        return _load_datasets_dir(p, tokenizer)
    if p.suffix == ".txt":
        try:
            return [p.read_text(encoding="utf-8")]
        except UnicodeDecodeError as e:
            raise SparseRLError(f"--data {p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if p.suffix in (".jsonl", ".json"):
        return [_doc_text(rec, f"{p} record {i + 1}", tokenizer) for i, rec in enumerate(iter_jsonl(p))]
    raise UsageError(f"--data {p}: expected a .jsonl, a .txt file, a datasets directory or 'synthetic'")


def pack(token_lists: list[list[int]], seq_len: int, eos_id: int | None) -> torch.Tensor:
    """Concatenate documents (each followed by EOS) and cut `[N, seq_len]` rows; the tail is dropped."""
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        if eos_id is not None:
            flat.append(eos_id)
    n = len(flat) // seq_len
    return torch.tensor(flat[:n * seq_len], dtype=torch.long).view(n, seq_len)


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(5))


def synthetic_row(tokenizer, seq_len: int, seed: int) -> list[int]:
    """One `seq_len`-token row of facts (first half) and their recall (second half), from `seed`."""
    from sparse_rl.corpus import sentence

    rng = random.Random(seed)
    ids: list[int] = []

    def extend(pieces: list[str], limit: int) -> int:
        """Append whole pieces while they fit under `limit` tokens; return how many went in."""
        for n, toks in enumerate(tokenizer([" " + s for s in pieces], add_special_tokens=False)["input_ids"]):
            if len(ids) + len(toks) > limit:
                return n
            ids.extend(toks)
        return len(pieces)

    half = seq_len // 2
    facts: list[tuple[str, int]] = []  # only facts that made it into the text
    while True:  # first half: facts between filler sentences
        batch, cand = [], []
        for _ in range(16):
            k, v = _key(rng), rng.randint(1000, 9999)
            cand.append((k, v))
            batch += [f"The value of {k} is {v}.", sentence(rng)]
        n = extend(batch, half)
        facts += cand[: (n + 1) // 2]
        if n < len(batch):
            break
    asked = facts[:]
    rng.shuffle(asked)
    pos = 0
    while asked:  # second half: the same facts asked in another order
        batch = []
        for _ in range(16):
            k, v = asked[pos % len(asked)]
            pos += 1
            batch += [sentence(rng), f"What is the value of {k}? {v}."]
        if extend(batch, seq_len) < len(batch):
            break
    filler = tokenizer(" " + sentence(rng), add_special_tokens=False)["input_ids"] or [0]
    while len(ids) < seq_len:  # top up the last few tokens
        ids.extend(filler[: seq_len - len(ids)])
    return ids


def synthetic_rows(tokenizer, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """`[n, seq_len]` synthetic retrieval rows; row i depends only on (seed, i, seq_len)."""
    rows = [synthetic_row(tokenizer, seq_len, seed * 1_000_003 + i) for i in range(n)]
    return torch.tensor(rows, dtype=torch.long)


@dataclass
class PackedData:
    """Token rows `[N, seq_len]` served by global sample position (see module docstring)."""

    tokens: torch.Tensor
    seed: int = 0

    def __post_init__(self):
        self._perm_epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self), generator=g), epoch
        return self._perm

    def rows(self, start: int, n: int) -> torch.Tensor:
        """Samples at global positions start..start+n-1 -> `[n, seq_len]` int64."""
        out = []
        for g in range(start, start + n):
            epoch, i = divmod(g, len(self))
            out.append(self.tokens[self._order(epoch)[i]])
        return torch.stack(out)


def build_data(source: str, tokenizer, seq_len: int, seed: int = 0, synthetic_n: int = 256) -> PackedData:
    """Load `source` (a path or 'synthetic') and pack it into `seq_len` rows."""
    if seq_len < 2:
        raise UsageError(f"--seq-len {seq_len}: must be at least 2")
    if str(source) == SYNTHETIC:
        return PackedData(synthetic_rows(tokenizer, synthetic_n, seq_len, seed), seed)
    docs = read_documents(source, tokenizer)
    if not docs:
        raise SparseRLError(f"--data {source}: no documents")
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    tokens = pack(ids, seq_len, tokenizer.eos_token_id)
    if tokens.shape[0] == 0:
        total = sum(len(x) + 1 for x in ids)
        raise SparseRLError(f"--data {source}: {total} tokens, fewer than one row of --seq-len {seq_len} "
                            "(give more text or a shorter --seq-len)")
    return PackedData(tokens, seed)
