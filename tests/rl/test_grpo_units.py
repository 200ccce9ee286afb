"""GRPO trainer pieces below the CLI: distillation lowers the sparse-vs-dense KL while leaving pi_theta
untouched, trainer log-probs equal the rollout engine's, the data cursor, checkpoints, recipes."""

from __future__ import annotations

import glob
import json

import pytest
import torch

from sparse_rl.config import load_config
from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.rl.grpo.config import DistillConfig, GRPOConfig


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("grpo_units")
    init_model(root / "dense", ModelInitConfig(arch="qwen3", size="tiny", seed=1))
    sc = SparseConfig(topk=4, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=1, dense_layers=[0])
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=5))
    return root / "sparse"


def _fixed_batch(B=6, P=10, C=14, seed=0):
    from sparse_rl.rl.grpo.batch import make_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 500, (P + b % 3,), generator=g).tolist() for b in range(B)]
    comps = [torch.randint(5, 500, (C - b % 4,), generator=g).tolist() for b in range(B)]
    return make_batch(prompts, comps, [[0.0] * len(c) for c in comps], [0.0] * B, 0, "cpu")


def _kl(model, batch, loss="k3"):
    from sparse_rl.rl.algos import DISTILL_LOSSES
    from sparse_rl.rl.grpo.batch import forward_logits, logprobs_of
    from sparse_rl.rl.grpo.distill import policy_mode

    with torch.no_grad():
        with policy_mode(model, "dense"):
            t = forward_logits(model, batch, 1.0)
        with policy_mode(model, "sparse"):
            s = forward_logits(model, batch, 1.0)
    if DISTILL_LOSSES[loss].needs_logits:
        return float(DISTILL_LOSSES[loss](s, t, batch.response(batch.mask))[0]), t
    return float(DISTILL_LOSSES[loss](logprobs_of(s, batch), logprobs_of(t, batch), batch.response(batch.mask))[0]), t


@pytest.mark.parametrize("loss", ["k3", "full"])
def test_distillation_lowers_sparse_vs_dense_kl_and_leaves_pi_theta_unchanged(sparse_dir, loss):
    from sparse_rl.rl.grpo.distill import attach_adapter, distill, lora_params, theta_params
    from sparse_rl.sparse.loader import load_model

    torch.manual_seed(0)
    cfg = DistillConfig(loss=loss, lora_r=8, lora_alpha=16, lr=5e-3, steps=8, micro_batch=6)
    model = attach_adapter(load_model(sparse_dir), cfg)
    batch = _fixed_batch()
    before, dense_before = _kl(model, batch, loss)
    assert before > 1e-3  # top-4 attention is far from dense on 24-token sequences
    theta0 = [p.detach().clone() for p in theta_params(model)]
    opt = torch.optim.AdamW(lora_params(model), lr=cfg.lr, weight_decay=0.0)
    out = distill(model, batch, opt, cfg, temperature=1.0, global_tokens=batch.num_tokens(), reduce_grads=lambda p: None)
    after, dense_after = _kl(model, batch, loss)
    assert out["distill_kl_before"] == pytest.approx(before, rel=1e-4)
    assert out["distill_kl_after"] == pytest.approx(after, rel=1e-4)
    assert after < 0.6 * before
    # theta was frozen and the adapter is bypassed in dense mode: pi_theta is exactly what it was
    assert all(torch.equal(a, b) for a, b in zip(theta0, theta_params(model)))
    torch.testing.assert_close(dense_after, dense_before, atol=0, rtol=0)
    assert all(p.requires_grad for p in theta_params(model))  # unfrozen again for the next GRPO update


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_trainer_logprobs_equal_the_rollout_engines(sparse_dir, mode):
    """The batch layout (right padding, response window, shift) reproduces the sampling log-probs."""
    from sparse_rl.rl.grpo.backend import InProcessRollout, RolloutBackend
    from sparse_rl.rl.grpo.batch import forward_logits, logprobs_of, make_batch
    from sparse_rl.rl.grpo.distill import policy_mode
    from sparse_rl.rl.rollout import SamplingParams
    from sparse_rl.sparse.loader import load_model, load_tokenizer

    model = load_model(sparse_dir)
    backend = InProcessRollout(model, load_tokenizer(sparse_dir), max_batch=8)
    assert isinstance(backend, RolloutBackend)
    prompts = [[5, 17, 90, 33, 4, 250], [7, 8, 9], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310]]
    comps = backend.generate(prompts, SamplingParams(samples=2, temperature=0.9, max_new_tokens=12, seed=3), mode)
    batch = make_batch([c.prompt_tokens for c in comps], [c.tokens for c in comps], [c.logprobs for c in comps],
                       [0.0] * len(comps), 0, "cpu")
    with torch.no_grad(), policy_mode(model, mode):
        lp = logprobs_of(forward_logits(model, batch, 0.9), batch)
    mask = batch.response(batch.mask).bool()
    torch.testing.assert_close(lp[mask], batch.response(batch.logp_mu)[mask], atol=2e-4, rtol=0)


