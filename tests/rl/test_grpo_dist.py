"""Data-parallel GRPO on the CPU: two gloo processes under torchrun (accelerate's PartialState picks the
process group up). Each rank rolls out its own prompts; the summed gradients keep the replicas equal
(the trainer compares weight checksums across ranks at every checkpoint and fails if they differ)."""

from __future__ import annotations

import json
import os
import subprocess
import sys



def test_two_gloo_processes_train_in_sync_and_log_once(env, tmp_path, torchrun):
    out = tmp_path / "run"
    torchrun(["grpo", str(env / "sparse"),
           "--tasks", str(env / "tasks.jsonl"), "--out", str(out), "--steps", "2", "--mode", "sparse+distill",
           "--samples", "3", "--keep", "2", "--prompts-per-step", "4", "--max-new-tokens", "5", "--device", "cpu",
           "--reward", f"{env / 'rw.py'}:varied", "--set", "rollout.max_batch=8", "--set", "optim.lr=0.01",
           "--set", "distill.lr=0.003", "--checkpoint-every", "1"])
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
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 1 and "resume with the same number of processes" in res.stderr
