"""The one answer rule: final-answer extraction and equivalence, shared by every scorer.

`reward=math` (rl/rewards.py), the synth verifiers (synth/math_tasks.py, synth/envs/base.py) and
`eval math` all call `answer_verdict(completion, gold)`, so a completion gets the same score
wherever it is scored. The rule is math-verify's (huggingface/Math-Verify), configured as its own
test suite compares answers (`compare_strings` in its tests/test_all.py, the latex + expression
targets):

  - both sides are parsed with `[LatexExtractionConfig(boxed_match_priority=0),
    ExprExtractionConfig()]`: `\\boxed{}` answers first (all of them: `\\boxed{1}\\boxed{2}` is the
    set {1, 2}), then other LaTeX (`$...$`, `\\(...\\)`, "the final answer is"), then plain
    expressions; the last match in the text wins;
  - a gold without LaTeX delimiters (a dataset's answer field: `(1,3)`, `\\sqrt3`, `10\\%`, `2x+1`)
    is read inside `$...$`, the way the dataset means it (bare, math-verify extracts nothing from
    `(1,3)` and only the 2 of `2x+1`); a plain number (`1,000`, `-2.5`) is read bare;
  - `verify(gold, pred)`, gold first as its API asks, default precision (6 decimals), strict.

Our deliberate differences, each where math-verify gives no verdict or a meaningless one:
  - a prediction from which math-verify extracts nothing, against a gold that is a plain number, is
    scored by the last number in the completion (GSM8K-style "... so 72 apples");
  - a gold that is a word or phrase of two or more letters ("Paris", "Tuesday") is compared as
    normalised text with the completion's final answer (last `\\boxed{}`, else the text after
    "answer is", else the last line), because math-verify's LaTeX parser reads "Paris" as the
    product P*a*r*i*s and would accept "sirap";
  - math-verify raising on a pathological expression is a wrong answer (0), not a crash.
A gold that neither parse nor these rules can read gives no verdict (None).

`extract_answer(completion)` reports what was extracted (for `eval math`'s per-sample records).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from functools import lru_cache

# A plain number as a gold answer field holds it: sign, digits with proper thousands groups, decimals.
_PLAIN_NUMBER_RE = re.compile(r"^\s*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*$")
# The numbers of a free-text completion (for the plain-number fallback only).
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_TEXTUAL_RE = re.compile(r"^[A-Za-z][A-Za-z _\-'.]*[A-Za-z.]$")
_DELIMITED_RE = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*[:=]?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class Extracted:
    """An extracted answer string and how it was found: math_verify | last_number | text | none."""

    answer: str | None
    method: str


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere run without.
    return 5 if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=1)
def _config():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # math-verify logs its own parse failures at warning level; a failure here is just "no answer".
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _parse(text: str) -> list:
    from math_verify import parse

    try:
        return parse(text, _config(), parsing_timeout=_timeout())
    except Exception:  # noqa: BLE001 - a parser crash on odd input is "nothing extracted"
        return []


@lru_cache(maxsize=4096)
def parse_gold(gold: str) -> tuple:
    """math-verify's parse of a gold answer. A plain number (`1,000`) is read bare; any other gold
    without LaTeX delimiters inside `$...$` first (bare, math-verify's expression extraction reads
    `2x+1` as 2), each falling back to the other."""
    if _DELIMITED_RE.search(gold):
        return tuple(_parse(gold))
    forms = (gold, f"${gold}$") if _PLAIN_NUMBER_RE.match(gold) else (f"${gold}$", gold)
    for form in forms:
        parsed = _parse(form)
        if parsed:
            return tuple(parsed)
    return ()


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (brace-balanced), or None."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            best = text[m.end():j - 1].strip()
    return best


def last_number(text: str) -> str | None:
    """The last number in `text`, thousands separators removed ("1,234.5" -> "1234.5"); None if none."""
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def _final_text(completion: str) -> str:
    """A completion's final answer as text: last \\boxed{}, else after the last "answer is", else the last line."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    spans = list(_ANSWER_IS_RE.finditer(completion))
    if spans:
        return re.split(r"[\n]|[.;,](?:\s|$)", completion[spans[-1].end():].strip(), maxsplit=1)[0]
    lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _norm_text(s: str) -> str:
    s = re.sub(r"\\text(?:bf|rm|it)?\{([^}]*)\}", r"\1", s)
    s = s.replace("$", "").strip().strip(".*`'\"").strip()
    return re.sub(r"\s+", " ", s).casefold()


def is_textual(gold: str) -> bool:
    """A word or phrase answer ("Paris", "New York"): two or more letters, no digits or LaTeX."""
    return bool(_TEXTUAL_RE.match(gold.strip()))


def extract_answer(completion: str, gold: str | None = None) -> Extracted:
    """What the rule reads as `completion`'s final answer (given `gold`, the same path the verdict takes)."""
    if gold is not None and is_textual(gold):
        text = _final_text(completion)
        return Extracted(text or None, "text" if text else "none")
    parsed = _parse(completion)
    if parsed:
        return Extracted(str(parsed[-1]), "math_verify")
    if gold is None or _PLAIN_NUMBER_RE.match(gold):
        num = last_number(completion)
        if num is not None:
            return Extracted(num, "last_number")
    return Extracted(None, "none")


def _verify(gold, pred) -> bool:
    from math_verify import verify

    try:
        return bool(verify(list(gold), list(pred), timeout_seconds=_timeout()))
    except Exception:  # noqa: BLE001 - math-verify can raise on pathological expressions: a wrong answer
        return False


def answer_verdict(completion: str, gold) -> float | None:
    """1.0 if `completion`'s final answer equals `gold` under the rule above, 0.0 if not, None if
    the gold cannot be read at all. `gold` may be a string or a number."""
    gold_text = gold_string(gold)
    if is_textual(gold_text):
        return 1.0 if _norm_text(_final_text(completion)) == _norm_text(gold_text) else 0.0
    g = parse_gold(gold_text)
    if not g:
        return None
    pred = _parse(completion)
    if pred:
        return 1.0 if _verify(g, pred) else 0.0
    if _PLAIN_NUMBER_RE.match(gold_text):
        num = last_number(completion)
        if num is not None:
            return 1.0 if _verify(g, _parse(num)) else 0.0
    return 0.0


def gold_string(value) -> str:
    """A gold answer as text: numbers as written, strings stripped. Raises ValueError for anything else."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"expected a string or a number as the answer, got {value!r}")
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a string or a number as the answer, got {type(value).__name__}")
    return value.strip()


def gold_answer(value) -> str:
    """A problem record's gold field as an answer: GSM8K's "... #### 72" -> "72", a MATH solution ->
    its last `\\boxed{}` content, anything else as `gold_string`."""
    text = gold_string(value)
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.replace(",", "") if _PLAIN_NUMBER_RE.match(tail) else tail
    return text
