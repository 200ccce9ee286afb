"""`sparse-rl bench rollout` runs end to end on a CPU with the tiny shape (the numbers are not checked)."""

import json

from typer.testing import CliRunner

from sparse_rl.cli.main import app


def test_bench_rollout_cpu_smoke(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "rollout", "--shape", "tiny", "--batch", "2", "--prompt-len", "8",
                                   "--new-tokens", "6", "--long-new-tokens", "40", "--long-batch", "2", "--index-topk", "16",
                                   "--index-dim", "16", "--dtype", "float32", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert not r["errors"]
    assert [(x["run"], x["mode"]) for x in r["rows"]] == [("hf_generate", "dense"), ("engine", "dense"),
                                                          ("long", "dense"), ("long", "sparse")]
    assert {"engine_vs_hf", "sparse_vs_dense_40"} <= set(r["summary"])
    assert "| long | sparse |" in res.stdout
