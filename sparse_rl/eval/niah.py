"""Needle-in-a-haystack prompts after RULER (Hsieh et al. 2024), built at exact token lengths.

Two presets (`NiahConfig.preset`): `grid` (this module: our depth x length grid and heatmaps) and
`ruler` (`sparse_rl.eval.ruler`: RULER's own tasks, templates, length accounting and metrics, for
numbers comparable with RULER's tables). `prompt_plan` / `build_niah_prompts` / `score_output`
dispatch on it.

Tasks (RULER's names in brackets):
  single      one key, one value, asked for it                      [niah_single]
  multikey    four keys with one value each, one of them asked       [niah_multikey]
  multivalue  one key with four values, all asked                    [niah_multivalue]
  multiquery  four keys with one value each, all asked               [niah_multiquery]
  vt          a chain of 1 + 4 variable assignments, all names asked [vt]
Keys are word pairs, values 7-digit numbers (vt: 5-digit values, 5-letter names). The prompt ends
with RULER's answer prefix, so a base model simply continues it. Scoring is RULER's
`string_match_all`: the fraction of expected strings found in the output, case-insensitive.

Construction. The haystack is a token stream of whole sentences (RULER's repeated "noise"
sentences, or a user's text file split into sentences, cycled), each encoded with a leading space
so that concatenated sentence tokens decode to the joined text. For a filler budget of H tokens a
needle at depth d (a fraction of the filler tokens before it) goes to the sentence boundary
nearest d*H, where the two ends of the filler count as boundaries (so depths 0 and 1 are exact);
the one partial sentence needed to hit H exactly sits at the end of the filler, or at its start
when the asked needle is in the second half. The rendered prompt is
re-tokenised and H adjusted until its length is exactly the requested one, because BPE merges
across the joins can shift the count by a token or two. The first needle of a task (the one the
question is about) sits at the requested depth; further needles go to seeded random depths (vt:
later hops at random depths after the first, in chain order). Everything is seeded by
(seed, task, length, depth, sample), so dense and sparse runs see identical prompts.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sparse_rl.errors import SparseRLError, UsageError

TASKS = ("single", "multikey", "multivalue", "multiquery", "vt")
# RULER's tokens_to_generate: 128 for the NIAH family, 30 for variable tracking.
MAX_NEW_TOKENS = {"single": 128, "multikey": 128, "multivalue": 128, "multiquery": 128, "vt": 30}

NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")

_ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
               "kind", "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy",
               "upbeat", "vivid", "wise", "young", "zealous", "bitter", "clever", "damp", "early", "fierce")
_NOUNS = ("falcon", "harbor", "lantern", "meadow", "orchid", "pepper", "quartz", "river", "saddle", "thistle",
          "violin", "walnut", "anchor", "beacon", "canyon", "dragon", "ember", "forest", "glacier", "hammer",
          "island", "jacket", "kettle", "ladder", "marble", "needle", "otter", "pillow", "rocket", "spruce")

_NIAH_PREFIX = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards.\n")
_NIAH_SUFFIX = ("\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
                " The special magic numbers for {query} mentioned in the provided text are")
_NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
_VT_PREFIX = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_SUFFIX = ("\nQuestion: Find all variables that are assigned the value {value} in the text above."
              " Answer: According to the chain(s) of variable assignment in the text above, {n} variables"
              " are assigned the value {value}, they are:")


PRESETS = ("grid", "ruler")
# Per preset: (tasks, lengths, depths, samples) when not given. RULER's tables: 500 samples per
# task and length, lengths 4k..128k, every task, depths drawn at random per sample.
_DEFAULTS = {
    "grid": (["single"], [1024, 2048, 4096], [0.0, 0.25, 0.5, 0.75, 1.0], 1),
    "ruler": (None, [4096, 8192, 16384, 32768, 65536, 131072], None, 500),
}


@dataclass
class NiahConfig:
    """Options of `sparse-rl eval niah` (YAML keys = these names). Unset grid fields take their
    preset's default (`check()` fills them in)."""

    tokenizer: Optional[str] = None  # local HF tokenizer (or model) dir used to measure lengths
    preset: str = "grid"  # grid: our depth x length heatmaps | ruler: RULER's 13 tasks and accounting
    tasks: Optional[list[str]] = None  # grid: single; ruler: all it can build
    lengths: Optional[list[int]] = None  # grid: 1k, 2k, 4k (prompt tokens); ruler: 4k..128k (prompt + generation)
    depths: Optional[list[float]] = None  # grid only: 0, .25, .5, .75, 1
    samples: Optional[int] = None  # prompts per cell; grid: 1, ruler: 500
    seed: int = 0
    haystack: Optional[str] = None  # grid: filler text file (default RULER's noise); ruler: the essay text
    chat: Optional[bool] = None  # ruler: wrap in the chat template (None: when the tokenizer has one)
    squad: Optional[str] = None  # ruler qa_1: a local SQuAD v2 dev JSON
    hotpotqa: Optional[str] = None  # ruler qa_2: a local HotpotQA distractor dev JSON
    add_special_tokens: bool = True  # grid: count BOS/EOS the tokenizer adds, as the model will see them
    prompts_out: Optional[str] = None  # write the built prompts JSONL here ("-" = stdout)
    prompts: Optional[str] = None  # prompts JSONL (from --prompts-out) to score against
    score: list[str] = field(default_factory=list)  # MODE=completions.jsonl, e.g. dense=d.jsonl
    out: Optional[str] = None  # results dir: cells.jsonl, summary.json, heatmaps
    model: Optional[str] = None  # run the grid on this model dir (its tokenizer measures lengths)
    modes: list[str] = field(default_factory=list)  # attention modes; empty = dense and sparse for a sparse dir
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 16  # decode slots of the rollout engine
    max_new_tokens: int = 0  # grid: 0 = RULER's budget per task (128; vt 30)

    def check(self) -> None:
        if self.preset not in PRESETS:
            raise UsageError(f"--preset {self.preset}: choose from {', '.join(PRESETS)}")
        tasks, lengths, depths, samples = _DEFAULTS[self.preset]
        if self.preset == "ruler":
            for flag, given in (("--depths", self.depths), ("--max-new-tokens", self.max_new_tokens)):
                if given:
                    raise UsageError(f"{flag}: the ruler preset uses RULER's (random needle depths, per-task "
                                     f"generation budgets inside the length); drop {flag}")
        elif self.chat is not None or self.squad or self.hotpotqa:
            flag = "--chat/--no-chat" if self.chat is not None else "--squad/--hotpotqa"
            raise UsageError(f"{flag}: applies to --preset ruler")
        self.tasks = tasks if self.tasks is None else self.tasks
        self.lengths = lengths if self.lengths is None else self.lengths
        self.depths = depths if self.depths is None else self.depths
        self.samples = samples if self.samples is None else self.samples
        if self.preset == "grid":
            bad = [t for t in self.tasks if t not in TASKS]
            if bad:
                raise UsageError(f"--tasks: unknown task '{bad[0]}' (choose from {', '.join(TASKS)}; "
                                 f"RULER's names need --preset ruler)")
            if not self.tasks or not self.depths:
                raise UsageError("--tasks, --lengths and --depths each need at least one value")
            if any(not 0.0 <= d <= 1.0 for d in self.depths):
                raise UsageError("--depths: every depth is a fraction of the haystack in [0, 1]")
        if not self.lengths:
            raise UsageError("--lengths: needs at least one value")
        if any(n <= 0 for n in self.lengths):
            raise UsageError("--lengths: every length is a positive number of tokens")
        if self.samples < 1:
            raise UsageError("--samples: needs at least 1 prompt per cell")
        if self.max_new_tokens < 0:
            raise UsageError("--max-new-tokens: 0 (the per-task default) or a positive number")


