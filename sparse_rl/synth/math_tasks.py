"""Procedural math/reasoning tasks with exact integer answers and difficulty knobs.

Every generator is a pure function `gen(rng, level, **knobs) -> dict` returning the fields of a
prompt/task record (docs/DESIGN.md): `prompt`, `answer` (a plain integer as a string, so math-verify
checks it), and `meta`. `make_math_task` adds `id`, `task` and `difficulty`. Each task has its own
`random.Random` seeded from (seed, family, index), so a task does not change when the mixture or
the count around it changes, and the same seed always gives the same file.

Families (the `task` field is `math/<family>`):
  - `arith`: nested integer expressions; `level` sets the number of operations (level + 2) and the
    size of the operands. Division appears only where it is exact (then Python's // is exact too).
  - `word`: a story about one running quantity; `level` sets the number of steps (level + 1).
  - `vartrack`: long-context variable tracking (RULER-style): `VAR x = 123` assignments and copies
    scattered through filler text, the question at the end; `level` sets the chain length
    (level + 1 hops, some with an added constant) and `length` the filler length in words.

The prompt asks for the final answer in \\boxed{}; `verify_math` scores any completion by the
project's one answer rule (sparse_rl/eval/answers.py) against the gold answer.
"""

from __future__ import annotations

import random
from typing import Callable

BOX = "Give the final answer as \\boxed{N}."

# ---------------------------------------------------------------------------------------- arith


def _expr(rng: random.Random, n_ops: int, hi: int) -> tuple[str, int]:
    """A random expression tree with `n_ops` binary operations; returns (text, exact value)."""
    if n_ops == 0:
        v = rng.randint(1, hi)
        return str(v), v
    left_ops = rng.randint(0, n_ops - 1)
    lt, lv = _expr(rng, left_ops, hi)
    rt, rv = _expr(rng, n_ops - 1 - left_ops, hi)
    op = rng.choice("+-*/")
    if op == "/" and (rv in (0, 1, -1) or lv % rv):  # exact division only, so the answer stays an integer
        op = rng.choice("+-*")
    if op == "*" and abs(lv * rv) > hi ** 3:  # keep the numbers human-sized
        op = rng.choice("+-")
    val = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv // rv if op == "/" else 0}[op]
    return f"({lt} {op} {rt})", val


def gen_arith(rng: random.Random, level: int) -> dict:
    n_ops = level + 2
    hi = 9 if level <= 2 else (30 if level <= 5 else 99)
    text, val = _expr(rng, n_ops, hi)
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    prompt = f"Compute the value of the following expression. Work step by step. {BOX}\n\n{text}"
    return {"prompt": prompt, "answer": str(val), "meta": {"expression": text, "n_ops": n_ops}}


# ----------------------------------------------------------------------------------------- word

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luca"]
ITEMS = [("apples", "bag"), ("marbles", "jar"), ("stickers", "sheet"), ("pencils", "box"),
         ("cookies", "tray"), ("cards", "pack"), ("stamps", "album"), ("beads", "string")]


def gen_word(rng: random.Random, level: int) -> dict:
    name, friend = rng.sample(NAMES, 2)
    item, unit = rng.choice(ITEMS)
    hi = 10 * level + 10
    x = rng.randint(5, hi)
    lines = [f"{name} has {x} {item}."]
    steps = [("start", x)]
    for _ in range(level + 1):
        kind = rng.choice(["buy", "give", "get", "double", "share"])
        if kind == "buy":
            k, m = rng.randint(2, 5), rng.randint(2, 12)
            x += k * m
            lines.append(f"Then {name} buys {k} {unit}s with {m} {item} in each {unit}.")
        elif kind == "give" and x > 1:
            g = rng.randint(1, x - 1)
            x -= g
            lines.append(f"{name} gives {g} {item} to {friend}.")
        elif kind == "double" and x < 500:
            x *= 2
            lines.append(f"{friend} gives {name} as many {item} as {name} already has.")
        elif kind == "share" and any(x % p == 0 for p in (2, 3, 4, 5)):
            p = rng.choice([p for p in (2, 3, 4, 5) if x % p == 0])
            x //= p
            lines.append(f"{name} splits the {item} equally into {p} groups and keeps only one group.")
        else:
            g = rng.randint(1, hi)
            x += g
            lines.append(f"{friend} gives {name} {g} more {item}.")
        steps.append((kind, x))
    question = f"How many {item} does {name} have now?"
    prompt = " ".join(lines) + f" {question} Think step by step. {BOX}"
    return {"prompt": prompt, "answer": str(x), "meta": {"steps": [list(s) for s in steps]}}


