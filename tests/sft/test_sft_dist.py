"""`sparse-rl sft` on two gloo processes under torchrun: rows split over ranks, the loss normalised by
the global target count, so the weights equal a one-process run over the same rows (batch 2 x 1 = 2)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch
from typer.testing import CliRunner

from sparse_rl.cli.main import app


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_one_process_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    recs = [{"prompt": f"add {i} and {i + 1}", "completion": f"{2 * i + 1} is the sum"} for i in range(24)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    common = ["sft", str(tiny_model_dir), "--data", str(data), "--seq-len", "48", "--steps", "3", "--lr", "3e-3",
              "--device", "cpu", "--save-every", "3"]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(_port()), "-m", "sparse_rl.cli.main", *common,
                          "--batch-size", "1", "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert len([x for x in res.stdout.splitlines() if x.startswith("{")]) == 1  # rank 0 alone reports
    one = CliRunner().invoke(app, [*common, "--batch-size", "2", "--out", str(tmp_path / "one")])
    assert one.exit_code == 0, one.output
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "two"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    two_log = [json.loads(x) for x in (tmp_path / "two.run" / "metrics.jsonl").read_text().splitlines()]
    one_log = [json.loads(x) for x in (tmp_path / "one.run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["target_tokens"] for r in two_log] == [r["target_tokens"] for r in one_log]
    assert abs(two_log[0]["loss"] - one_log[0]["loss"]) < 1e-5
