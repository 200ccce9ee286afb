"""`sparse-rl demo` end to end (a shortened config), and its resume."""

import json

from typer.testing import CliRunner

from sparse_rl.cli.main import app


def test_demo_runs_whole_chain_and_resumes(tmp_path):
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("seq_len: 128\ntopks: [16, 128]\npretrain_steps: 8\nwarmup_steps: 8\nn_tasks: 8\nn_eval: 4\n"
                   "max_new_tokens: 8\ngrpo_steps: 2\n")
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["demo", "--out", str(run), "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "summary.json").read_text())
    assert res.stdout.rstrip().splitlines()[-1].startswith("run dir: ")  # the tables end stdout, no JSON
    assert [s["status"] for s in summary["steps"]] == ["done"] * len(summary["steps"])
    rows = {r["topk"]: r for r in summary["agreement"]}
    assert rows[128]["top1_agreement"] == 1.0 and rows[128]["top1_after_warmup"] == 1.0
    assert len(summary["grpo"]) == 2 and "mismatch_kl" in summary["grpo"][0]
    for f in ("model/config.json", "indexer/sparse_config.json", "tasks.jsonl", "completions_sparse.jsonl",
              "grpo/metrics.jsonl", "indexer_eval.json"):
        assert (run / f).exists(), f
    again = CliRunner().invoke(app, ["demo", "--out", str(run), "--config", str(cfg)])
    assert again.exit_code == 0
    assert {s["status"] for s in json.loads((run / "summary.json").read_text())["steps"]} == {"skipped"}


def test_readme_chaining_snippet_is_the_scripts_own_lines():
    """The README's "Chaining the stages" block must be what recipes/pipeline_cpu.sh runs (it once
    left out the pre-training step and the size flags, and took ~15 minutes as written)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("### Chaining the stages"):]
    block = section[section.index("```bash\n") + 8:section.index("\n```", section.index("```bash\n"))]
    script = (root / "recipes" / "pipeline_cpu.sh").read_text()
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) > 10 and "\n".join(lines) in "\n".join(ln for ln in script.splitlines() if ln.strip())
