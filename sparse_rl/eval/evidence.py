"""The evidence recipe's own bookkeeping (recipes/evidence/): held-out accuracy from completion
files, the bf16 hand-off between parts, and results.json + RESULTS.md built from the runs' files.

Nothing here measures a model: every number in the report is read from a file a stage wrote
(metrics.jsonl, summary.json, the scored completions), and `report` names the file of each.

Layout of the recipe's OUT dir (what `report` reads):

    part1/sft.run/metrics.jsonl          SFT loss curve
    part1/handoff/                       the sparse SFT policy, bf16 shards (part 2's input)
    part2/grpo-<mode>/metrics.jsonl      GRPO curves: reward, mismatch_kl, mismatch_p5_ratio, eval_accuracy
    part2/handoff/<policy>/              each final policy, bf16 shards (+ adapter/ for sparse+distill)
    part3/<policy>/acc-<attention>.json  held-out accuracy, dense and sparse inference
    part3/<policy>/fidelity/summary.json token KL, acceptance mean / p5 (overall and by position)
    part3/<policy>/niah/summary.json     NIAH grid, dense vs sparse
    part3/<policy>/completions-*.jsonl   also read hop by hop: the look-up retrieval grid (eval.retrieval)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sparse_rl.errors import SparseRLError

MODES = {"dense": "dense rollouts", "sparse": "sparse rollouts, no correction",
         "sparse-tis": "sparse + truncated IS", "sparse-distill": "sparse + LoRA distillation + oversampling"}
POLICIES = ["sft", *MODES]
TIMES = ("time_rollout", "time_dense_forward", "time_update", "time_distill", "time_step")
CURVES = {"reward": "mean reward of the step's rollouts", "eval_accuracy": "held-out accuracy (GRPO's eval)",
          "mismatch_p5_ratio": "p5 of min(1, pi/mu) over rollout tokens", "mismatch_kl": "token KL(mu || pi)"}
SHARD = "16MB"


def score(completions: str | Path, tasks: str | Path) -> dict:
    """Held-out accuracy of a completions JSONL against its tasks (joined on id) with the synth verifier
    (for `retrieval/lookup`: the last `Answer:` code equals the gold code exactly)."""
    from sparse_rl.io import iter_jsonl
    from sparse_rl.synth.verify import verify

    gold = {t["id"]: t for t in iter_jsonl(tasks, required=("id",))}
    scores = []
    for c in iter_jsonl(completions, required=("id", "completion")):
        if c["id"] not in gold:
            raise SparseRLError(f"{completions}: completion id {c['id']!r} is not in {tasks}")
        scores.append(verify(gold[c["id"]], c["completion"]))
    if not scores:
        raise SparseRLError(f"{completions}: no completions")
    return {"accuracy": sum(scores) / len(scores), "n": len(scores), "completions": str(completions)}


def score_file(completions: str | Path, tasks: str | Path, dst: str | Path) -> dict:
    """`score`, written to the JSON file `dst` (atomically)."""
    from sparse_rl.io import atomic_write_json

    res = score(completions, tasks)
    atomic_write_json(dst, res)
    return res


def handoff(src: str | Path, dst: str | Path, adapter: str | Path | None = None) -> dict:
    """Copy a model dir as bf16 safetensors shards of <= 16 MB (the next part's input), atomically;
    the sparse config, indexer weights (as bf16) and a LoRA adapter dir (to `dst/adapter/`) come along."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from sparse_rl.io import atomic_dir
    from sparse_rl.sparse.config import INDEXER_WEIGHTS
    from sparse_rl.sparse.loader import load_tokenizer

    src, dst = Path(src), Path(dst)
    with atomic_dir(dst, force=True, flag="handoff") as tmp:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
        model.save_pretrained(tmp, max_shard_size=SHARD)
        load_tokenizer(src).save_pretrained(tmp)
        for name in ("sparse_config.json", "generation_config.json"):
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        if (src / INDEXER_WEIGHTS).is_file():
            idx = load_file(str(src / INDEXER_WEIGHTS))
            save_file({k: v.to(torch.bfloat16) for k, v in idx.items()}, str(tmp / INDEXER_WEIGHTS))
        if adapter is not None:
            shutil.copytree(adapter, tmp / "adapter")
    return {"dir": str(dst), "mb": dir_mb(dst)}


def dir_mb(path: str | Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**20


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _heldout(out: Path) -> Path | None:
    """The held-out tasks of a run dir (part 3's copy; part 1's when the hand-offs are not kept)."""
    for p in ("part2/handoff/heldout.jsonl", "part1/handoff/heldout.jsonl", "part1/heldout.jsonl"):
        if (out / p).is_file():
            return out / p
    return None


def _hops(completions: Path, tasks: Path | None) -> dict | None:
    from sparse_rl.eval.retrieval import hop_grid_files

    if tasks is None or not completions.is_file():
        return None
    return hop_grid_files(completions, tasks)


def collect(out: str | Path) -> dict:
    """Every number of the report, each with the file it came from."""
    out = Path(out)
    heldout = _heldout(out)
    res: dict = {"out": str(out), "policies": {}, "grpo": {}}
    sft = _jsonl(out / "part1" / "sft.run" / "metrics.jsonl")
    res["sft"] = {"first_loss": sft[0]["loss"] if sft else None, "final_loss": sft[-1]["loss"] if sft else None,
                  "steps": sft[-1]["step"] if sft else None, "file": "part1/sft.run/metrics.jsonl"}
    res["sizes"] = _json(out / "sizes.json")
    res["provenance"] = _json(out / "provenance.json") or {}
    for mode in MODES:
        m = _jsonl(out / "part2" / f"grpo-{mode}" / "metrics.jsonl")
        if not m:
            continue
        evals = [r["eval_accuracy"] for r in m if r.get("eval_accuracy") is not None]
        res["grpo"][mode] = {
            "steps": m[-1]["step"], "reward_first": m[0].get("reward"), "reward_last": m[-1].get("reward"),
            "mismatch_kl_mean": _mean(r.get("mismatch_kl") for r in m),
            "mismatch_p5_ratio_mean": _mean(r.get("mismatch_p5_ratio") for r in m),
            "mismatch_p5_ratio_min": min((r["mismatch_p5_ratio"] for r in m if r.get("mismatch_p5_ratio") is not None),
                                         default=None),
            "eval_accuracy_last": evals[-1] if evals else None,
            "rollout_tokens_per_s": _mean(r.get("rollout_tokens_per_s") for r in m),
            "time_per_step": {k.removeprefix("time_"): _mean(r.get(k) for r in m) for k in TIMES},
            "wall_s": (_json(out / ".done" / f"p2-grpo-{mode}") or {}).get("seconds"),
            "file": f"part2/grpo-{mode}/metrics.jsonl"}
    for pol in POLICIES:
        d = out / "part3" / pol
        if not d.is_dir():
            continue
        acc = {a: (_json(d / f"acc-{a}.json") or {}).get("accuracy") for a in ("dense", "sparse")}
        fid = _json(d / "fidelity" / "summary.json") or {}
        niah = _json(d / "niah" / "summary.json") or {}
        hops = {a: _hops(d / f"completions-{a}.jsonl", heldout) for a in ("dense", "sparse")}
        res["policies"][pol] = {
            "accuracy_dense": acc["dense"], "accuracy_sparse": acc["sparse"],
            "token_kl": fid.get("kl"), "acceptance_mean": fid.get("acceptance_mean"),
            "acceptance_p5": fid.get("acceptance_p5"),
            "acceptance_p5_by_position": [(b["from"], b["to"], b.get("acceptance_p5")) for b in fid.get("by_position", [])],
            "niah_dense": (niah.get("modes", {}).get("dense") or {}).get("mean"),
            "niah_sparse": (niah.get("modes", {}).get("sparse") or {}).get("mean"),
            "hops_dense": hops["dense"], "hops_sparse": hops["sparse"],
            "files": f"part3/{pol}/"}
    return res


def curves(out: str | Path, dst: str | Path) -> dict[str, str]:
    """One PNG per GRPO metric of CURVES in `dst`, a line per mode over steps (a gap where a mode has
    no value at a step, e.g. between evals). Returns {metric: file name}."""
    from sparse_rl.eval.plots import line_plot

    out, dst = Path(out), Path(dst)
    runs = {mode: _jsonl(out / "part2" / f"grpo-{mode}" / "metrics.jsonl") for mode in MODES}
    runs = {m: r for m, r in runs.items() if r}
    files: dict[str, str] = {}
    for key, label in CURVES.items():
        by_mode = {m: {r["step"]: r[key] for r in rows if r.get(key) is not None} for m, rows in runs.items()}
        steps = sorted({st for v in by_mode.values() for st in v})
        if not steps:
            continue
        series = {MODES[m]: [v.get(st, float("nan")) for st in steps] for m, v in by_mode.items() if v}
        dst.mkdir(parents=True, exist_ok=True)
        line_plot(steps, series, dst / f"grpo_{key}.png", title=label, xlabel="GRPO step", ylabel=key)
        files[key] = f"grpo_{key}.png"
    return files


def _f(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _policy(pol: str) -> str:
    return "SFT (start of GRPO)" if pol == "sft" else MODES[pol]


def _all(grid: dict | None):
    return None if grid is None else grid.get("all")


def _bin_labels(grid: dict) -> list[str]:
    return [f"{lo:.2f}–{hi:.2f}" for lo, hi in grid["bins"]]


def _bins(res: dict) -> list[str]:
    """The depth-bin labels of the run's hop grids (every grid of a report has the same bins)."""
    grids = [p.get(f"hops_{a}") for p in res["policies"].values() for a in ("dense", "sparse")]
    return next((_bin_labels(g) for g in grids if g), [])


def retrieval_maps(res: dict, dst: str | Path) -> dict[str, str]:
    """Per policy, the [hop, depth] grid of sparse inference minus dense (a PNG each in `dst`)."""
    from sparse_rl.eval.plots import difference_map

    dst, files = Path(dst), {}
    for pol, p in res["policies"].items():
        d, sp = p.get("hops_dense"), p.get("hops_sparse")
        if not d or not sp:
            continue
        dst.mkdir(parents=True, exist_ok=True)
        name = f"hops_{pol}_sparse_minus_dense.png"
        difference_map(d["grid"], sp["grid"], [f"hop {j + 1}" for j in range(d["hops"])], _bin_labels(d), dst / name,
                       title=f"{_policy(pol)}: hop accuracy, sparse - dense", xlabel="depth of the row in the table",
                       ylabel="hop", name_a="dense", name_b="sparse")
        files[f"{pol}: hop accuracy, sparse - dense"] = name
    return files


def render(res: dict, commands: str, images: dict[str, str] | None = None, img_dir: str = ".",
           maps: dict[str, str] | None = None, seeds: list[dict] | None = None) -> str:
    """RESULTS.md from `collect`'s output, the commands that produced it and the plots (`images`:
    metric -> file name under `img_dir`, relative to the markdown file; `maps`: the retrieval
    difference maps; `seeds`: `collect` of further runs with other GRPO seeds, for the spread)."""
    s, pv = res.get("sizes") or {}, res.get("provenance") or {}
    lines = ["# Evidence: sparse rollouts, dense training (DistillSparse / Sparrow), one GPU", "",
             f"Generated by `{res.get('report_command') or 'python recipes/evidence/report.py ' + res['out']}` "
             "from the run's own files "
             f"(SIZE={s.get('SIZE', '?')}); no number below was typed by hand.", "",
             f"Run: {pv.get('date', '?')} on {pv.get('device', '?')} (torch {pv.get('torch', '?')}), "
             f"code at commit {pv.get('commit', '?')}.", "",
             "## Held-out accuracy and fidelity of each final policy", "",
             "| policy | acc dense | acc sparse | hop retrieval dense | hop retrieval sparse | token KL | "
             "acceptance mean | acceptance p5 | NIAH dense | NIAH sparse |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for pol, p in res["policies"].items():
        hd, hs = (_all(p.get(f"hops_{a}")) for a in ("dense", "sparse"))
        lines.append(f"| {_policy(pol)} | {_f(p['accuracy_dense'])} | {_f(p['accuracy_sparse'])} | {_f(hd)} | {_f(hs)} | "
                     f"{_f(p['token_kl'], 4)} | {_f(p['acceptance_mean'])} | {_f(p['acceptance_p5'])} | "
                     f"{_f(p['niah_dense'])} | {_f(p['niah_sparse'])} |")
    lines += ["", "Hop retrieval: the fraction of look-up hops whose `KEY -> VALUE` line is right given that the "
              "earlier hops were (`sparse_rl.eval.retrieval`, the held-out completions above); by depth of the row "
              "in the table and by hop below."]
    lines += ["", "## GRPO runs (same seed, data and step budget)", "",
              "| mode | steps | reward first → last | mismatch KL (mean over steps) | p5 of π/μ, mean over steps | "
              "min p5 of π/μ | eval acc (last) |",
              "|---|---|---|---|---|---|---|"]
    for mode, g in res["grpo"].items():
        lines.append(f"| {MODES[mode]} | {g['steps']} | {_f(g['reward_first'])} → {_f(g['reward_last'])} | "
                     f"{_f(g['mismatch_kl_mean'], 5)} | {_f(g.get('mismatch_p5_ratio_mean'))} | {_f(g['mismatch_p5_ratio_min'])} | {_f(g['eval_accuracy_last'])} |")
    lines += ["", "## Rollout speed and step time (means over steps; seconds)", "",
              "| mode | rollout tokens/s | rollout | dense forward | update | distill | step | stage wall |",
              "|---|---|---|---|---|---|---|---|"]
    for mode, g in res["grpo"].items():
        t = g.get("time_per_step") or {}
        lines.append(f"| {MODES[mode]} | {_f(g.get('rollout_tokens_per_s'), 0)} | " + " | ".join(
            _f(t.get(k), 2) for k in ("rollout", "dense_forward", "update", "distill", "step")) + f" | {_f(g.get('wall_s'), 0)} |")
    lines += ["", "## Curves", ""]
    for key, name in (images or {}).items():
        lines.append(f"![{CURVES.get(key, key)}]({img_dir}/{name})")
    bins = _bins(res)
    lines += ["", "## Retrieval by depth and hop (the look-up task's needle-in-a-haystack grid)", "",
              "Conditional hop accuracy per depth bin of the retrieved row (0 = the table's first row), "
              "all hops together, dense / sparse inference:", "",
              "| policy | " + " | ".join(bins) + " |", "|---|" + "---|" * len(bins)]
    for pol, p in res["policies"].items():
        d, sp = ((p.get(f"hops_{a}") or {}).get("by_depth") or [] for a in ("dense", "sparse"))
        lines.append(f"| {_policy(pol)} | " + " | ".join(f"{_f(x)} / {_f(y)}" for x, y in zip(d, sp)) + " |")
    for key, name in (maps or {}).items():
        lines.append(f"\n![{key}]({img_dir}/{name})")
    lines += ["", "NIAH heatmaps: `part3/<policy>/niah/heatmap_dense.png`, `heatmap_sparse.png`, "
              "`diff_sparse_minus_dense.png` of the run dir.", "",
              "## Acceptance p5 by position (sparse policy's own completions)", ""]
    for pol, p in res["policies"].items():
        cells = ", ".join(f"{a}–{b}: {_f(v)}" for a, b, v in p["acceptance_p5_by_position"])
        lines.append(f"- {pol}: {cells or '—'}")
    if seeds:
        lines += spread_lines([res, *seeds])
    sft = res["sft"]
    lines += ["", f"SFT: loss {_f(sft['first_loss'])} → {_f(sft['final_loss'])} in {sft['steps']} steps "
              f"({sft['file']}).", "", "## Commands", "", "```bash", commands.rstrip(), "```", ""]
    return "\n".join(lines)


SPREAD = (("final acc, dense inference", "policies", "accuracy_dense"),
          ("final acc, sparse inference", "policies", "accuracy_sparse"),
          ("hop retrieval, sparse inference", "policies", "hops_sparse"),
          ("GRPO reward, last step", "grpo", "reward_last"),
          ("p5 of π/μ, mean over steps", "grpo", "mismatch_p5_ratio_mean"),
          ("min p5 of π/μ", "grpo", "mismatch_p5_ratio_min"),
          ("mismatch KL, mean", "grpo", "mismatch_kl_mean"))


def _seed(res: dict):
    return (res.get("sizes") or {}).get("grpo_seed", 0)


def spread_lines(runs: list[dict]) -> list[str]:
    """A table per mode of each SPREAD metric over runs that differ in the GRPO seed: mean (min–max)
    and every seed's value."""
    seeds = [_seed(r) for r in runs]
    lines = ["", f"## Spread over GRPO seeds ({', '.join(map(str, seeds))}; the same part-1 policy)", "",
             "mean (min–max) over the seeds; each seed's value in order after the colon.", "",
             "| mode | " + " | ".join(label for label, _, _ in SPREAD) + " |", "|---|" + "---|" * len(SPREAD)]
    for mode in MODES:
        cells = []
        for _, where, key in SPREAD:
            vals = [((r[where].get(mode) or {}).get(key)) for r in runs]
            vals = [_all(v) if isinstance(v, dict) else v for v in vals]
            got = [v for v in vals if v is not None]
            digits = 4 if key == "mismatch_kl_mean" else 3
            cells.append("—" if not got else f"{_f(_mean(got), digits)} ({_f(min(got), digits)}–"
                         f"{_f(max(got), digits)}): " + ", ".join(_f(v, digits) for v in vals))
        lines.append(f"| {MODES[mode]} | " + " | ".join(cells) + " |")
    return lines


def report(out: str | Path, md: str | Path | None = None, seeds: list[str | Path] | None = None,
           preface: str | Path | None = None) -> dict:
    """Write OUT/results.json and RESULTS.md (OUT/RESULTS.md, or `md`); `seeds`: run dirs of the same
    recipe with other GRPO seeds (EV_GRPO_SEED) from the same part-1 hand-off, shown as a spread;
    `preface`: a markdown file (a reader's summary of the findings) placed under the title."""
    from sparse_rl.io import atomic_write_json, atomic_write_text

    out = Path(out)
    md = Path(md) if md else out / "RESULTS.md"
    res = collect(out)
    atomic_write_json(out / "results.json", res)
    others = [collect(p) for p in seeds or []]
    res["report_command"] = " ".join(["python recipes/evidence/report.py", str(out), *(["--seeds", *map(str, seeds)] if seeds else []),
                                      *(["--preface", str(preface)] if preface else []), *(["--md", str(md)])])
    cmds = (out / "commands.sh").read_text() if (out / "commands.sh").is_file() else ""
    img_dir = md.parent / "evidence"  # the plots travel with the markdown (docs/evidence/ for docs/RESULTS.md)
    images = curves(out, img_dir)
    maps = retrieval_maps(res, img_dir)
    text = render(res, cmds, images, "evidence", maps, others)
    if preface:
        title, rest = text.split("\n", 1)
        text = f"{title}\n\n{Path(preface).read_text().strip()}\n\n## The generated report\n{rest}"
    atomic_write_text(md, text)
    return res
