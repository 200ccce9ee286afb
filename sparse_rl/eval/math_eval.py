"""`eval math`: score completions against gold answers; accuracy, pass@1 and unbiased pass@k.

Inputs are docs/DESIGN.md records. Problems: `{"id", "prompt"|"messages"|"question", "answer" |
"solution", "task"?}`; the gold answer may be GSM8K-style ("... #### 72"), contain `\\boxed{}`, or be
a plain value (our synth tasks). Completions: `{"id", "completion", ...}`; several records with the
same id are several samples of that problem. A completion record joins its problem through
`prompt_id` when it has one, else through `id`; a completion that carries `answer` itself needs no
problems file.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", eq. 1): with n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k), computed
as 1 - prod_{i=n-c+1..n} (1 - k/i) so that large n does not overflow.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.eval.answers import extract_answer, gold_answer, is_equivalent
from sparse_rl.io import iter_jsonl


@dataclass
class MathEvalConfig:
    """Options of `sparse-rl eval math` (YAML keys = these names)."""

    problems: Optional[str] = None  # problems/tasks JSONL with gold answers
    score: Optional[str] = None  # completions JSONL to score ("-" = stdin)
    out: Optional[str] = None  # per-problem results JSONL (not written when unset)
    summary: Optional[str] = None  # summary JSON file (always printed on stdout too)
    k: list[int] = field(default_factory=list)  # pass@k values; empty = 1, 2, 4, ... up to the fewest samples
    # Sampling from a model instead of --score (through the rollout engine):
    model: Optional[str] = None  # model dir (dense or sparse)
    attention: str = "dense"  # dense | sparse
    samples: int = 1  # completions sampled per problem
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0
    chat: bool = False  # wrap a plain `prompt` as a user message through the chat template
    batch_size: int = 32  # decode slots of the engine
    device: str = "auto"
    dtype: str = "auto"
    completions_out: Optional[str] = None  # also write the sampled completions JSONL here


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `n` samples, `c` of them correct (Chen et al. 2021)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def load_problems(path: str | Path) -> dict[str, dict]:
    """Read a problems JSONL into {id: {"gold", "task"}}; errors name the file and line."""
    problems: dict[str, dict] = {}
    name = "<stdin>" if str(path) == "-" else str(path)
    for rec in iter_jsonl(path, required=("id",)):
        pid = str(rec["id"])
        raw = rec.get("answer", rec.get("solution"))
        if raw is None:
            raise SparseRLError(f"{name}: problem '{pid}' has no 'answer' (or 'solution') field to score against")
        try:
            gold = gold_answer(raw)
        except ValueError as e:
            raise SparseRLError(f"{name}: problem '{pid}': {e}") from None
        if pid in problems:
            raise SparseRLError(f"{name}: problem id '{pid}' appears twice (ids must be unique)")
        prompt = {k: rec[k] for k in ("messages", "prompt") if k in rec}
        if not prompt and isinstance(rec.get("question"), str):  # GSM8K's own field name
            prompt = {"prompt": rec["question"]}
        problems[pid] = {"gold": gold, "task": rec.get("task"), "input": prompt}
    return problems


def score_completions(completions: Iterable[dict], problems: dict[str, dict] | None = None,
                      source: str = "completions") -> list[dict]:
    """Score completion records; return one per-problem record, in first-seen order.

    Each result: `{"id", "task", "gold", "n", "correct", "pass@1", "samples": [{"pred", "method",
    "correct"}]}`. Raises SparseRLError naming `source` and the record number for a record that
    cannot be scored (no completion text, unknown id, no gold answer).
    """
    grouped: dict[str, dict] = {}
    for i, rec in enumerate(completions, 1):
        if "id" not in rec:
            raise SparseRLError(f"{source} record {i}: missing field 'id'")
        text = rec.get("completion")
        if not isinstance(text, str):
            raise SparseRLError(f"{source} record {i}: missing or non-string field 'completion'")
        pid = str(rec.get("prompt_id", rec["id"]))
        if "answer" in rec and rec["answer"] is not None:
            try:
                gold = gold_answer(rec["answer"])
            except ValueError as e:
                raise SparseRLError(f"{source} record {i}: {e}") from None
            task = rec.get("task")
        elif problems is not None:
            if pid not in problems:
                raise SparseRLError(f"{source} record {i}: id '{pid}' is not in the problems file "
                                    f"(pass the problems file the prompts came from)")
            gold, task = problems[pid]["gold"], problems[pid]["task"]
        else:
            raise SparseRLError(f"{source} record {i}: no 'answer' in the record and no --problems file "
                                f"to join on 'id'")
        ext = extract_answer(text)
        ok = is_equivalent(gold, ext.answer)
        entry = grouped.setdefault(pid, {"id": pid, "task": task, "gold": gold, "samples": []})
        entry["samples"].append({"pred": ext.answer, "method": ext.method, "correct": ok})
    results = []
    for entry in grouped.values():
        n = len(entry["samples"])
        c = sum(s["correct"] for s in entry["samples"])
        results.append({"id": entry["id"], "task": entry["task"], "gold": entry["gold"], "n": n,
                        "correct": c, "pass@1": c / n, "samples": entry["samples"]})
    return results


def default_ks(min_n: int) -> list[int]:
    ks, k = [], 1
    while k <= min_n:
        ks.append(k)
        k *= 2
    return ks


def summarize(results: list[dict], ks: list[int] | None = None, problems: dict | None = None) -> dict:
    """Aggregate per-problem results: accuracy (over all samples), pass@1 and pass@k (means over
    problems), answer-extraction counts, per-task accuracy, and problems with no completion."""
    if not results:
        raise SparseRLError("no completions to score (the completions input is empty)")
    min_n = min(r["n"] for r in results)
    ks = sorted(set(ks)) if ks else default_ks(min_n)
    bad = [k for k in ks if k < 1 or k > min_n]
    if bad:
        raise UsageError(f"--k {bad[0]}: pass@k needs 1 <= k <= the fewest samples of any problem ({min_n})")
    samples = sum(r["n"] for r in results)
    correct = sum(r["correct"] for r in results)
    methods = Counter(s["method"] for r in results for s in r["samples"])
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        if r["task"] is not None:
            by_task[str(r["task"])].append(r)
    summary = {
        "problems": len(results),
        "samples": samples,
        "accuracy": correct / samples,
        "pass@1": sum(r["pass@1"] for r in results) / len(results),
        "pass@k": {str(k): sum(pass_at_k(r["n"], r["correct"], k) for r in results) / len(results) for k in ks},
        "extraction": dict(sorted(methods.items())),
        "by_task": {t: {"problems": len(rs), "accuracy": sum(r["correct"] for r in rs) / sum(r["n"] for r in rs)}
                    for t, rs in sorted(by_task.items())},
    }
    if problems is not None:
        seen = {r["id"] for r in results}
        summary["unscored_problems"] = sum(1 for pid in problems if pid not in seen)
    return summary


def sample_completions(cfg: MathEvalConfig, problems: dict[str, dict], progress: bool = True) -> list[dict]:
    """`cfg.samples` completions per problem from `cfg.model` through the rollout engine, as completion
    records `{"id", "prompt", "completion", "tokens", "finish_reason"}` (the problem's id repeated)."""
    from rich.console import Console
    from rich.progress import Progress

    from sparse_rl.devices import resolve_device
    from sparse_rl.rl.rollout import SamplingParams, encode_prompt, load_engine

    ids = list(problems)
    inputs = []
    for pid in ids:
        inp = problems[pid]["input"]
        if not inp:
            raise SparseRLError(f"--problems: problem '{pid}' has no 'prompt', 'messages' or 'question' to sample from")
        if cfg.chat and "messages" not in inp:
            inp = {"messages": [{"role": "user", "content": inp["prompt"]}]}
        inputs.append(inp)
    params = SamplingParams(samples=cfg.samples, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                            seed=cfg.seed, logprobs=False)
    eng = load_engine(cfg.model, attention=cfg.attention, device=resolve_device(cfg.device), dtype=cfg.dtype,
                      max_batch=max(cfg.batch_size, cfg.samples))
    tokens = [encode_prompt(eng.tokenizer, inp) for inp in inputs]
    with Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
        job = bar.add_task(f"sampling ({cfg.attention})", total=len(ids) * cfg.samples)
        outs = eng.generate(tokens, params, on_complete=lambda c: bar.advance(job))
    return [{"id": ids[c.prompt_index], "sample": c.sample_index,
             "prompt": inputs[c.prompt_index].get("prompt", inputs[c.prompt_index].get("messages")),
             "completion": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason} for c in outs]


def run(cfg: MathEvalConfig) -> tuple[dict, list[dict]]:
    """`eval math`: score completions from `--score`, or sample them from `--model`; every input
    is read and scored before `out`/`summary` are written (so bad input writes nothing).
    Returns (summary, per-problem results)."""
    if (cfg.score is None) == (cfg.model is None):
        raise UsageError("give --score FILE|- (completions to score, e.g. from `sparse-rl generate`) or MODEL "
                         "with --problems (sample and score), not both")
    for flag, value in (("--out", cfg.out), ("--summary", cfg.summary), ("--completions-out", cfg.completions_out)):
        if value == "-":
            raise UsageError(f"{flag} -: stdout carries the summary JSON; give {flag} a file path")
    if cfg.model is not None:
        if not cfg.problems:
            raise UsageError("--model needs --problems FILE: the problems to sample answers for")
        if cfg.attention not in ("dense", "sparse"):
            raise UsageError(f"--attention {cfg.attention}: expected dense or sparse")
        problems = load_problems(cfg.problems)
        completions = sample_completions(cfg, problems)
        results = score_completions(completions, problems, source="sampled completions")
        summary = summarize(results, cfg.k, problems)
        summary["sampling"] = {"model": cfg.model, "attention": cfg.attention, "n": cfg.samples,
                               "temperature": cfg.temperature, "top_p": cfg.top_p,
                               "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed}
        from sparse_rl.io import write_jsonl

        if cfg.completions_out:
            write_jsonl(cfg.completions_out, completions)
        return _write(cfg, summary, results)
    if cfg.problems == "-" and cfg.score == "-":
        raise UsageError("--problems and --score cannot both read stdin ('-'); give one of them as a file")
    problems = load_problems(cfg.problems) if cfg.problems else None
    source = "<stdin>" if cfg.score == "-" else cfg.score
    results = score_completions(iter_jsonl(cfg.score), problems, source=source)
    summary = summarize(results, cfg.k, problems)
    return _write(cfg, summary, results)


def _write(cfg: MathEvalConfig, summary: dict, results: list[dict]) -> tuple[dict, list[dict]]:
    from sparse_rl.io import atomic_write_json, write_jsonl

    if cfg.out:
        write_jsonl(cfg.out, results)
    if cfg.summary:
        atomic_write_json(cfg.summary, summary)
    return summary, results
