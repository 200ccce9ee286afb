"""The data-parallel path: two gloo processes on the CPU, started by `accelerate launch`, train like
one process with the same global batch (gradients averaged, each rank on its own rows)."""

import json
import os
import subprocess
import sys

import pytest
import torch


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("dist")
    init_model(root / "dense", ModelInitConfig(size="tiny", seed=2))
    sc = SparseConfig(topk=8, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=0))
    return root / "sparse"


def test_two_gloo_processes_match_one_process_with_the_same_global_batch(sparse_dir, tmp_path):
    common = ["indexer", "train", str(sparse_dir), "--device", "cpu", "--seq-len", "64", "--steps", "3",
              "--synthetic-rows", "8", "--lr", "1e-2", "--save-every", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
              "-m", "sparse_rl.cli.main"]
    two = subprocess.run(launch + common + ["--out", str(tmp_path / "two"), "--batch-size", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert two.returncode == 0, two.stderr[-3000:]
    summary = json.loads(two.stdout.strip().splitlines()[-1])  # rank 0 alone prints it
    assert summary["processes"] == 2 and len(two.stdout.strip().splitlines()) == 1

    from typer.testing import CliRunner

    from sparse_rl.cli.main import app

    one = CliRunner().invoke(app, common + ["--out", str(tmp_path / "one"), "--batch-size", "2"])
    assert one.exit_code == 0, one.output

    def metrics(name):
        return [json.loads(x) for x in (tmp_path / f"{name}.run" / "metrics.jsonl").read_text().splitlines()]

    m2, m1 = metrics("two"), metrics("one")
    assert [r["step"] for r in m2] == [1, 2, 3]
    for a, b in zip(m2, m1):
        for key in ("kl", "attn_recall", "grad_norm", "lr"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), (key, a, b)
    from safetensors.torch import load_file

    x, y = load_file(str(tmp_path / "two" / "indexer.safetensors")), load_file(str(tmp_path / "one" / "indexer.safetensors"))
    for k in x:
        torch.testing.assert_close(x[k], y[k], atol=1e-5, rtol=1e-4)
    assert [p.name for p in (tmp_path / "two.run" / "checkpoints").iterdir()] == ["step-3"]
