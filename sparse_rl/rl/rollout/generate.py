"""`sparse-rl generate`: prompts JSONL in, completions JSONL out, through the rollout engine.

Input records: `{"id", "prompt": str}` or `{"id", "messages": [{"role", "content"}, ...]}` (the
chat template is applied with the generation prompt); `task`, `answer`, `difficulty` and `meta` are
passed through so that `... | sparse-rl generate m --prompts - | sparse-rl eval math --score -` works.
Output records (docs/DESIGN.md): `{"id", "sample"? (when n > 1), "prompt" (the text the model saw),
"completion", "tokens", "logprobs"? (with --logprobs), "finish_reason", passthrough fields}`.

Streaming and bad input: a prompts *file* is read and validated completely before anything is
written (a bad line -> one error naming it, no output file). *Stdin* is read lazily in chunks; each
chunk is validated before it is generated and written, so a bad line stops the run with the same
error, but completions of earlier chunks have already gone to the output (to stdout they are
flushed per chunk; an output *file* is still only renamed into place when the whole run succeeds).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from sparse_rl.errors import SparseRLError, UsageError

PASSTHROUGH = ("task", "answer", "difficulty", "meta")


@dataclass
class GenerateConfig:
    """Options of `sparse-rl generate` (YAML keys = these names)."""

    attention: str = "dense"
    samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    batch_size: int = 32
    seed: int = 0
    logprobs: bool = False
    stop: list[str] = field(default_factory=list)
    device: str = "auto"
    dtype: str = "auto"
    max_seq_len: int | None = None
    compile: bool | None = None  # torch.compile the decode step (None: SPARSE_RL_COMPILE, else off)
    adapter: str | None = None  # a peft LoRA adapter dir merged into the engine's weights (grpo's distill phi)

    def __post_init__(self):
        if self.attention not in ("dense", "sparse"):
            raise UsageError(f"--attention {self.attention}: expected dense or sparse")
        if self.batch_size < 1:
            raise UsageError(f"--max-batch must be >= 1 (got {self.batch_size})")
        if self.samples > self.batch_size:
            raise UsageError(f"--samples {self.samples} exceeds --max-batch {self.batch_size} (the samples of a prompt decode together)")

    def sampling(self):
        from sparse_rl.rl.rollout.sampler import SamplingParams

        return SamplingParams(samples=self.samples, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, stop=list(self.stop), seed=self.seed,
                              logprobs=self.logprobs)


def _check_record(rec, name: str, lineno: int) -> dict:
    where = f"{name} line {lineno}"
    if not isinstance(rec, dict):
        raise SparseRLError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "id" not in rec:
        raise SparseRLError(f"{where}: missing field 'id'")
    if "prompt" not in rec and "messages" not in rec:
        raise SparseRLError(f"{where}: needs a 'prompt' (text) or 'messages' (chat) field")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise SparseRLError(f"{where}: 'messages' must be a non-empty list of objects with 'role' and 'content'")
    elif not isinstance(rec["prompt"], str) or not rec["prompt"]:
        raise SparseRLError(f"{where}: 'prompt' must be a non-empty string")
    return rec


def iter_prompts(path: str | Path) -> Iterator[dict]:
    """Validated prompt records of a JSONL file or stdin (`-`), lazily; errors name the line."""
    from sparse_rl.io import iter_jsonl

    return iter_jsonl(path, check=_check_record, flag="--prompts")


def completion_records(recs: list[dict], outs, prompt_texts: list[str], n: int, logprobs: bool) -> list[dict]:
    rows = []
    for c in outs:
        rec = recs[c.prompt_index]
        row = {"id": rec["id"]}
        if n > 1:
            row["sample"] = c.sample_index
        row.update(prompt=prompt_texts[c.prompt_index], completion=c.text, tokens=c.tokens)
        if logprobs:
            row["logprobs"] = [round(x, 6) for x in c.logprobs]
        row["finish_reason"] = c.finish_reason
        for k in PASSTHROUGH:
            if k in rec:
                row[k] = rec[k]
        rows.append(row)
    return rows


def _check_length(tokenizer, text: str, cap: int, rec: dict, prompts) -> None:
    """Refuse a prompt longer than the context before tokenising all of it: prefixes of doubling
    length are tokenised until one exceeds `cap` tokens or the prefix is the whole text, so a
    50 MB prompt costs about as much as `2 * cap` tokens of it, not minutes."""
    n = 4 * cap
    while n < len(text):
        if len(tokenizer(text[:n], add_special_tokens=False)["input_ids"]) >= cap:
            raise SparseRLError(f"--prompts {prompts}: the prompt of record {rec['id']!r} ({len(text)} characters) "
                                f"is longer than the context of {cap} tokens (max_seq_len)")
        n *= 2


def run_generate(model_dir: str | Path, prompts: str | Path, out: str | Path | None, cfg: GenerateConfig,
                 progress: Callable[[int, int | None], None] | None = None) -> dict:
    """Generate completions for every prompt record; returns a summary dict (counts, tokens)."""
    from sparse_rl.io import dumps, open_output
    from sparse_rl.rl.rollout.engine import encode_prompt, load_engine, render_prompt

    from_stdin = str(prompts) == "-"
    # a file is validated completely first, so bad input never produces an output file
    records: Iterable[dict] = iter_prompts(prompts) if from_stdin else list(iter_prompts(prompts))
    total = None if from_stdin else len(records)  # type: ignore[arg-type]
    if total == 0:
        raise SparseRLError(f"--prompts {prompts}: no prompt records")
    from sparse_rl.devices import resolve_device

    adapter = None
    if cfg.adapter:
        from sparse_rl.sparse.loader import load_adapter

        adapter = load_adapter(cfg.adapter)  # before the model loads: a bad dir fails fast
    eng = load_engine(model_dir, cfg.attention, resolve_device(cfg.device), cfg.dtype, cfg.batch_size,
                      cfg.max_seq_len, compile=cfg.compile)
    if adapter is not None:
        eng.load_lora(adapter[0], scaling=adapter[1])
    params = cfg.sampling()
    chunk = max(1, (4 * cfg.batch_size) // cfg.samples)  # prompts per engine call: a queue for the free slots
    it = iter(records)
    done = n_tokens = 0
    with open_output(out) as fh:
        while True:
            recs = list(itertools.islice(it, chunk))  # stdin: reads (and validates) only this chunk
            if not recs:
                break
            try:
                texts = [render_prompt(eng.tokenizer, r) for r in recs]
                for r, t in zip(recs, texts):
                    _check_length(eng.tokenizer, t, eng._cap(), r, prompts)
                ids = [encode_prompt(eng.tokenizer, r) for r in recs]
            except SparseRLError:
                raise
            except Exception as e:  # e.g. a tokenizer without a chat template, or malformed messages
                raise SparseRLError(f"--prompts {prompts}: cannot render a prompt of records {recs[0]['id']!r}.."
                                    f"{recs[-1]['id']!r} ({str(e).splitlines()[0][:160]})") from None
            outs = eng.generate(ids, params)
            for row in completion_records(recs, outs, texts, cfg.samples, cfg.logprobs):
                fh.write(dumps(row) + "\n")
            fh.flush()
            done += len(recs)
            n_tokens += sum(len(c.tokens) for c in outs)
            if progress:
                progress(done, total)
        if done == 0:  # inside the `with`: an output file is not created
            raise SparseRLError(f"--prompts {prompts}: no prompt records")
    return {"prompts": done, "completions": done * cfg.samples, "generated_tokens": n_tokens, "attention": cfg.attention}
