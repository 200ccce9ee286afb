"""`run_dir/metrics.jsonl` (one record per step) and the curves plot `run_dir/curves.png`.

`StepMetrics` is the one list of the per-step metric names: its fields are the keys of every
record, in order (always present; `null` where a quantity does not apply, e.g. distillation
metrics outside sparse+distill mode), plus `EVAL_KEYS` on steps with a held-out eval. A field's
metadata says how the trainer reduces it over processes: "token_mean" quantities are summed per
response token and divided by the global token count; `source` names where the update takes
them from (the policy loss's statistics, or the mismatch correction's under `key`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from sparse_rl.io import append_jsonl
from sparse_rl.runs import truncate_metrics


def _tok(source: str = "update", key: str | None = None):
    return field(default=None, metadata={"reduce": "token_mean", "source": source, "key": key})


@dataclass
class StepMetrics:
    """One GRPO step's record (see the module doc). Rollout-side rates cover all M samples of the
    scored groups; `*_kept` ones the kept n of the groups trained on."""

    step: int = 0
    epoch: int | None = None
    prompts_seen: int | None = None
    groups: int | None = None
    groups_sampled: int | None = None
    groups_skipped: int | None = None
    refills: int | None = None
    reward: float | None = None
    reward_kept: float | None = None
    accuracy: float | None = None
    accuracy_kept: float | None = None
    response_length: float | None = None
    response_length_kept: float | None = None
    truncated_frac: float | None = None
    loss: float | None = None
    entropy: float | None = _tok()
    kl_ref: float | None = _tok()
    kl_coef: float | None = None
    clip_frac: float | None = _tok("loss")
    clip_frac_low: float | None = _tok("loss")
    clip_frac_high: float | None = _tok("loss")
    approx_kl: float | None = _tok("loss")
    ratio_mean: float | None = _tok("loss")
    grad_norm: float | None = None
    mismatch_kl: float | None = None
    mismatch_kl_k1: float | None = None
    mismatch_p5_ratio: float | None = None
    is_mean_weight: float | None = _tok("correction", "mean_weight")
    is_frac_masked: float | None = _tok("correction", "frac_masked")
    is_frac_truncated: float | None = _tok("correction", "frac_truncated")
    distill_loss_before: float | None = None
    distill_loss_after: float | None = None
    distill_kl_before: float | None = None
    distill_kl_after: float | None = None
    distill_grad_norm: float | None = None
    rollout_tokens: int | None = None
    rollout_tokens_per_s: float | None = None
    time_rollout: float | None = None
    time_reward: float | None = None
    time_dense_forward: float | None = None
    time_update: float | None = None
    time_distill: float | None = None
    time_distill_measure: float | None = None
    time_step: float | None = None
    distill_time_frac: float | None = None

    def set(self, values: dict) -> None:
        """Set fields from a dict of metric values (e.g. distillation's); an unknown name is a bug."""
        for k, v in values.items():
            if k not in _NAMES:
                raise KeyError(f"{k!r} is not a StepMetrics field")
            setattr(self, k, v)

    def record(self) -> dict:
        return dataclasses.asdict(self)


STEP_KEYS = tuple(f.name for f in dataclasses.fields(StepMetrics))
_NAMES = frozenset(STEP_KEYS)
TOKEN_MEAN = tuple(f.name for f in dataclasses.fields(StepMetrics) if f.metadata.get("reduce") == "token_mean")
LOSS_STATS = tuple(f.name for f in dataclasses.fields(StepMetrics) if f.metadata.get("source") == "loss")
CORRECTION_STATS = {f.name: f.metadata["key"] for f in dataclasses.fields(StepMetrics)
                    if f.metadata.get("source") == "correction"}
EVAL_KEYS = ("eval_accuracy", "eval_reward", "eval_response_length", "eval_tasks")

PLOT_FILE = "curves.png"


def _clean(v):
    """JSON-safe: NaN/inf become null (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def append(run_dir: str | Path, record: dict) -> None:
    append_jsonl(Path(run_dir) / "metrics.jsonl", {k: _clean(v) for k, v in record.items()})


def read(run_dir: str | Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def truncate(run_dir: str | Path, last_step: int, log=None) -> None:
    """Drop a cut last line and the records after `last_step` (see `sparse_rl.runs.truncate_metrics`)."""
    truncate_metrics(run_dir, last_step, log)


_PANELS = (
    ("reward", ("reward", "reward_kept")),
    ("accuracy", ("accuracy", "accuracy_kept", "eval_accuracy")),
    ("response length (tokens)", ("response_length",)),
    ("entropy", ("entropy",)),
    ("KL to reference", ("kl_ref",)),
    ("clip fraction", ("clip_frac",)),
    ("mismatch KL(mu||pi)", ("mismatch_kl",)),
    ("p5 of min(1, pi/mu)", ("mismatch_p5_ratio",)),
    ("distillation KL", ("distill_kl_before", "distill_kl_after")),
    ("rollout tokens/s", ("rollout_tokens_per_s",)),
)
_TIMES = ("time_rollout", "time_reward", "time_dense_forward", "time_update", "time_distill")


def plot(run_dir: str | Path) -> Path | None:
    """Draw the main curves from metrics.jsonl into curves.png (atomically); None if there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read(run_dir)
    if not rows:
        return None
    fig, axes = plt.subplots(3, 4, figsize=(16, 10))
    axes = axes.ravel()
    for ax, (title, keys) in zip(axes, _PANELS):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(keys) > 1 and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax = axes[len(_PANELS)]
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for k in _TIMES:
        vals = [r.get(k) or 0.0 for r in rows]
        if any(vals):
            ax.bar(steps, vals, bottom=bottom, label=k.removeprefix("time_"))
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("time split per step (s)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    for ax in axes[len(_PANELS) + 1:]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(run_dir) / PLOT_FILE
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(out)
    return out
