"""GRPO with `parallel: fsdp` (theta sharded by FSDP2) on the CPU: two gloo processes under torchrun.

FSDP changes where theta lives, not the math, so every run is compared with the data-parallel
(`ddp`) run of the same seed and global batch:
- without gradient-norm clipping the weights are bitwise equal (the two-rank SUM reduce-scatter adds
  the same two numbers as the all-reduce, and AdamW is elementwise on the shards);
- with clipping the total norm is summed shard-wise instead of parameter-wise, so it (and the clip
  factor) differ in the last float32 bits: weights agree to ~1e-10 relative (norm of the difference
  over the norm of the weights), asserted below 1e-5 relative.
Adam and the clip are invariant to a constant gradient scale, so the logged grad_norm is compared
too: it catches a reduce-scatter that averages instead of summing.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

STEP_TOL = 1e-5  # relative, float32 rounding of shard-wise reductions (see module doc)
# absolute, for logged quantities that are float32 noise around 0 (e.g. the dense-mode mismatch of
# the rollout's log-probs vs the training forward's, ~1e-8, which moves with the last bits of theta)
ABS_TOL = 1e-6


def _grpo(launch, env, out, mode, parallel, steps, *extra):
    return launch(["grpo", env / ("sparse" if mode != "dense" else "dense"), "--tasks", env / "tasks.jsonl", "--out",
                    out, "--steps", steps, "--mode", mode, "--samples", "3", "--keep", "2", "--prompts-per-step", "4",
                    "--max-new-tokens", "5", "--device", "cpu", "--reward", f"{env / 'rw.py'}:varied",
                    "--set", "rollout.max_batch=8", "--set", "optim.lr=0.01", "--set", "distill.lr=0.003",
                    "--checkpoint-every", "1", "--set", f"parallel={parallel}", *extra])


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for k, va in ra.items():
            if k.startswith("time_") or k in ("rollout_tokens_per_s", "distill_time_frac"):
                continue
            vb = rb[k]
            if isinstance(va, float) and isinstance(vb, float):
                assert math.isclose(va, vb, rel_tol=STEP_TOL, abs_tol=ABS_TOL), (ra["step"], k, va, vb)
            else:
                assert va == vb, (ra["step"], k, va, vb)


def _weights(run, step, part="policy/model.safetensors"):
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / f"step-{step}" / part))


def _rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a)
    den = sum(float((a[k].double() ** 2).sum()) for k in a)
    return math.sqrt(num / den)


def test_fsdp_dense_with_kl_ref_and_eval_matches_data_parallel(env, tmp_path, torchrun):
    # one eval task on two ranks: rank 1 has none but must still join FSDP's all-gather for the eval
    extra = ["--set", "loss.kl_coef=0.05", "--eval-tasks", env / "tasks.jsonl", "--set", "eval.limit=1"]
    _grpo(torchrun, env, tmp_path / "ddp", "dense", "ddp", 2, *extra)
    _grpo(torchrun, env, tmp_path / "fsdp", "dense", "fsdp", 2, *extra)
    a, b = _metrics(tmp_path / "ddp"), _metrics(tmp_path / "fsdp")
    _same_metrics(a, b)
    assert b[-1]["grad_norm"] > 1.0  # the clip (optim.grad_clip 1.0) was active: the rounding case
    assert b[-1]["kl_ref"] is not None and b[-1]["eval_accuracy"] is not None
    diff = _rel_diff(_weights(tmp_path / "ddp", 2), _weights(tmp_path / "fsdp", 2))
    assert diff < STEP_TOL
    meta = json.loads((tmp_path / "fsdp" / "checkpoints" / "step-2" / "meta.json").read_text())
    assert meta["parallel"] == "fsdp" and meta["world_size"] == 2


def test_fsdp_sparse_distill_equals_data_parallel_resumes_exactly_and_saves_plain_weights(env, tmp_path, torchrun):
    no_clip = ["--set", "optim.grad_clip=0", "--set", "checkpoint.keep=0"]
    full, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    _grpo(torchrun, env, full, "sparse+distill", "fsdp", 3, *no_clip)
    _grpo(torchrun, env, ddp, "sparse+distill", "ddp", 2, *no_clip)
    # same math, different sharding: without the clip, bitwise equal weights and adapter
    for part in ("policy/model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = _weights(ddp, 2, part), _weights(full, 2, part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    _same_metrics(_metrics(ddp), _metrics(full)[:2])
    assert all(r["distill_kl_before"] is not None for r in _metrics(full))

    # resume from step 2 continues exactly: metrics, weights, adapter and AdamW state at step 3
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step-3")
    torchrun(["grpo", env / "sparse", "--out", part, "--resume", "--steps", "3"])
    _same_metrics(_metrics(full), _metrics(part))
    assert _metrics(part)[-1]["step"] == 3
    for p in ("policy/model.safetensors", "adapter/adapter_model.safetensors", "policy/indexer.safetensors"):
        a, b = _weights(full, 3, p), _weights(part, 3, p)
        assert all(torch.equal(a[k], b[k]) for k in a), p
    oa = torch.load(full / "checkpoints/step-3/optimizer.pt", weights_only=False)
    ob = torch.load(part / "checkpoints/step-3/optimizer.pt", weights_only=False)
    for name in ("policy", "distill"):
        sa, sb = oa[name]["state"], ob[name]["state"]
        assert sa.keys() == sb.keys() and sa
        assert all(torch.equal(sa[k][f], sb[k][f]) for k in sa for f in sa[k] if torch.is_tensor(sa[k][f]))

    # the gathered policy/ is a plain model dir: transformers loads every weight, no key missing
    from transformers import AutoModelForCausalLM

    policy_dir = full / "checkpoints" / "step-3" / "policy"
    model, info = AutoModelForCausalLM.from_pretrained(policy_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    saved = _weights(full, 3)
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in saved.items())
    from safetensors.torch import load_file

    start = load_file(str(env / "sparse" / "model.safetensors"))  # training moved the weights
    assert start.keys() == saved.keys() and any(not torch.equal(start[k], saved[k]) for k in saved)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()

    # a data-parallel checkpoint is refused under fsdp with a one-line fix
    res = torchrun(["grpo", env / "sparse", "--out", ddp, "--resume", "--steps", "3", "--set", "parallel=fsdp"],
                  check=False)
    assert res.returncode == 1 and "resume with --set parallel=ddp" in res.stderr, res.stderr[-2000:]


def test_parallel_key_is_validated():
    from sparse_rl.config import load_config
    from sparse_rl.errors import UsageError
    from sparse_rl.rl.grpo.config import GRPOConfig

    assert load_config(GRPOConfig, None, {"parallel": "fsdp"}).parallel == "fsdp"
    with pytest.raises(UsageError, match="parallel: 'zero3' is not one of ddp, fsdp"):
        load_config(GRPOConfig, None, {"parallel": "zero3"})