def test_data_cursor_epochs_shards_and_state():
    from sparse_rl.rl.grpo.data import DataCursor

    c = DataCursor(5, seed=1)
    first = c.take(5)
    assert sorted(first) == list(range(5))
    nxt = c.take(3)
    assert c.epoch == 1 and c.pos == 3 and len(set(nxt)) == 3
    state = c.state_dict()
    rest = c.take(4)
    d = DataCursor(5, seed=1)
    d.load_state_dict(state)
    assert d.take(4) == rest
    # two ranks' shards of one step are the single-process step's prompts
    a, b, single = DataCursor(7, 3), DataCursor(7, 3), DataCursor(7, 3)
    assert a.take_shard(2, 0, 2) + b.take_shard(2, 1, 2) == single.take(4)
    with pytest.raises(SparseRLError, match="tasks file has 9"):
        DataCursor(9, 1).load_state_dict(state)


def test_checkpoint_roundtrip_restores_weights_adapter_and_optimizers(sparse_dir, tmp_path):
    from sparse_rl.rl.grpo import checkpoint as ckpt
    from sparse_rl.rl.grpo.distill import attach_adapter, lora_params, theta_params
    from sparse_rl.sparse.loader import load_model, load_tokenizer

    torch.manual_seed(0)
    cfg = DistillConfig(lora_r=4, lora_alpha=8)
    m1 = attach_adapter(load_model(sparse_dir), cfg)
    opt = torch.optim.AdamW(theta_params(m1), lr=1e-2)
    dopt = torch.optim.AdamW(lora_params(m1), lr=1e-2)
    for o, ps in ((opt, theta_params(m1)), (dopt, lora_params(m1))):
        sum((p.float() ** 2).sum() for p in ps).backward()
        o.step()
        o.zero_grad()
    ckpt.save(tmp_path, 4, model=m1, tokenizer=load_tokenizer(sparse_dir), optimizers={"policy": opt, "distill": dopt},
              rng_states=[ckpt.rng_state()], meta={"world_size": 1}, keep=1)
    ckpt.save(tmp_path, 5, model=m1, tokenizer=load_tokenizer(sparse_dir), optimizers={"policy": opt, "distill": dopt},
              rng_states=[ckpt.rng_state()], meta={"world_size": 1}, keep=1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5]
    torch.manual_seed(1)
    m2 = attach_adapter(load_model(sparse_dir), cfg)
    opt2 = torch.optim.AdamW(theta_params(m2), lr=1e-2)
    dopt2 = torch.optim.AdamW(lora_params(m2), lr=1e-2)
    meta, _ = ckpt.load(ckpt.latest(tmp_path)[1], model=m2, optimizers={"policy": opt2, "distill": dopt2}, rank=0, world=1)
    assert meta["step"] == 5
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(dopt2.state_dict()["state"][0]["exp_avg"], dopt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(SparseRLError, match="resume with the same number of processes"):
        ckpt.load(ckpt.latest(tmp_path)[1], model=m2, optimizers={}, rank=0, world=2)
    # the saved policy is a plain model dir; its sparse mode equals the trained model's
    m3 = load_model(ckpt.latest(tmp_path)[1] / "policy")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad(), m1.disable_adapter():
        torch.testing.assert_close(m3(input_ids=ids).logits, m1(input_ids=ids).logits)


def test_every_recipe_loads_and_config_errors_name_the_key():
    files = sorted(glob.glob("recipes/grpo_*.yaml"))
    assert {f.split("/")[-1] for f in files} >= {"grpo_dense.yaml", "grpo_sparse_naive.yaml", "grpo_sparse_distill.yaml"}
    modes = {load_config(GRPOConfig, f).rollout.mode for f in files}
    assert modes == {"dense", "sparse", "sparse+distill"}
    for header in (open(f).read().splitlines()[:6] for f in files):
        assert any("sparse-rl grpo" in line for line in header)  # launch command in the header comment
    for over, msg in [({"rollout.mode": "fast"}, "rollout.mode"), ({"rollout.keep": 1}, "rollout.keep"),
                      ({"distill.loss": "kl"}, "distill.loss: unknown distillation loss 'kl'"),
                      ({"reward.shaping": "short"}, "reward.shaping"),
                      ({"loss.kl_target": 0.1}, "loss.kl_target"), ({"optim.betas": [0.9]}, "optim.betas"),
                      ({"rollout.decode_select": "rows"}, "rollout.decode_select"),
                      ({"rollout.decode_long": "auto"}, "rollout.decode_select"), ({"rollout.qkv_pad": 0}, "rollout.qkv_pad"),
                      ({"rollout.score_block": 48}, "score_block 48: must be 0 or a power of two"),
                      ({"rollout.pdl": 3}, "rollout.pdl"), ({"rollout.sync_min_batch": -2}, "sync_min_batch -2"),
                      ({"rollout.select_streams": 0}, "rollout.select_streams")]:
        with pytest.raises(UsageError, match=msg.replace("(", r"\(")):
            load_config(GRPOConfig, None, over)


def test_rollout_kernel_choices_reach_the_engine_runner():
    """rollout.decode_select / decode_long / score_block / sync_min_batch / qkv_pad / select_streams become the engine runner's
    arguments (runner_options); the defaults are the engine's own (ENGINE_SELECT)."""
    from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

    from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT

    assert load_config(GRPOConfig, None, {}).rollout.runner_options()["decode_select"] == ENGINE_SELECT
    cfg = load_config(GRPOConfig, None, {"rollout.decode_select": "auto", "rollout.score_block": 0, "rollout.qkv_pad": 8,
                                         "rollout.sync_min_batch": 0, "rollout.select_streams": 2})
    assert cfg.rollout.runner_options() == {"decode_select": DecodeSelect("auto"), "qkv_pad": 8, "pdl": None,
                                            "select_streams": 2}
    cfg = load_config(GRPOConfig, None, {"rollout.sync_min_batch": 4})
    assert cfg.rollout.runner_options()["decode_select"].sync_min_batch == 4
    assert load_config(GRPOConfig, None, {"rollout.pdl": 2}).rollout.runner_options()["pdl"] == 2


def test_metrics_truncate_and_plot(tmp_path):
    from sparse_rl.rl.grpo import metrics as M

    for s in range(1, 5):
        M.append(tmp_path, {"step": s, "reward": s / 10, "mismatch_kl": float("nan"), "time_rollout": 1.0})
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["mismatch_kl"] is None
    M.truncate(tmp_path, 2)
    assert [r["step"] for r in M.read(tmp_path)] == [1, 2]
    assert M.plot(tmp_path).stat().st_size > 1000


def test_a_custom_rollout_backend_plugs_in(sparse_dir, tmp_path):
    """The trainer samples only through the `RolloutBackend` protocol (room for an external server)."""
    from sparse_rl.rl.grpo.backend import InProcessRollout
    from sparse_rl.rl.grpo.trainer import Trainer

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+1=?", "answer": str(i + 1), "task": "math"})
                             + "\n" for i in range(4)))
    (tmp_path / "rw.py").write_text("def r(c, t):\n    return [len(x['completion']) % 5 / 5 for x in c]\n")
    cfg = load_config(GRPOConfig, None, {"model": str(sparse_dir), "out": str(tmp_path / "run"), "steps": 1,
                                         "device": "cpu", "data.tasks": str(tasks), "reward.fn": f"{tmp_path}/rw.py:r",
                                         "rollout.samples": 2, "rollout.keep": 2, "rollout.max_new_tokens": 4,
                                         "data.prompts_per_step": 2, "rollout.mode": "sparse"})

    class Counting:
        def __init__(self):
            self.calls, self.syncs, self.inner = [], 0, None

        def generate(self, prompts, params, attention):
            self.calls.append((len(prompts), params.samples, attention))
            return self.inner.generate(prompts, params, attention)

        def sync_weights(self, model):
            self.syncs += 1

    backend = Counting()
    trainer = Trainer(cfg, backend=backend)
    backend.inner = InProcessRollout(trainer.model, trainer.tokenizer, max_batch=8)
    rec = trainer.train()
    assert backend.calls == [(2, 2, "sparse")] and backend.syncs == 1
    assert rec["step"] == 1 and rec["groups"] == 2


def test_lora_settings_have_one_spelling_and_old_keys_still_load(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("distill:\n  rank: 8\n  alpha: 16\n  target_modules: [q_proj]\n")
    cfg = load_config(GRPOConfig, old)
    assert (cfg.distill.lora_r, cfg.distill.lora_alpha, cfg.distill.lora_targets) == (8, 16.0, ["q_proj"])
    err = capsys.readouterr().err
    assert "distill: 'rank' is deprecated; use 'lora_r'" in err and len(err.splitlines()) == 3
    both = tmp_path / "both.yaml"
    both.write_text("distill:\n  rank: 8\n  lora_r: 4\n")
    with pytest.raises(UsageError, match="both 'rank' and 'lora_r'"):
        load_config(GRPOConfig, both)
