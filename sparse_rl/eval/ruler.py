"""`eval niah --preset ruler`: RULER's synthetic tasks (Hsieh et al. 2024, NVIDIA/RULER), built so
that scores are comparable with RULER's tables.

Read from RULER's `scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction}.py`, `constants.py` (templates, answer prefixes, generation budgets),
`scripts/synthetic.yaml` (the 13 task configurations) and `scripts/eval/synthetic/constants.py`
(metrics). What we keep as RULER does:

  - tasks `niah_single_1/2/3`, `niah_multikey_1/2/3`, `niah_multivalue`, `niah_multiquery`, `vt`,
    `cwe`, `fwe`, `qa_1`, `qa_2` with RULER's haystack (noise lines, essay sentences, or distractor needles), key
    and value kinds (word keys, 7-digit numbers, uuids), needle counts, templates and answer
    prefixes, singular wording when one value is asked;
  - length accounting: a sample of length L satisfies tokens(prompt) + tokens_to_generate <= L,
    prompt tokens counted without BOS (RULER's `text_to_tokens` is `tokenizer.tokenize`); the
    haystack size (noise lines, essay words, distractor needles, listed words) is the largest that
    fits, searched once per task and length as RULER does, each sample shrinking it until it fits
    (in steps of at most RULER's increment: 500 essay words, 25 lines, ...; RULER's steps are
    exactly its increment, and its search starts at one increment, which fails below ~1k tokens);
  - noise/needle haystacks are lines joined by "\\n" with each needle on its own line; essay
    haystacks are the first N words of the essay (repeated if short) cut into sentences, needles
    placed between sentences at depths drawn from RULER's 40 depths without replacement;
  - `vt` with RULER's one-shot example (a 3-letter-name chain fitted to 500 tokens, renamed per
    sample), needles without periods, answer prefix "... they are: ";
  - `cwe` with its one-shot example and RULER's frequencies (30/3, or 6/1 below 4096 tokens), `fwe`
    with RULER's Zipf (alpha 2) coded words;
  - the prompt is the model's chat template around the task text, followed by the answer prefix
    (RULER's `template.format(task_template=...) + answer_prefix`); `--no-chat` is RULER's `base`;
  - metrics `string_match_all` (niah, vt, cwe, fwe) and `string_match_part` (qa), on the output
    with control characters turned into newlines and stripped (RULER's `postprocess_pred`),
    reported as RULER does (percent, 2 decimals) per task and length, and their mean.

Where we differ on purpose: our own seeded `random.Random` per sample (RULER's numbers for a seed
cannot be reproduced without its wonderwords/NLTK environment); keys are our adjective-noun word
list, and `cwe`'s words are generated pronounceable pseudo-words (RULER: wonderwords lists and an
English word file); sentences are split by a regex at ". ! ?" (RULER: NLTK's punkt); the essay
text is the user's `--haystack FILE` (RULER downloads Paul Graham's essays; nothing downloads
here), and without one the essay tasks are skipped with a message; likewise `qa_1` / `qa_2` read
a local SQuAD v2 / HotpotQA dev JSON (`--squad`, `--hotpotqa`) and are skipped without one, the
question of sample i being the file's i-th (RULER: the same, after `pre_samples`). With a chat template, few-shot examples sit inside the one user turn (RULER nests
the whole chat template in them).
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from sparse_rl.errors import SparseRLError, UsageError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# RULER's needle depths: np.round(np.linspace(0, 100, 40)) (no ties, so Python's round agrees).
DEPTHS = [round(100 * i / 39) for i in range(40)]

TEMPLATES = {  # RULER scripts/data/synthetic/constants.py: (task template, answer prefix, tokens to generate)
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assigned the value {query}, they are: ", 30),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:", 120),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
           "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:", 32),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:", 50),
}


@dataclass(frozen=True)
class RulerTask:
    kind: str  # niah | vt | cwe | fwe | qa
    haystack: str = "noise"  # noise | essay | needle
    key: str = "words"
    value: str = "numbers"
    n_keys: int = 1
    n_values: int = 1
    n_queries: int = 1


# RULER scripts/synthetic.yaml
TASKS: dict[str, RulerTask] = {
    "niah_single_1": RulerTask("niah", "noise"),
    "niah_single_2": RulerTask("niah", "essay"),
    "niah_single_3": RulerTask("niah", "essay", value="uuids"),
    "niah_multikey_1": RulerTask("niah", "essay", n_keys=4),
    "niah_multikey_2": RulerTask("niah", "needle"),
    "niah_multikey_3": RulerTask("niah", "needle", key="uuids", value="uuids"),
    "niah_multivalue": RulerTask("niah", "essay", n_values=4),
    "niah_multiquery": RulerTask("niah", "essay", n_keys=4, n_queries=4),
    "vt": RulerTask("vt"),
    "cwe": RulerTask("cwe"),
    "fwe": RulerTask("fwe"),
    "qa_1": RulerTask("qa", "squad"),
    "qa_2": RulerTask("qa", "hotpotqa"),
}
QA_FILES = {"qa_1": ("squad", "SQuAD v2 dev JSON"), "qa_2": ("hotpotqa", "HotpotQA distractor dev JSON")}

_ADJ = ("amber azure bashful bitter bold brave breezy bright brisk bumpy calm careful cheerful chilly clever cloudy "
        "clumsy crisp curious damp dapper daring dusty eager early earnest elegant fancy fierce fluffy fragile "
        "frosty funny gentle giant glossy golden grumpy handsome happy hasty hollow humble icy itchy jolly juicy "
        "kind knotty lanky lazy lively lofty lucky lumpy mellow merry mighty misty modern muddy narrow nervous "
        "nimble noble odd orange patient plain plucky polite proud puzzled quaint quick quiet rapid rare rigid "
        "rosy rough rusty salty scarce shaggy shiny silent silly sleepy slender smoky snappy soft sparkling "
        "spicy steady stormy sturdy sunny swift tall tame tender thirsty tidy tiny tough upbeat vast velvet "
        "vivid wary warm weary wild windy wise witty wooden young zany zealous").split()
_NOUN = ("acorn anchor anthem apple apron arch atlas badge bagel bakery ballot bamboo banjo barn basket beacon "
         "beetle bell bench berry bicycle biscuit blanket blossom boat bonnet boulder bracelet bridge brook bucket "
         "buffalo cabin cactus camel candle canoe canyon carpet castle cedar cello chapel cherry chimney cider "
         "cliff clover cobra comet compass cookie coral cottage crayon cricket crown cushion daisy desert dolphin "
         "donkey dragon drum eagle easel elbow ember falcon feather fern fiddle flute forest fountain fox galaxy "
         "garden garlic gecko giraffe glacier goblet goose granite guitar hammer harbor harp hazel helmet heron "
         "hive honey igloo island ivory jacket jaguar jasmine jelly kettle kite koala ladder lagoon lantern lemon "
         "lily lizard lobster locket lotus magnet mango maple marble meadow melon mirror mitten moose mosaic "
         "muffin needle nest noodle oak oasis olive onion orchid otter owl paddle palace panda parrot peach "
         "pebble pelican pepper piano pillow pine planet plum pony poppy pretzel puddle pumpkin quartz quill "
         "rabbit radish raven ribbon river robin rocket saddle sailboat salmon sandal scarf shell sparrow spruce "
         "squash statue stream sunflower swan teapot thistle thunder tiger tomato tulip turtle umbrella valley "
         "velvet violin volcano wagon walnut walrus whale willow window wizard yacht zebra").split()


@lru_cache(maxsize=1)
def _key_words() -> tuple[str, ...]:
    return tuple(sorted({f"{a}-{n}" for a in _ADJ for n in _NOUN}))


@lru_cache(maxsize=1)
def cwe_vocab() -> tuple[str, ...]:
    """40k distinct pronounceable pseudo-words (fixed, seed-independent), RULER's word pool stand-in."""
    rng = random.Random("ruler-cwe-vocab")
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    seen: dict[str, None] = {}
    while len(seen) < 40000:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.choice((2, 3)))) + rng.choice(cons + "  ")
        seen.setdefault(w.strip(), None)
    return tuple(seen)


