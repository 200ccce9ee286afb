"""The evidence recipe at SIZE=cpu, end to end through `bash recipes/evidence/run.sh OUT`: a smoke test
of the plumbing (three parts, hand-offs, results.json and RESULTS.md from the runs' files). The tiny
sizes make its numbers meaningless; it asserts only that every stage ran and reported.

Time: ~55 s of CPU on 2 cores (measured: 53 s user, under 2 minutes wall on an idle machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SIZE": "cpu", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(ROOT / "recipes" / "evidence" / "run.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cpu_evidence_recipe_runs_all_parts_and_reports(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "ev"
    t0 = time.time()
    res = _run(out)
    print(f"evidence recipe SIZE=cpu: {time.time() - t0:.0f} s wall", file=sys.stderr)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert set(r["policies"]) == {"sft", "dense", "sparse", "sparse-tis", "sparse-distill"}
    for pol, p in r["policies"].items():
        for key in ("accuracy_dense", "accuracy_sparse", "token_kl", "acceptance_mean", "acceptance_p5", "niah_dense",
                    "niah_sparse"):
            assert isinstance(p[key], float), (pol, key, p[key])
        assert p["acceptance_p5_by_position"]
        # the look-up hop grid of each policy's held-out completions, dense and sparse
        for a in ("dense", "sparse"):
            g = p[f"hops_{a}"]
            assert g["hops"] == 2 and len(g["grid"]) == 2 and sum(map(sum, g["n"])) >= 4, (pol, a, g)
    assert set(r["grpo"]) == {"dense", "sparse", "sparse-tis", "sparse-distill"}
    assert all(g["steps"] == 2 and g["mismatch_kl_mean"] is not None for g in r["grpo"].values())
    # the sparse runs really rolled out sparse: their mu differs from the dense-trained pi, dense's does not
    assert r["grpo"]["sparse"]["mismatch_kl_mean"] > r["grpo"]["dense"]["mismatch_kl_mean"]
    md = (out / "RESULTS.md").read_text()
    assert "sparse + LoRA distillation + oversampling" in md and "sparse-rl grpo" in md
    # pre-training in stages (pre_keys "4|4,6"), each continuing from the one before, then SFT from the last
    cmds = (out / "commands.sh").read_text()
    assert "--keys 4 " in cmds and "--keys 4,6 " in cmds
    assert f"sft {out / 'part1' / 'pre0'} --data {out / 'part1' / 'pretrain1.jsonl'}" in cmds
    assert f"sft {out / 'part1' / 'pre1'} --data {out / 'part1' / 'sft.jsonl'}" in cmds
    # hand-offs: bf16 safetensors shards of at most 16 MB, the distill policy with its adapter
    for d in (out / "part1" / "handoff", *(out / "part2" / "handoff").iterdir()):
        if not d.is_dir():
            continue
        shards = list(d.glob("model*.safetensors"))
        assert shards and all(s.stat().st_size <= 16 * 2**20 for s in shards)
        with safe_open(str(shards[0]), "pt") as f:
            assert str(f.get_tensor(next(iter(f.keys()))).dtype) == "torch.bfloat16"
    assert (out / "part2" / "handoff" / "sparse-distill" / "adapter" / "adapter_config.json").is_file()

    # resumable stage by stage: a re-run skips every finished stage and redoes only what is missing
    (out / ".done" / "p3-report").unlink()
    (out / "results.json").unlink()
    res = _run(out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "p1-sft: done already" in res.stderr and "p2-grpo-sparse-distill: done already" in res.stderr
    assert (out / "results.json").is_file()

    # the report over several GRPO seeds (here the run twice, as a stand-in), with a preface in words
    from sparse_rl.eval.evidence import report

    (tmp_path / "pre.md").write_text("**Findings** in words.")
    report(out, tmp_path / "docs" / "R.md", seeds=[out], preface=tmp_path / "pre.md")
    md = (tmp_path / "docs" / "R.md").read_text()
    assert md.splitlines()[2] == "**Findings** in words." and "## The generated report" in md
    assert "## Spread over GRPO seeds (0, 0;" in md and "--seeds" in md
    assert (tmp_path / "docs" / "evidence" / "hops_sparse_sparse_minus_dense.png").is_file()
