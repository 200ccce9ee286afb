"""Final-answer extraction from completions and gold answers, and answer equivalence.

Extraction (from a model's completion), first match wins:
  1. the last `\\boxed{...}` / `\\fbox{...}` (balanced braces, so `\\boxed{\\frac{1}{2}}` works);
  2. GSM8K's `#### N` marker (the last one);
  3. "the answer is X" (the last occurrence; X is a `$...$` span, else the leading number or word);
  4. the last number in the text.
Equivalence is decided by math-verify (`verify(gold, pred)`, gold first, as its API asks) when it
can parse both sides; when it cannot parse one of them we fall back to comparing the last numbers
of both strings, then normalised strings. Purely textual gold answers (names, option letters)
skip math-verify, whose LaTeX parser would read "abc" as the product a*b*c and call "cba" equal.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from fractions import Fraction

# A number as models write it: sign, thousands separators, decimals, an optional fraction part.
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*[:=]?\s*", re.IGNORECASE)
_DOLLAR_RE = re.compile(r"\$+([^$]+)\$+")
_TEXTUAL_RE = re.compile(r"^[A-Za-z][A-Za-z _\-'.]*$")


@dataclass(frozen=True)
class Extracted:
    """An extracted answer string and how it was found (boxed, hashes, answer_is, last_number)."""

    answer: str | None
    method: str  # "boxed" | "hashes" | "answer_is" | "last_number" | "none"


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (brace-balanced), or `\\boxed N`; None if absent."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if depth == 0:
                best = text[i + 1 : j].strip()
        else:  # "\boxed 5" form: up to the next whitespace or "$"
            tail = re.match(r"[^\s$]+", text[i:])
            if tail:
                best = tail.group(0).strip()
    return best


def last_number(text: str) -> str | None:
    """The last number in `text` with thousands separators removed ("1,234.5" -> "1234.5"), or None."""
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "").replace(" ", "").rstrip(".")


def _clean_tail(s: str) -> str:
    s = s.strip()
    dollar = _DOLLAR_RE.search(s)
    if dollar:
        return dollar.group(1).strip()
    num = re.match(r"\s*(" + _NUMBER + r")", s)
    if num:
        return num.group(1).replace(",", "")
    # A word answer ("the answer is Paris."): up to the sentence end.
    return re.split(r"[.\n;,]\s|[.\n]$|\n", s, maxsplit=1)[0].strip().rstrip(".")


def extract_answer(completion: str) -> Extracted:
    """Find the final answer in a model completion (see the module docstring for the order)."""
    boxed = last_boxed(completion)
    if boxed:
        return Extracted(boxed, "boxed")
    hashes = _HASHES_RE.findall(completion)
    if hashes and hashes[-1].strip():
        return Extracted(_clean_tail(hashes[-1]), "hashes")
    spans = list(_ANSWER_IS_RE.finditer(completion))
    if spans:
        tail = completion[spans[-1].end():]
        ans = _clean_tail(tail)
        if ans:
            return Extracted(ans, "answer_is")
    num = last_number(completion)
    if num is not None:
        return Extracted(num, "last_number")
    return Extracted(None, "none")


def gold_answer(value) -> str:
    """Normalise a gold answer field: numbers as text, GSM8K "... #### 72" -> "72", MATH solutions
    -> their last boxed content, anything else as the stripped string."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"expected a string or a number as the answer, got {value!r}")
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a string or a number as the answer, got {type(value).__name__}")
    if "####" in value:
        tail = value.rsplit("####", 1)[1].strip()
        return tail.replace(",", "") if _NUMBER_RE.fullmatch(tail) else tail
    boxed = last_boxed(value)
    if boxed:
        return boxed
    return value.strip()


def _normalise_text(s: str) -> str:
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.replace("$", "").strip().strip(".").strip()
    s = re.sub(r"^\((.*)\)$", r"\1", s)
    return re.sub(r"\s+", " ", s).lower()


def _numbers_equal(a: str, b: str) -> bool:
    try:
        fa, fb = Fraction(a.replace(" ", "")), Fraction(b.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return False
    return math.isclose(float(fa), float(fb), rel_tol=1e-6, abs_tol=1e-9)


def _mv_parse(s: str):
    """math-verify parse, reading the string as LaTeX (inside $...$) first, then as a plain expression."""
    from math_verify import parse

    if "$" in s or "\\boxed" in s:
        return parse(s)
    return parse(f"${s}$") or parse(s)


def is_equivalent(gold: str, pred: str | None) -> bool:
    """True if `pred` is the same answer as `gold` ("1/2" == "0.5" == "\\frac{1}{2}", "1,000" == "1000")."""
    if pred is None or not pred.strip():
        return False
    if _TEXTUAL_RE.match(gold.strip()):
        return _normalise_text(gold) == _normalise_text(pred)
    from math_verify import verify

    # math-verify logs its own parse failures at warning level; we handle them below.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    g, p = _mv_parse(gold), _mv_parse(pred)
    if g and p:
        return bool(verify(g, p))
    gn, pn = last_number(gold), last_number(pred)
    if gn is not None and pn is not None:
        return _numbers_equal(gn, pn)
    return _normalise_text(gold) == _normalise_text(pred)