# ------------------------------------------------------------------------------------- vartrack

FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.", "The river flows to the sea.", "A bird sings in the tree.",
          "The road winds through the hills."]


def _var_names(rng: random.Random, k: int) -> list[str]:
    # A list, not a set: set order of strings changes with PYTHONHASHSEED, and the file must not.
    names: list[str] = []
    while len(names) < k:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def gen_vartrack(rng: random.Random, level: int, length: int = 512) -> dict:
    """`length` is the number of filler words; statements are spread evenly through it."""
    hops = level + 1
    n_distract = 1 + level // 2
    names = _var_names(rng, (hops + 1) * (1 + n_distract))
    chains: list[list[str]] = []
    values: dict[str, int] = {}
    statements_per_chain: list[list[str]] = []
    for c in range(1 + n_distract):
        chain = names[c * (hops + 1):(c + 1) * (hops + 1)]
        v0 = rng.randint(10000, 99999)
        stmts = [f"VAR {chain[0]} = {v0}."]
        values[chain[0]] = v0
        for i in range(1, len(chain)):
            if level >= 3 and rng.random() < 0.5:
                add = rng.randint(1, 99)
                values[chain[i]] = values[chain[i - 1]] + add
                stmts.append(f"VAR {chain[i]} = VAR {chain[i - 1]} + {add}.")
            else:
                values[chain[i]] = values[chain[i - 1]]
                stmts.append(f"VAR {chain[i]} = VAR {chain[i - 1]}.")
        chains.append(chain)
        statements_per_chain.append(stmts)
    # Interleave chains while keeping each chain's order (a variable is defined before use).
    order: list[str] = []
    cursors = [0] * len(chains)
    while any(cur < len(s) for cur, s in zip(cursors, statements_per_chain)):
        c = rng.choice([i for i, s in enumerate(statements_per_chain) if cursors[i] < len(s)])
        order.append(statements_per_chain[c][cursors[c]])
        cursors[c] += 1
    # Spread the statements through `length` words of filler.
    filler_words = 0
    pieces: list[str] = []
    gap = max(1, length // (len(order) + 1))
    for stmt in order:
        chunk: list[str] = []
        while sum(len(s.split()) for s in chunk) < gap:
            chunk.append(rng.choice(FILLER))
        filler_words += sum(len(s.split()) for s in chunk)
        pieces.extend(chunk)
        pieces.append(stmt)
    tail: list[str] = []
    while sum(len(s.split()) for s in tail) < gap:
        tail.append(rng.choice(FILLER))
    pieces.extend(tail)
    target = chains[0][-1]
    context = " ".join(pieces)
    prompt = (f"Memorize the values of the variables in the text below.\n\n{context}\n\n"
              f"Question: what is the value of VAR {target}? {BOX}")
    return {"prompt": prompt, "answer": str(values[target]),
            "meta": {"target": target, "hops": hops, "distractor_chains": n_distract,
                     "filler_words": filler_words + sum(len(s.split()) for s in tail)}}


GENERATORS: dict[str, Callable[..., dict]] = {"arith": gen_arith, "word": gen_word, "vartrack": gen_vartrack}


def make_math_task(family: str, seed: int, index: int, level: int, length: int = 512) -> dict:
    """One task record `{"id","prompt","answer","task","difficulty","meta"}`; deterministic."""
    if family not in GENERATORS:
        from sparse_rl.errors import UsageError

        raise UsageError(f"unknown math task family '{family}' (known: {', '.join(GENERATORS)})")
    rng = random.Random(f"{seed}:{family}:{index}")
    kw = {"length": length} if family == "vartrack" else {}
    body = GENERATORS[family](rng, level, **kw)
    meta = {"level": level, "seed": seed, "index": index, **body["meta"]}
    return {"id": f"math-{family}-s{seed}-{index:06d}", "prompt": body["prompt"], "answer": body["answer"],
            "task": f"math/{family}", "difficulty": level, "meta": meta}


def corrupt_answer(answer: str) -> str:
    """A wrong answer of the same kind (used to prove the verifier can fail)."""
    try:
        return str(int(answer) + 1)
    except ValueError:
        return answer + "x"


def verify_math(answer: str, completion: str) -> float:
    """1.0 if `completion`'s final answer equals the gold `answer`, else 0.0: the project's one answer
    rule (`sparse_rl.eval.answers.answer_verdict`, math-verify with boxed answers first)."""
    from sparse_rl.eval.answers import answer_verdict

    return answer_verdict(completion, answer) or 0.0