def _random(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return rng.choice(_key_words())
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def split_sentences(text: str) -> list[str]:
    """Sentences at ". ! ?" followed by whitespace (RULER uses NLTK's punkt)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


@dataclass
class Built:
    """One task instance before the chat template: the user text, the answer prefix, the answers."""

    user: str
    prefix: str
    answers: list[str]


# ----------------------------------------------------------------------------- generators (size -> sample)


def _niah(spec: RulerTask, rng: random.Random, size: int, essay: list[str] | None) -> Built:
    keys, values, needles = [], [], []
    for _ in range(spec.n_keys):
        key = _random(rng, spec.key)
        while key in keys:
            key = _random(rng, spec.key)
        keys.append(key)
        vals = [_random(rng, spec.value) for _ in range(spec.n_values)]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=spec.value, key=key, value=v) for v in vals]
    rng.shuffle(needles)
    if spec.haystack == "essay":
        words = (essay * (size // len(essay) + 1))[:size]
        sents = split_sentences(" ".join(words))
        cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if spec.haystack == "noise":
            lines = [NOISE] * size
        else:  # distractor needles; never with a key that is asked
            lines = []
            while len(lines) < size:
                k = _random(rng, spec.key)
                if k not in keys:
                    lines.append(NEEDLE.format(type_needle_v=spec.value, key=k, value=_random(rng, spec.value)))
        for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        context = "\n".join(lines)
    picked = rng.sample(range(spec.n_keys), spec.n_queries)
    queries = [keys[i] for i in picked]
    answers = [a for i in picked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, _ = TEMPLATES["niah"]
    type_v = spec.value
    if spec.n_queries * spec.n_values == 1:  # RULER's singular wording, on the template before formatting
        template, prefix = (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                            .replace("answers", "answer") for t in (template, prefix))
        type_v = type_v[:-1]
    return Built(template.format(type_needle_v=type_v, context=context, query=query),
                 prefix.format(type_needle_v=type_v, query=query), answers)


def _vt_chain(rng: random.Random, hops: int, icl: bool) -> tuple[list[str], list[str]]:
    k = 3 if icl else 5
    names: list[str] = []
    while len(names) < hops + 1:
        n = "".join(rng.choices(string.ascii_uppercase, k=k))
        if n not in names:
            names.append(n)
    value = "12345" if icl else str(rng.randint(10000, 99998))  # np.random.randint(10000, 99999)
    return names, [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]


def _vt(rng: random.Random, size: int, icl: bool = False, hops: int = 4) -> Built:
    names, chain = _vt_chain(rng, hops, icl)
    value = chain[0].split("=")[-1].strip()
    lines = [NOISE] * size
    for j, pos in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
        lines.insert(pos + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    template, prefix, _ = TEMPLATES["vt"]
    return Built(template.format(context=context, query=value, num_v=hops + 1),
                 prefix.format(query=value, num_v=hops + 1), names)


def _randomize_icl(example: str, rng: random.Random, hops: int = 4) -> str:
    """RULER's randomize_icl: new names (same lengths) for the example's answer, a new value for 12345."""
    for item in example.strip().split()[-hops - 1:]:
        example = example.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))))
    return example.replace("12345", str(rng.randint(10000, 99998)))


def _cwe_example(rng: random.Random, n_words: int, common_reps: int, rare_reps: int, n_common: int = 10):
    words = rng.sample(cwe_vocab(), n_words)
    common, rare = words[:n_common], words[n_common:]
    listed = common * common_reps + rare * rare_reps
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common


def _cwe(rng: random.Random, size: int, max_len: int) -> Built:
    template, prefix, _ = TEMPLATES["cwe"]
    shot_shape, reps = ((20, 3, 1), (6, 1)) if max_len < 4096 else ((40, 10, 3), (30, 3))
    shot_ctx, shot_ans = _cwe_example(rng, *shot_shape)
    ctx, answers = _cwe_example(rng, size, *reps)
    shot = template.format(context=shot_ctx, query="") + prefix + " " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(shot_ans))
    return Built(shot + "\n" + template.format(context=ctx, query=""), prefix, answers)


def _zeta(alpha: float) -> float:
    import sympy

    return float(sympy.zeta(alpha))


def _fwe(rng: random.Random, size: int, max_len: int, alpha: float = 2.0, word_len: int = 6) -> Built:
    vocab_size = max(max_len // 50, 4)  # RULER: (max_seq_length - tokens_to_generate) // 50
    vocab = {"".join(rng.choices(string.ascii_lowercase, k=word_len)) for _ in range(vocab_size)}
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_len)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise
    z = _zeta(alpha)
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k ** -alpha / z))]
    rng.shuffle(words)
    template, prefix, _ = TEMPLATES["fwe"]
    return Built(template.format(context=" ".join(words), query=""), prefix, vocab[1:4])


def read_squad(path: str | Path) -> tuple[list[dict], list[str]]:
    """RULER's read_squad: answerable questions of a SQuAD v2 JSON, each with its paragraph and the
    other paragraphs of its article; the documents are the distinct paragraphs, sorted."""
    data = _read_json(path, "--squad")
    try:
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data["data"]:
            article = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                for q in p["qas"]:
                    if not q.get("is_impossible", False):
                        own = index[p["context"]]
                        qas.append({"query": q["question"], "outputs": [a["text"] for a in q["answers"]],
                                    "context": [own], "more_context": [i for i in article if i != own]})
    except (KeyError, TypeError) as e:
        raise SparseRLError(f"--squad {path}: not SQuAD's format (missing {e})") from None
    return qas, docs


def read_hotpotqa(path: str | Path) -> tuple[list[dict], list[str]]:
    """RULER's read_hotpotqa: each question with its (gold and distractor) paragraphs as documents
    "title\ntext"; the documents are the distinct paragraphs, sorted."""
    data = _read_json(path, "--hotpotqa")
    try:
        docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = [{"query": d["question"], "outputs": [d["answer"]],
                "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    except (KeyError, TypeError, ValueError) as e:
        raise SparseRLError(f"--hotpotqa {path}: not HotpotQA's format ({e})") from None
    return qas, docs


def _read_json(path: str | Path, flag: str):
    import json

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {p}: file not found")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SparseRLError(f"{flag} {p}: not JSON ({' '.join(str(e).split())[:120]})") from None


def _qa(qas: list[dict], docs: list[str], rng: random.Random, index: int, size: int) -> Built:
    """RULER's QA sample: question `index` (in file order) among `size` documents (its own, then its
    article's, then random others), shuffled, numbered "Document i:"."""
    q = qas[index % len(qas)]
    own, more = q["context"], q.get("more_context", [])
    if size < len(docs):
        if size - len(own) > len(more):
            taken = set(own + more)
            others = [i for i in range(len(docs)) if i not in taken]
            picked = own + more + rng.sample(others, max(0, size - len(own) - len(more)))
        else:
            picked = own + rng.sample(more, max(0, size - len(own)))
        chosen = [docs[i] for i in picked]
    else:
        chosen = (docs * (size // len(docs) + 1))[:size]
    rng.shuffle(chosen)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
    template, prefix, _ = TEMPLATES["qa"]
    return Built(template.format(context=context, query=q["query"]), prefix, list(q["outputs"]))


# ----------------------------------------------------------------------------- prompts at RULER lengths


class RulerBuilder:
    """Builds RULER samples with one tokenizer: `sample(task, length, index)` -> prompt record.

    `essay` is the essay haystack as words (None: the essay tasks cannot be built); `chat` applies
    the tokenizer's chat template around the task text.
    """

    def __init__(self, tokenizer, *, seed: int = 0, essay: list[str] | None = None, essay_name: str = "",
                 chat: bool = True, qa: dict[str, tuple[list[dict], list[str]]] | None = None):
        if chat and not getattr(tokenizer, "chat_template", None):
            raise UsageError("--chat: the tokenizer has no chat template; use --no-chat (RULER's 'base' template)")
        self.tok, self.seed, self.essay, self.essay_name, self.chat = tokenizer, seed, essay, essay_name, chat
        self.qa = qa or {}  # "squad" / "hotpotqa" -> (questions, documents)
        self._sizes: dict[tuple[str, int], int] = {}
        self._icl: str | None = None

    def count(self, text: str) -> int:
        """RULER's length: tokens of the text, no BOS/EOS added."""
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def render(self, b: Built) -> str:
        if not self.chat:
            return b.user + b.prefix
        msgs = [{"role": "user", "content": b.user}]
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + b.prefix

    def _maker(self, task: str, length: int) -> tuple[Callable[[random.Random, int, int], Built], int, int]:
        """((rng, size, sample index) -> Built, RULER's increment of the size, the smallest size)."""
        spec = TASKS[task]
        if spec.kind == "qa":
            if spec.haystack not in self.qa:
                raise UsageError(f"{task} needs a local {QA_FILES[task][1]}: give --{spec.haystack} FILE")
            qas, docs = self.qa[spec.haystack]
            return (lambda rng, n, i: _qa(qas, docs, rng, i, n)), 10, 1
        if spec.kind == "niah":
            if spec.haystack == "essay" and not self.essay:
                raise UsageError(f"{task} needs an essay haystack: give --haystack FILE")
            inc = 500 if spec.haystack == "essay" else (25 if length >= 4096 else 5)
            return (lambda rng, n, i: _niah(spec, rng, n, self.essay)), inc, spec.n_keys * spec.n_values
        if spec.kind == "vt":
            icl = self.icl_example()
            return (lambda rng, n, i: self._with_icl(_vt(rng, n), icl, rng)), (10 if length >= 4096 else 5), 5
        if spec.kind == "cwe":
            return (lambda rng, n, i: _cwe(rng, n, length)), 10, 11
        return (lambda rng, n, i: _fwe(rng, n, length - TEMPLATES["fwe"][2])), max((length - 50) // 32, 1), 1

    @staticmethod
    def _with_icl(b: Built, icl: str, rng: random.Random) -> Built:
        return Built(_randomize_icl(icl, rng) + "\n" + b.user, b.prefix, b.answers)

    def icl_example(self) -> str:
        """RULER's vt one-shot example: a 3-letter chain whose text (template + prefix + answer) fits
        500 tokens, as the text `input answer\\n`."""
        if self._icl is None:
            rng_for = lambda n: random.Random(f"ruler|{self.seed}|vt-icl|{n}")  # noqa: E731
            text = lambda n: (lambda b: b.user + b.prefix)(_vt(rng_for(n), n, icl=True))  # noqa: E731
            try:
                n = self._largest(lambda n: self.count(text(n)) <= 500, 5, "vt one-shot example", 500)
            except UsageError:  # a tokenizer so coarse that 5 noise lines exceed 500 tokens: the smallest
                n = 5
            b = _vt(rng_for(n), n, icl=True)
            self._icl = b.user + b.prefix + " " + " ".join(b.answers) + "\n"
        return self._icl

    @staticmethod
    def _largest(fits: Callable[[int], bool], lo: int, what: str, length: int) -> int:
        """The largest size >= lo with fits(size), by doubling then bisection (RULER bisects too).
        Every haystack unit (line, word, needle) costs at least a token, so no size beyond a few
        times `length` can fit: one that does means the tokenizer does not encode the haystack."""
        if not fits(lo):
            raise UsageError(f"--lengths {length}: too short for {what} (even the smallest haystack does not fit)")
        cap = 4 * length + 16
        hi = lo * 2
        while hi <= cap and fits(hi):
            lo, hi = hi, hi * 2
        if hi > cap:
            if fits(cap):
                raise SparseRLError(f"{what}: the prompt does not grow with its haystack (does the tokenizer "
                                    f"encode it?)")
            hi = cap
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _rng(self, task: str, length: int, index: int) -> random.Random:
        return random.Random(f"ruler|{self.seed}|{task}|{length}|{index}")

    def sample(self, task: str, length: int, index: int) -> dict:
        """One RULER sample: `{"id", "prompt", "answer": [refs], "task", "meta"}` with
        tokens(prompt) + meta.max_new_tokens <= length."""
        spec = TASKS[task]
        make, inc, smallest = self._maker(task, length)
        gen = TEMPLATES[spec.kind][2]
        budget = length - gen
        if budget <= 0:
            raise UsageError(f"--lengths {length}: shorter than {task}'s generation budget ({gen} tokens)")
        tokens = lambda i, n: self.count(self.render(make(self._rng(task, length, i), n, i)))  # noqa: E731
        key = (task, length)
        if key not in self._sizes:  # RULER: one search per task and length
            self._sizes[key] = self._largest(lambda n: tokens(0, n) <= budget, smallest, task, length)
        size = self._sizes[key]
        while True:  # RULER: shrink until this sample fits (in steps of at most its increment)
            b = make(self._rng(task, length, index), size, index)
            text = self.render(b)
            n_tok = self.count(text)
            if n_tok <= budget:
                break
            if size <= smallest:
                raise UsageError(f"--lengths {length}: too short for {task}")
            size = max(size - min(inc, max(1, size // 50)), smallest)
        first = text.find(b.answers[0])
        return {
            "id": f"ruler/{task}/L{length}/s{index}",
            "prompt": text,
            "answer": b.answers,
            "task": task,
            "meta": {"preset": "ruler", "length": length, "depth": None, "sample": index, "seed": self.seed,
                     "max_new_tokens": gen, "input_tokens": n_tok,
                     "metric": "string_match_part" if spec.kind == "qa" else "string_match_all",
                     "answer_prefix": b.prefix, "haystack": self.essay_name if spec.haystack == "essay" else
                     spec.haystack, "haystack_size": size, "chat": self.chat,
                     "token_position_answer": self.count(text[:first]) if spec.kind == "niah" else None},
        }


def read_essay(path: str | Path) -> list[str]:
    """The essay haystack as words (RULER: `re.sub(r"\\s+", " ", essay).split(" ")`)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--haystack {p}: file not found")
    try:
        words = p.read_text(encoding="utf-8").split()
    except UnicodeDecodeError:
        raise SparseRLError(f"--haystack {p}: not UTF-8 text") from None
    if len(split_sentences(" ".join(words))) < 2:
        raise SparseRLError(f"--haystack {p}: needs text of several sentences")
    return words


def plan_tasks(tasks: list[str] | None, have_essay: bool, have_qa: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """(tasks to build, one-line notes on the tasks skipped and why). `have_qa`: the QA datasets given
    ("squad", "hotpotqa"). Unknown names are UsageErrors."""
    known = list(TASKS)
    asked = tasks or known
    bad = [t for t in asked if t not in known]
    if bad:
        raise UsageError(f"--tasks: unknown RULER task '{bad[0]}' (choose from {', '.join(known)})")
    build, notes = [], []
    essay_skipped = [t for t in asked if t in TASKS and TASKS[t].haystack == "essay" and not have_essay]
    if essay_skipped:
        notes.append(f"skipped {', '.join(essay_skipped)}: RULER's essay haystack needs --haystack FILE "
                     f"(a local text, e.g. Paul Graham's essays; nothing is downloaded)")
    qa = [t for t in asked if t in QA_FILES and QA_FILES[t][0] not in have_qa]
    if qa:
        notes.append("skipped " + ", ".join(qa) + ": RULER's QA tasks need local data: " + ", ".join(
            f"--{QA_FILES[t][0]} FILE ({QA_FILES[t][1]})" for t in qa))
    build = [t for t in asked if t not in essay_skipped and t not in qa]
    if tasks and not build:
        raise UsageError("--tasks: none of the asked RULER tasks can be built (" + "; ".join(notes) + ")")
    return build, notes


# ----------------------------------------------------------------------------- metrics (RULER's)


def postprocess_pred(text: str) -> str:
    """RULER's postprocess_pred: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """RULER's string_match_all: mean over samples of the fraction of refs found (case-insensitive), in
    percent, 2 decimals."""
    score = sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref) for p, ref in zip(preds, refs))
    return round(score / len(preds) * 100, 2)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    """RULER's string_match_part: mean over samples of 1 if any ref is found, in percent, 2 decimals."""
    score = sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs))
    return round(score / len(preds) * 100, 2)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def sample_score(output: str, rec: dict) -> float:
    """One sample's score in [0, 1] by its record's metric, on the post-processed output: the
    unrounded term RULER's metric averages (a cell's mean x 100, rounded, is RULER's number)."""
    pred = postprocess_pred(output).lower()
    found = [r.lower() in pred for r in rec["answer"]]
    if rec["meta"].get("metric", "string_match_all") == "string_match_part":
        return float(any(found))
    return sum(found) / len(found)


def summary_table(done: dict, tasks: list[str], lengths: list[int], mode: str) -> dict:
    """RULER's table for one mode: {task: {length: percent}}, and "avg" per length (mean over tasks)."""
    table = {t: {str(n): round(100 * done[(mode, t, n, None)]["score"], 2) for n in lengths
                 if (mode, t, n, None) in done} for t in tasks}
    avg = {}
    for n in lengths:
        vals = [table[t][str(n)] for t in tasks if str(n) in table[t]]
        avg[str(n)] = round(sum(vals) / len(vals), 2) if vals else None
    return {"by_task_length": table, "avg": avg}