def string_match_all(pred: str, refs: list[str]) -> float:
    """RULER's metric for one output: the fraction of `refs` that occur in `pred`, case-insensitive."""
    if not refs:
        raise ValueError("string_match_all needs at least one expected string")
    low = pred.lower()
    return sum(1.0 for r in refs if r.lower() in low) / len(refs)


class Haystack:
    """Filler sentences and, per tokenizer, their token stream with sentence boundaries."""

    # Needles sit between sentences; a text with few sentence ends (code, lists) is cut into pieces
    # of at most this many words so that depths stay precise.
    MAX_WORDS = 40

    def __init__(self, sentences: list[str], name: str = "noise"):
        pieces = []
        for s in sentences:
            # "\x00" marks needle positions while a prompt is assembled, so it may not occur in the filler.
            words = s.replace("\x00", "").split()
            pieces += [" ".join(words[i:i + self.MAX_WORDS]) for i in range(0, len(words), self.MAX_WORDS)]
        sentences = pieces
        if not sentences:
            raise SparseRLError(f"{name}: the haystack text has no sentences")
        self.sentences = sentences
        self.name = name
        self.sha = hashlib.sha256("\n".join(sentences).encode()).hexdigest()[:16]
        self._cache: dict[int, tuple[list[int], list[int], int]] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> "Haystack":
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"--haystack {p}: file not found")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SparseRLError(f"--haystack {p}: not UTF-8 text") from None
        # Sentence ends, or blank lines between paragraphs/titles without a full stop.
        parts = re.split(r"(?<=[.!?])\s+|\n\s*\n", text)
        return cls([" ".join(s.split()) for s in parts], name=str(p))

    @classmethod
    def default(cls) -> "Haystack":
        return cls(list(NOISE_SENTENCES), name="noise")

    def stream(self, tokenizer, n_tokens: int) -> tuple[list[int], list[int]]:
        """Token ids of the cycled sentences (at least `n_tokens` of them) and the sentence
        boundaries as token offsets `[0, b1, b2, ...]`."""
        ids, bounds, nxt = self._cache.get(id(tokenizer), ([], [0], 0))
        while len(ids) < n_tokens:
            s = self.sentences[nxt % len(self.sentences)]
            ids.extend(tokenizer.encode(" " + s, add_special_tokens=False))
            bounds.append(len(ids))
            nxt += 1
            # A whole cycle of sentences that added nothing would repeat forever.
            if nxt >= len(self.sentences) and len(ids) == bounds[nxt - len(self.sentences)]:
                raise SparseRLError(f"haystack {self.name}: the tokenizer encodes its sentences to no tokens; "
                                    f"use a tokenizer that can encode this text")
        self._cache[id(tokenizer)] = (ids, bounds, nxt)
        return ids, bounds


