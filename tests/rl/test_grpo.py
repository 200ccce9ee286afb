"""`sparse-rl grpo` end to end through the real CLI on tiny models: every rollout mode, resume
equality, NaN-loss stop, dynamic sampling, and the bad-input errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.rl.grpo.metrics import STEP_KEYS

runner = CliRunner()

REWARDS = '''
import math

def varied(completions, tasks):
    # an untrained model almost never answers right; this arbitrary score of the text varies within a group
    return [(sum(map(ord, c["completion"])) % 97) / 97 for c in completions]

def by_length(completions, tasks):
    # all-equal rewards for tasks t0..t5 (dropped by dynamic sampling), varied for t6, t7
    return [0.5 if t["id"] not in ("t6", "t7") else (len(c["completion"]) % 7) / 7 + 0.01 * i
            for i, (c, t) in enumerate(zip(completions, tasks))]

def boom(completions, tasks):
    for t in tasks:
        if t["id"] == "t3":
            raise KeyError("no such field")
    return [0.0] * len(tasks)

def nan(completions, tasks):
    return [math.nan for _ in tasks]
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("grpo")
    init_model(root / "dense", ModelInitConfig(arch="llama", size="tiny", seed=0))
    sc = SparseConfig(topk=6, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=3))
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"What is {i + 1} + {2 * i + 3}?",
                                         "answer": str(3 * i + 4), "task": "math"}) + "\n" for i in range(8)))
    (root / "rewards.py").write_text(REWARDS)
    return root


def _base(env, model="sparse", *extra):
    return ["grpo", str(env / model), "--tasks", str(env / "tasks.jsonl"), "--samples", "4", "--keep", "2",
            "--prompts-per-step", "2", "--max-new-tokens", "6", "--set", "rollout.max_batch=8",
            "--set", "optim.lr=0.01", "--device", "cpu", *extra]


def _run(args):
    return runner.invoke(app, [str(a) for a in args])


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _err(res) -> str:
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), res.stderr
    return lines[-1]


TIMES = {"rollout_tokens_per_s", "distill_time_frac"}


def _comparable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith("time_") and k not in TIMES}


def test_dense_mode_end_to_end_with_math_reward_eval_and_checkpoint(env, tmp_path):
    from sparse_rl.sparse.loader import load_model

    out = tmp_path / "run"
    res = _run(_base(env, "dense", "--out", out, "--steps", "2", "--mode", "dense", "--reward", "math",
                     "--eval-tasks", env / "tasks.jsonl", "--eval-every", "1", "--checkpoint-every", "1",
                     "--set", "eval.limit=3", "--set", "loss.agg=seq_mean", "--set", "loss.advantage=dr_grpo",
                     "--set", "reward.shaping=overlong", "--set", "reward.overlong_cache=4",
                     "--set", "loss.log_kl_ref=true"))
    assert res.exit_code == 0, res.output
    last = json.loads(res.stdout)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1] == last
    for r in rows:
        assert set(STEP_KEYS) <= set(r)
        assert r["eval_tasks"] == 3 and 0.0 <= r["eval_accuracy"] <= 1.0
        # verifier reward 0 (untrained model) plus the overlong penalty past 6 - 4 = 2 tokens
        assert r["reward"] < 0 and r["accuracy"] == 0.0
        assert r["kl_ref"] is not None and r["kl_coef"] == 0.0  # logged only, not in the loss
        assert r["groups"] == 2 and r["groups_sampled"] == 2
        assert r["rollout_tokens"] > 0 and r["rollout_tokens_per_s"] > 0 and r["time_step"] > 0
        assert r["distill_kl_before"] is None and r["time_distill"] is None  # dense mode: no adapter
        # dense rollouts: the engine and the trainer compute the same policy
        assert abs(r["mismatch_kl"]) < 1e-4 and r["mismatch_p5_ratio"] > 0.999
    assert (out / "curves.png").stat().st_size > 1000 and (out / "config.yaml").is_file()
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-1", "step-2"]
    meta = json.loads((ck / "step-2" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["cursor"]["pos"] == 4 and meta["world_size"] == 1
    assert not (ck / "step-2" / "adapter").exists()
    load_model(ck / "step-2" / "policy")  # the checkpoint's policy is a loadable model dir


def test_sparse_naive_mode_with_tis(env, tmp_path):
    out = tmp_path / "run"
    res = _run(_base(env, "sparse", "--out", out, "--steps", "2", "--mode", "sparse", "--reward",
                     f"{env / 'rewards.py'}:varied", "--set", "loss.mismatch=tis", "--set", "loss.is_cap=1.5",
                     "--set", "loss.kl_coef=0.05", "--set", "loss.kl_target=0.001", "--set", "loss.kl_horizon=4"))
    assert res.exit_code == 0, res.output
    rows = _metrics(out)
    assert len(rows) == 2
    for r in rows:
        assert r["mismatch_kl"] > 1e-4  # top-6 sparse attention differs from the dense policy
        assert 0 < r["mismatch_p5_ratio"] < 1
        assert r["distill_kl_before"] is None
        assert r["is_mean_weight"] is not None and r["grad_norm"] > 0
    # KL to the frozen initial policy: 0 before the first update, positive after; adaptive coefficient
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl_ref"] > 0
    assert rows[0]["kl_coef"] == 0.05 and rows[1]["kl_coef"] < 0.05  # KL below target: the coefficient shrinks
    assert not (out / "checkpoints" / "step-2" / "adapter").exists()


def test_sparse_distill_resume_continues_exactly(env, tmp_path):
    args = ("--mode", "sparse+distill", "--reward", f"{env / 'rewards.py'}:varied", "--checkpoint-every", "2",
            "--set", "distill.lr=0.003", "--set", "loss.mismatch=mis_token", "--set", "rollout.samples=3",
            "--eval-tasks", env / "tasks.jsonl", "--eval-every", "1", "--set", "eval.limit=2", "--set", "eval.attention=dense",
            "--set", "eval.greedy=false", "--set", "eval.samples=2")
    full, part = tmp_path / "full", tmp_path / "part"
    res = _run(_base(env, "sparse", "--out", full, "--steps", "3", *args))
    assert res.exit_code == 0, res.output
    res = _run(_base(env, "sparse", "--out", part, "--steps", "2", *args))
    assert res.exit_code == 0, res.output
    # resume: config from the run dir, only the target step count changes
    res = _run(["grpo", env / "sparse", "--tasks", env / "tasks.jsonl", "--out", part, "--resume", "--steps", "3"])
    assert res.exit_code == 0, res.output
    a, b = _metrics(full), _metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert _comparable(ra) == _comparable(rb)
    assert a[-1]["eval_tasks"] == 2 and a[-1]["eval_accuracy"] is not None
    for r in a:
        assert r["distill_kl_before"] is not None and r["distill_kl_after"] is not None
        assert r["time_distill"] > 0 and 0 < r["distill_time_frac"] < 1
    assert (full / "checkpoints" / "step-3" / "adapter" / "adapter_model.safetensors").is_file()
    # a resumed run that is already done says so and changes nothing
    res = _run(["grpo", env / "sparse", "--tasks", env / "tasks.jsonl", "--out", part, "--resume"])
    assert res.exit_code == 0 and len(_metrics(part)) == 3


def test_nan_loss_stops_and_keeps_last_good_checkpoint(env, tmp_path, monkeypatch):
    import torch

    from sparse_rl.rl.algos import POLICY_LOSSES

    real = POLICY_LOSSES["ppo_clip"]
    calls = {"n": 0}

    def poisoned(*a, **k):
        calls["n"] += 1
        loss, stats = real(*a, **k)
        return (loss * torch.tensor(float("nan")) if calls["n"] >= 2 else loss), stats

    monkeypatch.setitem(POLICY_LOSSES, "ppo_clip", poisoned)
    out = tmp_path / "run"
    res = _run(_base(env, "dense", "--out", out, "--steps", "3", "--mode", "dense", "--checkpoint-every", "1",
                     "--reward", f"{env / 'rewards.py'}:varied", "--set", "optim.micro_batch=4"))
    assert res.exit_code == 1
    msg = _err(res)
    assert "step 2" in msg and "NaN" in msg and "step-1" in msg
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-1"]
    assert [r["step"] for r in _metrics(out)] == [1]


def test_dynamic_sampling_refills_uniform_groups(env, tmp_path):
    out = tmp_path / "run"
    res = _run(_base(env, "dense", "--out", out, "--steps", "1", "--mode", "dense", "--reward",
                     f"{env / 'rewards.py'}:by_length", "--set", "loss.dynamic_sampling=true",
                     "--set", "loss.max_refills=4", "--set", "data.shuffle=false", "--set", "optim.epochs=2"))
    assert res.exit_code == 0, res.output
    (r,) = _metrics(out)
    # without shuffling the stream is t0, t1, ...: t0..t5 give all-equal rewards, so refills reach t6, t7
    assert r["refills"] >= 1 and r["groups_sampled"] > 2
    assert r["groups"] == 2 and r["prompts_seen"] == r["groups_sampled"]
    assert r["grad_norm"] > 0 and r["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # 1st of 2 epochs: on-policy


@pytest.mark.parametrize("case", ["no_answer", "reward_raises", "reward_nan", "no_model", "corrupt_model",
                                  "sparse_needs_sparse_dir", "unknown_key", "bad_name", "m_lt_n", "out_exists"])
def test_bad_inputs_give_one_line_errors(env, tmp_path, case):
    out = tmp_path / "run"
    args = _base(env, "sparse", "--out", out, "--steps", "1")
    code, needle = 1, None
    if case == "no_answer":
        bad = tmp_path / "t.jsonl"
        bad.write_text('{"id": "a", "prompt": "1+1?", "answer": "2", "task": "math"}\n'
                       '{"id": "b", "prompt": "2+2?", "task": "math"}\n')
        args[3] = str(bad)
        needle = "line 2: task 'b' has no 'answer'"
    elif case == "reward_raises":
        args += ["--reward", f"{env / 'rewards.py'}:boom", "--set", "data.shuffle=false", "--prompts-per-step", "4"]
        needle = "raised KeyError on task id t3"
    elif case == "reward_nan":
        args += ["--reward", f"{env / 'rewards.py'}:nan"]
        needle = "rewards must be finite"
    elif case == "no_model":
        args[1] = str(tmp_path / "missing")
        needle = "no such directory"
    elif case == "corrupt_model":
        d = tmp_path / "broken"
        d.mkdir()
        (d / "config.json").write_text("{not json")
        args[1] = str(d)
        needle = "corrupt config.json"
    elif case == "sparse_needs_sparse_dir":
        args[1] = str(env / "dense")
        args += ["--mode", "sparse"]
        needle = "needs a sparse model dir"
    elif case == "unknown_key":
        args += ["--set", "loss.eps_hi=0.3"]
        code, needle = 2, "unknown key 'eps_hi'"
    elif case == "bad_name":
        args += ["--set", "loss.mismatch=is"]
        code, needle = 2, "loss.mismatch: unknown mismatch correction 'is'"
    elif case == "m_lt_n":
        args += ["--keep", "5"]
        code, needle = 2, "rollout.samples (4) must be >= rollout.keep (5)"
    elif case == "out_exists":
        out.mkdir()
        (out / "x").write_text("")
        code, needle = 2, "pass --resume"
    res = _run(args)
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    if case in ("reward_raises", "reward_nan"):  # failed during step 1: nothing logged or saved
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    elif case != "out_exists":
        assert not out.exists()  # a failed start leaves no run dir behind
