"""Data-parallel GRPO on the CPU: two gloo processes under torchrun (accelerate's PartialState picks the
process group up). Each rank rolls out its own prompts; the summed gradients keep the replicas equal
(the trainer compares weight checksums across ranks at every checkpoint and fails if they differ)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("grpo_dist")
    init_model(root / "dense", ModelInitConfig(arch="llama", size="tiny", seed=0))
    sc = SparseConfig(topk=6, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=3))
    (root / "tasks.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i), "task": "math"}) + "\n"
        for i in range(8)))
    (root / "rw.py").write_text("def varied(completions, tasks):\n"
                                "    return [(sum(map(ord, c['completion'])) % 97) / 97 for c in completions]\n")
    return root


def test_two_gloo_processes_train_in_sync_and_log_once(env, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "sparse_rl.cli.main", "grpo", str(env / "sparse"),
           "--tasks", str(env / "tasks.jsonl"), "--out", str(out), "--steps", "2", "--mode", "sparse+distill",
           "--samples", "3", "--keep", "2", "--prompts-per-step", "4", "--max-new-tokens", "5", "--device", "cpu",
           "--reward", f"{env / 'rw.py'}:varied", "--set", "rollout.max_batch=8", "--set", "optim.lr=0.01",
           "--set", "distill.lr=0.003", "--checkpoint-every", "1"]
    envv = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=envv)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 alone writes
    for r in rows:
        assert r["groups"] == 4 and r["groups_sampled"] == 4  # 2 prompts on each rank, counted globally
        assert r["prompts_seen"] == 4 * r["step"]
        assert r["grad_norm"] > 0 and r["distill_kl_before"] is not None
    meta = json.loads((out / "checkpoints" / "step-2" / "meta.json").read_text())
    assert meta["world_size"] == 2
    # resuming with another number of processes is refused with a clear message
    res = subprocess.run([sys.executable, "-m", "sparse_rl.cli.main", "grpo", str(env / "sparse"), "--tasks",
                          str(env / "tasks.jsonl"), "--out", str(out), "--resume", "--steps", "3"],
                         capture_output=True, text=True, timeout=120, env=envv)
    assert res.returncode == 1 and "resume with the same number of processes" in res.stderr