@dataclass
class _Spec:
    prefix: str
    suffix: str
    needles: list[str]  # in chain/insertion order
    depths: list[float]  # one per needle; needles[0] at the requested depth
    expected: list[str]


def _key(rng: random.Random, used: set) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in used:
            used.add(k)
            return k


def _value(rng: random.Random, used: set, digits: int = 7) -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if v not in used:
            used.add(v)
            return v


def _spec(task: str, depth: float, rng: random.Random) -> _Spec:
    keys: set = set()
    vals: set = set()
    others = lambda n: [rng.random() for _ in range(n)]  # noqa: E731 (depths of the extra needles)
    if task == "vt":
        names = []
        while len(names) < 5:
            n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if n not in names:
                names.append(n)
        value = _value(rng, vals, digits=5)
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        later = sorted(depth + (1.0 - depth) * u for u in others(4))
        return _Spec(_VT_PREFIX, _VT_SUFFIX.format(value=value, n=5), needles, [depth] + later, names)
    if task in ("single", "multikey", "multiquery"):
        n_keys = 1 if task == "single" else 4
        pairs = [(_key(rng, keys), _value(rng, vals)) for _ in range(n_keys)]
        needles = [_NIAH_NEEDLE.format(key=k, value=v) for k, v in pairs]
        if task == "multiquery":
            query = ", ".join(k for k, _ in pairs[:-1]) + f" and {pairs[-1][0]}"
            expected = [v for _, v in pairs]
        else:  # single, multikey: the first key is asked; the others are distractors
            query, expected = pairs[0][0], [pairs[0][1]]
        return _Spec(_NIAH_PREFIX, _NIAH_SUFFIX.format(query=query), needles, [depth] + others(n_keys - 1), expected)
    if task == "multivalue":
        key = _key(rng, keys)
        values = [_value(rng, vals) for _ in range(4)]
        needles = [_NIAH_NEEDLE.format(key=key, value=v) for v in values]
        return _Spec(_NIAH_PREFIX, _NIAH_SUFFIX.format(query=key), needles, [depth] + others(3), values)
    raise UsageError(f"unknown NIAH task '{task}' (choose from {', '.join(TASKS)})")


