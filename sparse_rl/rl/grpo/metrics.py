"""`run_dir/metrics.jsonl` (one record per step) and the curves plot `run_dir/curves.png`.

Every record has `step`; the keys are listed in `STEP_KEYS` (always present; `null` where a
quantity does not apply, e.g. distillation metrics outside sparse+distill mode) plus `eval_*` keys
on steps with a held-out eval.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from sparse_rl.io import append_jsonl
from sparse_rl.runs import truncate_metrics

STEP_KEYS = (
    "step", "epoch", "prompts_seen", "groups", "groups_sampled", "groups_skipped", "refills",
    "reward", "reward_kept", "accuracy", "accuracy_kept", "response_length", "response_length_kept",
    "truncated_frac", "loss", "entropy", "kl_ref", "kl_coef", "clip_frac", "clip_frac_low", "clip_frac_high",
    "approx_kl", "ratio_mean", "grad_norm", "mismatch_kl", "mismatch_kl_k1", "mismatch_p5_ratio",
    "is_mean_weight", "is_frac_masked", "is_frac_truncated",
    "distill_loss_before", "distill_loss_after", "distill_kl_before", "distill_kl_after", "distill_grad_norm",
    "rollout_tokens", "rollout_tokens_per_s", "time_rollout", "time_reward", "time_dense_forward", "time_update",
    "time_distill", "time_distill_measure", "time_step", "distill_time_frac",
)
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
