"""Built-in text, generated procedurally, so that tokenizers and tiny models need no download.

It mixes plain sentences, numbers and arithmetic, chat-style turns and key-value facts, which is
what the demo, the synthetic tasks and the long-context sources are made of: a tokenizer trained on
it splits all of them into sensible pieces.
"""

from __future__ import annotations

import random

SUBJECTS = ["the cat", "a farmer", "the river", "my neighbour", "the old clock", "a student", "the train",
            "the committee", "a small bird", "the engineer", "our teacher", "the market", "a sailor",
            "the library", "the garden", "a young doctor", "the city council", "the baker"]
VERBS = ["watched", "counted", "carried", "painted", "followed", "measured", "repaired", "visited", "found",
         "described", "remembered", "opened", "sold", "bought", "wrote about", "waited for"]
OBJECTS = ["the apples", "seven boxes", "the long road", "a blue door", "the morning light", "twelve letters",
           "the broken fence", "a quiet room", "the numbers", "the mountains", "a paper map", "the old bridge",
           "the harvest", "three baskets", "a red kite", "the evening news"]
ADVERBS = ["slowly", "carefully", "again", "yesterday", "at noon", "before dinner", "in silence", "every day",
           "with care", "once more", "near the station", "after the rain"]
NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack", "Kate", "Liam"]
ITEMS = ["apples", "pencils", "coins", "books", "marbles", "tickets", "cookies", "stamps", "eggs", "cards"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ADVERBS)}."
    return s[0].upper() + s[1:]


def arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    val = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b} = {val}"


def word_problem(rng: random.Random) -> str:
    n, a, b = rng.choice(NAMES), rng.randint(2, 50), rng.randint(2, 50)
    item = rng.choice(ITEMS)
    return (f"{n} has {a} {item} and buys {b} more. How many {item} does {n} have now? "
            f"{n} has {a} + {b} = {a + b} {item}. The answer is {a + b}.")


def fact(rng: random.Random) -> str:
    key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
    return f"The value of {key} is {rng.randint(0, 99999)}. The special magic number for {key} is {rng.randint(0, 9999)}."


def chat(rng: random.Random) -> str:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return (f"<|im_start|>user\nWhat is {a} plus {b}?<|im_end|>\n<|im_start|>assistant\n"
            f"{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}.<|im_end|>\n")


def builtin_text(n_paragraphs: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic list of paragraphs (a few hundred KB at the default size)."""
    rng = random.Random(seed)
    makers = [sentence, sentence, sentence, arithmetic, word_problem, fact, chat]
    out = []
    for _ in range(n_paragraphs):
        out.append(" ".join(rng.choice(makers)(rng) for _ in range(rng.randint(3, 8))))
    return out