def _join(pieces: list[str]) -> str:
    out = ""
    for p in pieces:
        if out and p and not out[-1].isspace() and not p[0].isspace():
            out += " "
        out += p
    return out


def _nearest(bounds: list[int], target: float) -> int:
    import bisect

    j = bisect.bisect_left(bounds, target)
    cands = bounds[max(j - 1, 0): j + 1]
    return min(cands, key=lambda x: (abs(x - target), x))


def build_niah_sample(tokenizer, task: str, length: int, depth: float, *, seed: int = 0, sample: int = 0,
                      haystack: Haystack | None = None, add_special_tokens: bool = True) -> dict:
    """One prompt record `{"id", "prompt", "answer": [expected strings], "task", "meta"}` whose
    tokenisation by `tokenizer` (with `add_special_tokens`) is exactly `length` tokens long.

    `meta` records the realised needle depths (fraction of filler tokens before each needle), the
    token index of the asked needle when the tokenizer is a fast one, and `max_new_tokens`.
    """
    haystack = haystack or Haystack.default()
    rng = random.Random(f"niah|{seed}|{task}|{length}|{depth!r}|{sample}")
    spec = _spec(task, depth, rng)
    order = sorted(range(len(spec.needles)), key=lambda i: (spec.depths[i], i))

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render(h: int, tail: str) -> tuple[str, list[int], list[int]]:
        """Text with `h` filler tokens. The one partial sentence goes at the end of the filler
        (tail="end") or at its start (tail="start"); needles go to whole-sentence boundaries or
        to either end of the filler, whichever is nearest their depth."""
        ids, bounds = haystack.stream(tokenizer, h)
        if tail == "end":
            r, window = 0, [b for b in bounds if b < h] + [h]
        else:
            end = next(b for b in bounds if b >= h)
            r = end - h
            window = [0] + [b - r for b in bounds if r < b <= end]
        offs = [_nearest(window, spec.depths[i] * h) for i in order]
        pieces, starts, prev = [], [], 0
        for i, off in zip(order, offs):
            pieces.append(tokenizer.decode(ids[r + prev:r + off], clean_up_tokenization_spaces=False))
            pieces.append("\x00" + spec.needles[i])  # marks the needle start; removed below
            prev = off
        pieces.append(tokenizer.decode(ids[r + prev:r + h], clean_up_tokenization_spaces=False))
        context = _join(pieces)  # not stripped: that would merge two lengths into one, leaving a gap
        text = spec.prefix + context + spec.suffix
        pos = 0
        for _ in order:
            pos = text.index("\x00", pos)
            text = text[:pos] + text[pos + 1:]
            starts.append(pos)
        return text, offs, starts

    overhead = count(spec.prefix + " ".join(spec.needles) + spec.suffix)
    if overhead >= length:
        raise UsageError(f"--lengths {length}: too short for task '{task}', whose question and needles "
                         f"alone take {overhead} tokens")
    h0 = length - overhead

    def fit(tail: str):
        h, seen = h0, set()
        for _ in range(32):  # follow the error; BPE joins make it converge in a step or two
            if h < 0 or h in seen:
                break
            seen.add(h)
            text, offs, starts = render(h, tail)
            n = count(text)
            if n == length:
                return h, text, offs, starts
            h += length - n
        for delta in (d for k in range(1, 65) for d in (k, -k)):  # it cycled: scan around the estimate
            h = h0 + delta
            if h >= 0 and h not in seen:
                text, offs, starts = render(h, tail)
                if count(text) == length:
                    return h, text, offs, starts
        return None

    # Put the partial sentence away from the asked needle first; the other side if that cannot fit
    # (a token that merges across the join can make a length unreachable from one side).
    tails = ("start", "end") if depth > 0.5 else ("end", "start")
    found = fit(tails[0]) or fit(tails[1])
    if found is None:
        raise SparseRLError(f"could not build a {task} prompt of exactly {length} tokens with this tokenizer "
                            f"(question and needles take ~{overhead}; try another length or --haystack text)")
    h, text, offs, starts = found
    first = order.index(0)
    token_pos = None
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=add_special_tokens)
        token_pos = enc.char_to_token(starts[first])
    realised = [0.0] * len(spec.needles)
    for i, off in zip(order, offs):
        realised[i] = off / h if h else 0.0
    return {
        "id": f"niah/{task}/L{length}/d{depth:g}/s{sample}",
        "prompt": text,
        "answer": spec.expected,
        "task": f"niah_{task}",
        "meta": {"length": length, "depth": depth, "sample": sample, "seed": seed,
                 "needle_depths": realised, "needle_token_pos": token_pos,
                 "needle_char_pos": starts[first], "filler_tokens": h,
                 "max_new_tokens": MAX_NEW_TOKENS[task], "haystack": haystack.name},
    }


def prompt_plan(cfg: NiahConfig) -> tuple[list[tuple], list[str]]:
    """The prompts to build as (task, length, depth, sample) cells (depth None for ruler: drawn per
    sample), and one-line notes on tasks skipped (ruler: essay tasks without --haystack, QA)."""
    cfg.check()
    if cfg.preset == "ruler":
        from sparse_rl.eval.ruler import plan_tasks

        have_qa = tuple(k for k in ("squad", "hotpotqa") if getattr(cfg, k))
        tasks, notes = plan_tasks(cfg.tasks, bool(cfg.haystack), have_qa)
        return [(t, n, None, s) for t in tasks for n in cfg.lengths for s in range(cfg.samples)], notes
    return [(t, n, d, s) for t in cfg.tasks for n in cfg.lengths for d in cfg.depths for s in range(cfg.samples)], []


def build_niah_prompts(tokenizer, cfg: NiahConfig, haystack: Haystack | None = None, progress=None) -> list[dict]:
    """Every prompt of `prompt_plan(cfg)`, in that order (grid: tasks x lengths x depths x samples;
    ruler: tasks x lengths x samples)."""
    cells, _ = prompt_plan(cfg)
    if cfg.preset == "ruler":
        from sparse_rl.eval.ruler import RulerBuilder, read_essay, read_hotpotqa, read_squad

        chat = cfg.chat if cfg.chat is not None else bool(getattr(tokenizer, "chat_template", None))
        qa = {k: read(path) for k, read, path in (("squad", read_squad, cfg.squad),
                                                  ("hotpotqa", read_hotpotqa, cfg.hotpotqa)) if path}
        builder = RulerBuilder(tokenizer, seed=cfg.seed, essay=read_essay(cfg.haystack) if cfg.haystack else None,
                               essay_name=str(cfg.haystack or ""), chat=chat, qa=qa)
        make = lambda t, n, d, s: builder.sample(t, n, s)  # noqa: E731
    else:
        haystack = haystack or (Haystack.from_file(cfg.haystack) if cfg.haystack else Haystack.default())

        def make(t, n, d, s):
            rec = build_niah_sample(tokenizer, t, n, d, seed=cfg.seed, sample=s, haystack=haystack,
                                    add_special_tokens=cfg.add_special_tokens)
            if cfg.max_new_tokens:
                rec["meta"]["max_new_tokens"] = cfg.max_new_tokens
            return rec
    out = []
    for cell in cells:
        out.append(make(*cell))
        if progress is not None:
            progress()
    return out


def score_output(output: str, rec: dict) -> float:
    """A sample's score in [0, 1]: RULER's metric for ruler records, `string_match_all` for the grid."""
    if rec["meta"].get("preset") == "ruler":
        from sparse_rl.eval.ruler import sample_score

        return sample_score(output, rec)
    return string_match_all(output, rec["answer"])


def load_tokenizer(path: str | Path, flag: str = "--tokenizer"):
    """A local Hugging Face tokenizer (a tokenizer or model dir); never downloads. The one loader
    (`sparse.loader.load_tokenizer`: a dir without tokenizer files, or a tokenizer that encodes text to
    no tokens, is refused) after a check that the path is a local dir; errors name `flag`."""
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"{flag} {p}: not a directory (give a local tokenizer or model dir)")
    from sparse_rl.sparse.loader import load_tokenizer as load

    try:
        return load(p)
    except SparseRLError as e:
        raise SparseRLError(f"{flag} {e}") from None
