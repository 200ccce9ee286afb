"""GRPO pure functions against hand-computed values (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_rl.errors import UsageError
from sparse_rl.rl.algos import (
    ADVANTAGES,
    DISTILL_LOSSES,
    KL_ESTIMATORS,
    LOSS_AGG,
    MISMATCH,
    POLICY_LOSSES,
    KLController,
    adaptive_kl_coef,
    lookup,
    masked_entropy,
    mismatch_metrics,
    ppo_clip_loss,
    token_entropy,
    token_logprobs,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
L2, L3, L4 = math.log(2.0), math.log(3.0), math.log(4.0)


def close(x, y, tol=1e-5):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32).cpu(), torch.as_tensor(y, dtype=torch.float32), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- registry


def test_lookup_unknown_name_is_usage_error_naming_key_and_valid_names():
    assert lookup(MISMATCH, "tis", "grpo.mismatch") is MISMATCH["tis"]
    with pytest.raises(UsageError) as e:
        lookup(MISMATCH, "bogus", "grpo.mismatch")
    msg = str(e.value)
    assert "grpo.mismatch" in msg and "'bogus'" in msg
    assert "geo_rs, mis_seq, mis_token, none, opsm, tis" in msg
    assert "\n" not in msg


def test_registries_hold_the_documented_names():
    assert set(ADVANTAGES) == {"grpo", "dr_grpo"}
    assert set(LOSS_AGG) == {"token_mean", "seq_mean", "dr_grpo"}
    assert set(POLICY_LOSSES) == {"ppo_clip"}
    assert set(MISMATCH) == {"none", "tis", "mis_token", "geo_rs", "mis_seq", "opsm"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    assert {k: f.needs_logits for k, f in DISTILL_LOSSES.items()} == {"k3": False, "k2": False, "full": True}


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("device", DEVICES)
def test_grpo_advantages_grouped_matrix(device):
    # group 0: rewards 1,0,0 -> mean 1/3, deviations 2/3,-1/3,-1/3; Bessel var = (4/9+1/9+1/9)/2 = 1/3,
    # std = 1/sqrt(3) -> A = 2/sqrt(3) = 1.154701, -1/sqrt(3) = -0.577350 (x2).
    # group 1: all equal -> std 0, A = 0 exactly (eps keeps it from 0/0).
    r = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], device=device)
    a = ADVANTAGES["grpo"](r)
    assert a.dtype == torch.float32 and a.shape == (2, 3)
    assert close(a, [[1.154701, -0.577350, -0.577350], [0.0, 0.0, 0.0]])
    assert not torch.isnan(a).any()
    # Dr. GRPO: only the mean is removed.
    assert close(ADVANTAGES["dr_grpo"](r), [[2 / 3, -1 / 3, -1 / 3], [0.0, 0.0, 0.0]])


def test_grpo_advantages_flat_with_group_ids():
    # ids 0,1,0,1. group 0 = {3, 5}: mean 4, dev -1,+1, var = 2/1, std = 1.414214 -> -0.707107, +0.707107.
    # group 1 = {1, 7}: mean 4, dev -3,+3, var = 18, std = 4.242641 -> -0.707107, +0.707107.
    r = torch.tensor([3.0, 1.0, 5.0, 7.0])
    expect = [-0.707107, -0.707107, 0.707107, 0.707107]
    assert close(ADVANTAGES["grpo"](r, torch.tensor([0, 1, 0, 1])), expect)
    assert close(ADVANTAGES["grpo"](r, ["q1", "q2", "q1", "q2"]), expect)  # any hashable ids
    assert close(ADVANTAGES["dr_grpo"](r, [0, 1, 0, 1]), [-1.0, -3.0, 1.0, 3.0])
    # unequal group sizes; a group of one gets advantage 0
    assert close(ADVANTAGES["grpo"](torch.tensor([2.0, 9.0, 0.0]), [7, 8, 7]), [0.707107, 0.0, -0.707107])


def test_advantages_bf16_in_float32_out_and_shape_errors():
    a = ADVANTAGES["grpo"](torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16))
    assert a.dtype == torch.float32
    # deviations +-0.5, var = 0.5/1, std = 0.707107 -> +-0.707107
    assert close(a, [[0.707107, -0.707107]])
    with pytest.raises(ValueError):
        ADVANTAGES["grpo"](torch.tensor([1.0, 2.0]))  # flat rewards need group ids
    with pytest.raises(ValueError):
        ADVANTAGES["grpo"](torch.tensor([1.0, 2.0]), [0])


# ----------------------------------------------------------------------------- loss aggregation

# loss [[1,2,3],[4,x,x]] with the x positions masked: sum of valid = 10, 4 valid tokens.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("device", DEVICES)
def test_loss_aggregation_hand_values(device):
    loss, mask = LOSS.to(device), MASK.to(device)
    assert close(LOSS_AGG["token_mean"](loss, mask), 2.5)  # 10 / 4
    assert close(LOSS_AGG["seq_mean"](loss, mask), 3.0)  # (6/3 + 4/1) / 2
    assert close(LOSS_AGG["dr_grpo"](loss, mask), 10 / 6)  # 10 / (2 seqs * T=3)
    assert close(LOSS_AGG["dr_grpo"](loss, mask, max_len=5), 1.0)  # 10 / (2 * 5)
    # explicit global normalisers (micro-batching / data parallel)
    assert close(LOSS_AGG["token_mean"](loss, mask, num_tokens=8), 1.25)
    assert close(LOSS_AGG["seq_mean"](loss, mask, num_seqs=4), 1.5)
    assert close(LOSS_AGG["dr_grpo"](loss, mask, num_seqs=4, max_len=5), 0.5)


def test_loss_aggregation_micro_batches_sum_to_full_batch():
    for name in LOSS_AGG:
        full = LOSS_AGG[name](LOSS, MASK)
        parts = sum(
            LOSS_AGG[name](LOSS[i : i + 1], MASK[i : i + 1], num_tokens=4, num_seqs=2, max_len=3) for i in range(2)
        )
        assert close(parts, full), name


def test_seq_mean_ignores_empty_sequences_and_all_masked_is_zero():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert close(LOSS_AGG["seq_mean"](LOSS, mask), 2.0)  # only row 0: 6/3
    zero = torch.zeros(2, 3, dtype=torch.long)
    for name in LOSS_AGG:
        out = LOSS_AGG[name](LOSS, zero)
        assert close(out, 0.0) and not torch.isnan(out)


# ----------------------------------------------------------------------------- PPO clipped loss
# ratios r = exp(logp - logp_old): row 0 (A=+1) 1.0, 1.5, 0.5; row 1 (A=-1) 1.0, 0.5, 4.0; eps 0.2/0.28.
#   A=+1: l = max(-r, -clip(r, .8, 1.28)):  r=1 -> -1;  r=1.5 -> max(-1.5,-1.28) = -1.28 (high clip);
#         r=.5 -> max(-.5,-.8) = -.5
#   A=-1: l = max(r, clip(r)):  r=1 -> 1;  r=.5 -> max(.5,.8) = .8 (low clip);  r=4 -> 4 (dual clip 3 -> 3)
#   token mean = (-1 - 1.28 - .5 + 1 + .8 + 4) / 6 = 3.02 / 6 = 0.503333; with dual clip 2.02/6 = 0.336667
#   k1 KL(old||new) = mean(-log r) = -(ln1.5 + ln.5 + ln.5 + ln4)/6 = -0.405465/6 = -0.067578
#   k3 = mean(r - 1 - ln r) = (0 + .094535 + .193147 + 0 + .193147 + 1.613706)/6 = 0.349089
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.5, 4.0]])
ADV = torch.tensor([1.0, -1.0])


@pytest.mark.parametrize("device", DEVICES)
def test_ppo_clip_loss_hand_values_and_stats(device):
    logp = RATIOS.log().to(device).requires_grad_(True)
    old = torch.zeros(2, 3, device=device)
    mask = torch.ones(2, 3, device=device)
    loss, st = ppo_clip_loss(logp, old, ADV.to(device), mask, eps_low=0.2, eps_high=0.28)
    assert close(loss, 0.503333)
    assert close(st["clip_frac_high"], 1 / 6) and close(st["clip_frac_low"], 1 / 6) and close(st["clip_frac"], 2 / 6)
    assert close(st["dual_clip_frac"], 0.0)
    assert close(st["approx_kl_k1"], -0.067578) and close(st["approx_kl"], 0.349089)
    assert close(st["ratio_mean"], 8.5 / 6)
    loss.backward()
    # d l / d logp = -A r where unclipped, 0 where clipped; / 6 tokens
    assert close(logp.grad, [[-1 / 6, 0.0, -0.5 / 6], [1 / 6, 0.0, 4 / 6]])


def test_ppo_dual_clip_weights_padding_and_agg():
    old = torch.zeros(2, 3)
    ones = torch.ones(2, 3)
    logp = RATIOS.log().requires_grad_(True)
    loss, st = ppo_clip_loss(logp, old, ADV, ones, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    assert close(loss, 0.336667) and close(st["dual_clip_frac"], 1 / 6)
    loss.backward()
    assert close(logp.grad[1, 2], 0.0)  # capped at -A * 3: no gradient
    # symmetric eps 0.2: r=1.5 is clipped at 1.2 -> total = -1 -1.2 -.5 +1 +.8 +4 = 3.1 -> /6
    loss, _ = ppo_clip_loss(RATIOS.log(), old, ADV, ones, eps_low=0.2, eps_high=0.2)
    assert close(loss, 3.1 / 6)
    # correction weights drop the r=4 token: 3.02 - 4 = -0.98 -> /6
    w = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, _ = ppo_clip_loss(RATIOS.log(), old, ADV, ones, weights=w)
    assert close(loss, -0.98 / 6)
    # padding the r=4 token instead removes it from the normaliser too: -0.98 / 5
    loss, st = ppo_clip_loss(RATIOS.log(), old, ADV[:, None].expand(2, 3), w)
    assert close(loss, -0.98 / 5) and close(st["clip_frac"], 2 / 5)
    # Dr. GRPO aggregation with max_len 4: 3.02 / (2 * 4)
    loss, _ = ppo_clip_loss(RATIOS.log(), old, ADV, ones, agg="dr_grpo", max_len=4)
    assert close(loss, 0.3775)
    with pytest.raises(UsageError, match="loss_agg"):
        ppo_clip_loss(RATIOS.log(), old, ADV, ones, agg="nope")


def test_ppo_bf16_inputs_compute_in_float32():
    logp = RATIOS.log().to(torch.bfloat16)
    loss, _ = ppo_clip_loss(logp, torch.zeros(2, 3, dtype=torch.bfloat16), ADV, torch.ones(2, 3))
    assert loss.dtype == torch.float32
    assert close(loss, 0.503333, tol=2e-2)  # bf16 rounding of log(1.5) etc.


# ----------------------------------------------------------------------------- mismatch corrections
# mu = 0.4 on every token except the padded one; pi/mu ratios:
#   row 0: 1, 2.5, 0.4        row 1: 1, 0.25, [pad: pi .4 / mu .1 = 4]
PI = torch.tensor([[0.4, 1.0, 0.16], [0.4, 0.1, 0.4]]).log()
MU = torch.tensor([[0.4, 0.4, 0.4], [0.4, 0.4, 0.1]]).log()
MMASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize("device", DEVICES)
def test_truncated_and_masked_is(device):
    pi, mu, m = PI.to(device), MU.to(device), MMASK.to(device)
    adv = torch.tensor([1.0, -1.0], device=device)
    w, st = MISMATCH["none"](pi, mu, m, adv)
    assert close(w, MMASK.float()) and close(st["mean_weight"], 1.0) and close(st["frac_masked"], 0.0)
    # TIS cap 2: min(r, 2) -> [[1, 2, .4], [1, .25, 0(pad)]]; mean over 5 valid = 4.65/5; 1 of 5 capped
    w, st = MISMATCH["tis"](pi, mu, m, adv, cap=2.0)
    assert close(w, [[1.0, 2.0, 0.4], [1.0, 0.25, 0.0]])
    assert close(st["mean_weight"], 0.93) and close(st["frac_truncated"], 0.2)
    # token MIS [.5, 2]: keeps r=1 (twice), drops 2.5, .4, .25 -> 3 of 5 masked, mean weight 2/5
    w, st = MISMATCH["mis_token"](pi, mu, m, adv, lo=0.5, hi=2.0)
    assert close(w, [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert close(st["frac_masked"], 0.6) and close(st["mean_weight"], 0.4)


def test_geometric_rejection_sampling_filters_on_the_geometric_mean_with_weight_one():
    adv = torch.tensor([1.0, -1.0])
    # rho_geo_0 = exp((0 + ln2.5 + ln.4)/3) = exp(0) = 1;  rho_geo_1 = exp((0 + ln.25)/2) = .5 (the pad's
    # ln4 is excluded; counting it would give exp(0) = 1).
    w, st = MISMATCH["geo_rs"](PI, MU, MMASK, adv, lo=0.6, hi=2.0)
    assert close(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert close(st["frac_masked"], 0.4) and close(st["mean_weight"], 0.6)
    w, st = MISMATCH["geo_rs"](PI, MU, MMASK, adv, lo=0.4, hi=2.0)
    assert close(w, MMASK.float())  # kept sequences are not reweighted
    assert close(st["mean_weight"], 1.0) and close(st["frac_masked"], 0.0)


def test_sequence_masked_is_filters_and_weights_by_the_product_ratio():
    adv = torch.tensor([1.0, -1.0])
    # rho_0 = 1 * 2.5 * .4 = 1;  rho_1 = 1 * .25 = .25 (pad excluded)
    w, st = MISMATCH["mis_seq"](PI, MU, MMASK, adv, lo=0.2, hi=2.0)
    assert close(w, [[1.0, 1.0, 1.0], [0.25, 0.25, 0.0]])
    assert close(st["mean_weight"], 3.5 / 5) and close(st["frac_masked"], 0.0)
    # lo .4: geo_rs keeps row 1 (rho_geo .5) but its product ratio .25 is out of range
    w, st = MISMATCH["mis_seq"](PI, MU, MMASK, adv, lo=0.4, hi=2.0)
    assert close(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert close(st["frac_masked"], 0.4)
    # hi below 1: row 0 (rho 1) rejected too
    w, _ = MISMATCH["mis_seq"](PI, MU, MMASK, adv, lo=0.2, hi=0.9)
    assert close(w, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]])


def test_keep_sampling_mask_makes_identical_policies_ratio_one_under_top_p():
    from sparse_rl.rl.algos.mismatch import sampling_support, support_logprobs
    from sparse_rl.rl.rollout.sampler import SamplingParams, process_logits

    g = torch.Generator().manual_seed(0)
    B, T, V = 64, 16, 50
    logits = torch.randn(B, T, V, generator=g) * 2.0
    mu_dist = process_logits(logits.reshape(-1, V), SamplingParams(temperature=1.0, top_p=0.8)).reshape(B, T, V)
    tokens = torch.multinomial(mu_dist.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    logp_mu = mu_dist.gather(-1, tokens[..., None]).squeeze(-1)  # what the rollout records
    mask = torch.ones(B, T)
    full = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    support = sampling_support(logits, top_p=0.8)
    assert bool(support.gather(-1, tokens[..., None]).all())  # every sampled token is in the support
    kept = support_logprobs(logits, tokens, support)
    # pi over the full vocabulary: E[pi/mu] = mass of the support (<= ~0.8 + the crossing token), biased
    biased = ((full - logp_mu).exp() * mask).sum() / mask.sum()
    assert float(biased) < 0.95
    # pi over mu's support: the ratio is exactly 1 token by token, so its mean is 1
    ratio = (kept - logp_mu).exp()
    assert close(ratio, torch.ones(B, T), tol=1e-5)
    # and the mismatch corrections see no drift
    w, st = MISMATCH["mis_token"](kept, logp_mu, mask, torch.ones(B), lo=0.99, hi=1.01)
    assert close(st["frac_masked"], 0.0)
    # support by hand on one row: probs .5 .3 .15 .05, top-p .8 keeps .5 and .3 (mass above .3 is .5 < .8)
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert sampling_support(row[None], top_p=0.8).tolist() == [[True, True, False, False]]
    assert sampling_support(row[None], top_k=3).tolist() == [[True, True, True, False]]
    lp = support_logprobs(row[None, None], torch.tensor([[1]]), sampling_support(row[None, None], top_p=0.8))
    assert close(lp.exp(), [[0.3 / 0.8]])


def test_deepseek_v32_off_policy_sequence_masking():
    # mean log(mu/pi): row 0 = -(0 + ln2.5 + ln.4)/3 = 0; row 1 = -(0 + ln.25)/2 = ln2 = 0.693
    w, st = MISMATCH["opsm"](PI, MU, MMASK, torch.tensor([-1.0, -1.0]), delta=0.5)
    assert close(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 1: A<0 and 0.693 > 0.5
    assert close(st["frac_masked"], 0.4)
    # positive advantage is never masked, however far off-policy
    w, _ = MISMATCH["opsm"](PI, MU, MMASK, torch.tensor([-1.0, 1.0]), delta=0.5)
    assert close(w, MMASK.float())
    # delta above the drift: nothing masked; token-level advantages [B, T] accepted
    w, _ = MISMATCH["opsm"](PI, MU, MMASK, -torch.ones(2, 3), delta=0.7)
    assert close(w, MMASK.float())


def test_correction_weights_are_detached():
    pi = PI.clone().requires_grad_(True)
    for name, fn in MISMATCH.items():
        w, _ = fn(pi, MU, MMASK, torch.tensor([1.0, -1.0]))
        assert not w.requires_grad, name
        assert w.dtype == torch.float32


def test_mismatch_metrics_hand_values():
    # valid ratios r = pi/mu: 1, 2.5, .4, 1, .25
    # k3 = r - 1 - ln r: 0, .583709, .316291, 0, .636294 -> mean 0.307259; k1 = mean(-ln r) = ln4/5 = 0.277259
    # min(1, r) sorted: .25 .4 1 1 1; 5th pct: pos .05*4 = .2 -> .25 + .2*(.4-.25) = 0.28
    m = mismatch_metrics(PI, MU, MMASK)
    assert abs(m["mismatch_kl"] - 0.307259) < 1e-5
    assert abs(m["mismatch_kl_k1"] - 0.277259) < 1e-5
    assert abs(m["p5_min_ratio"] - 0.28) < 1e-6
    assert abs(mismatch_metrics(PI, MU, MMASK, q=0.5)["p5_min_ratio"] - 1.0) < 1e-6
    assert math.isnan(mismatch_metrics(PI, MU, torch.zeros(2, 3))["mismatch_kl"])


# ----------------------------------------------------------------------------- KL to reference


@pytest.mark.parametrize("device", DEVICES)
def test_kl_estimators_hand_values(device):
    # token 0: p=.5, ref=.25 -> log r = ln(ref/p) = -ln2: k1 = ln2, k2 = ln2^2/2 = .240227, k3 = .5 - 1 + ln2 = .193147
    # token 1: p=.25, ref=.5 -> log r = +ln2: k1 = -ln2, k2 = .240227, k3 = 2 - 1 - ln2 = .306853
    logp = torch.tensor([[0.5, 0.25]], device=device).log()
    ref = torch.tensor([[0.25, 0.5]], device=device).log()
    assert close(KL_ESTIMATORS["k1"](logp, ref), [[L2, -L2]])
    assert close(KL_ESTIMATORS["k2"](logp, ref), [[0.240227, 0.240227]])
    assert close(KL_ESTIMATORS["k3"](logp, ref), [[0.193147, 0.306853]])
    assert KL_ESTIMATORS["k3"](logp.bfloat16(), ref.bfloat16()).dtype == torch.float32
    with pytest.raises(UsageError, match=r"kl\.estimator.*k1, k2, k3"):
        lookup(KL_ESTIMATORS, "k4", "kl.estimator")


def test_adaptive_kl_controller():
    # e = clip(9/6 - 1, -.2, .2) = .2; coef = .1 * (1 + .2 * 256/10000) = .100512
    assert abs(adaptive_kl_coef(0.1, 9.0, target=6.0, horizon=10000, n_steps=256) - 0.100512) < 1e-9
    # e = 5.4/6 - 1 = -.1; coef = .1 * (1 - .1 * .0256) = .099744
    assert abs(adaptive_kl_coef(0.1, 5.4, target=6.0, horizon=10000, n_steps=256) - 0.099744) < 1e-9
    fixed = KLController(coef=0.05)
    assert fixed.update(100.0, 256) == 0.05
    ctl = KLController(coef=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, 256)
    again = KLController(coef=0.0, target=6.0, horizon=10000)
    again.load_state_dict(ctl.state_dict())
    assert again.coef == ctl.coef and abs(ctl.coef - 0.100512) < 1e-9


# ----------------------------------------------------------------------------- distillation and entropy


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_token_distillation_hand_values(device):
    # token 0: student .5, teacher .25 -> r = teacher/student = .5: k3 = .193147, d/dlogp_s = 1 - r = .5
    # token 1: student .25, teacher .5 -> r = 2: k3 = .306853, d/dlogp_s = 1 - 2 = -1; mean over 2 -> .25
    s = torch.tensor([[0.5, 0.25, 0.9]], device=device).log().requires_grad_(True)
    t = torch.tensor([[0.25, 0.5, 0.1]], device=device).log()
    m = torch.tensor([[1, 1, 0]], device=device)
    loss, st = DISTILL_LOSSES["k3"](s, t, m)
    assert close(loss, 0.25) and close(st["kl"], 0.25)
    loss.backward()
    assert close(s.grad, [[0.25, -0.5, 0.0]])
    # k2: (ln2)^2/2 both tokens = .240227; grad (logp_s - logp_t)/2 = +-ln2/2; reported kl is the k3 value
    s.grad = None
    loss, st = DISTILL_LOSSES["k2"](s, t, m)
    assert close(loss, 0.240227) and close(st["kl"], 0.25)
    loss.backward()
    assert close(s.grad, [[L2 / 2, -L2 / 2, 0.0]])
    assert not t.requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_full_vocab_reverse_kl_hand_values(device):
    # position 0: mu = softmax(0,0) = (.5,.5), pi = softmax(ln3, 0) = (.75,.25):
    #   KL = .5 ln(.5/.75) + .5 ln(.5/.25) = .5(-.405465) + .5(.693147) = .143841
    #   dKL/dz_k = mu_k (ln mu_k - ln pi_k - KL) = .5(-.405465-.143841), .5(.693147-.143841) = -/+ .274653
    # position 1: identical -> 0.  position 2: masked (very different). Mean over 2 valid -> .0719205
    s = torch.tensor([[[0.0, 0.0], [1.0, 2.0], [5.0, -5.0]]], device=device, requires_grad=True)
    t = torch.tensor([[[L3, 0.0], [1.0, 2.0], [-5.0, 5.0]]], device=device)
    m = torch.tensor([[1, 1, 0]], device=device)
    for chunk in (1, 2, 512):
        s.grad = None
        loss, st = DISTILL_LOSSES["full"](s, t, m, chunk_size=chunk)
        assert close(loss, 0.0719205) and close(st["kl"], 0.0719205)
        loss.backward()
        assert close(s.grad, [[[-0.274653 / 2, 0.274653 / 2], [0.0, 0.0], [0.0, 0.0]]]), chunk
    loss, _ = DISTILL_LOSSES["full"](s.detach().bfloat16(), t.bfloat16(), m)
    assert loss.dtype == torch.float32 and close(loss, 0.0719205, tol=1e-2)


def test_distillation_lowers_reverse_kl_on_a_fixed_batch():
    # One context, vocab 6: the student's own samples, then 60 Adam steps on each loss; the exact
    # KL(mu || pi) must fall well below its start.
    torch.manual_seed(0)
    teacher = torch.randn(6) * 2
    for name in ("k3", "k2", "full"):
        z = torch.zeros(6, requires_grad=True)
        opt = torch.optim.Adam([z], lr=0.1)
        tokens = torch.multinomial(torch.softmax(z.detach(), -1), 512, replacement=True)  # [512]

        def exact():
            ls, lt = torch.log_softmax(z.detach(), -1), torch.log_softmax(teacher, -1)
            return float((ls.exp() * (ls - lt)).sum())

        start = exact()
        for _ in range(60):
            opt.zero_grad()
            if name == "full":
                loss, _ = DISTILL_LOSSES[name](z.expand(1, 1, 6), teacher.expand(1, 1, 6), torch.ones(1, 1))
            else:
                ls = torch.log_softmax(z, -1)[tokens][None]  # [1, 512] student log-probs of sampled tokens
                lt = torch.log_softmax(teacher, -1)[tokens][None]
                loss, _ = DISTILL_LOSSES[name](ls, lt, torch.ones(1, 512))
            loss.backward()
            opt.step()
        assert exact() < 0.05 * start, (name, start, exact())


@pytest.mark.parametrize("device", DEVICES)
def test_entropy_hand_values(device):
    # uniform over 4: ln4 = 1.386294; (.75, .25, 0, 0 via -inf-ish): -(.75 ln.75 + .25 ln.25) = .562335
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [L3, 0.0, -1e4, -1e4], [9.0, 0.0, 0.0, 0.0]]], device=device)
    assert close(token_entropy(logits, chunk_size=2)[0, :2], [L4, 0.562335])
    m = torch.tensor([[1, 1, 0]], device=device)
    assert close(masked_entropy(logits, m, chunk_size=1), (L4 + 0.562335) / 2)
    assert masked_entropy(logits.bfloat16(), m).dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_token_logprobs_hand_values(device):
    # position 0: uniform over 4, token 2 -> ln(1/4) = -1.386294; grad = onehot - p = (-.25, -.25, .75, -.25)
    # position 1: p = (.75, .25, 0, 0), token 1 -> ln .25 = -1.386294; grad = (-.75, .75, 0, 0)
    z = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [L3, 0.0, -1e4, -1e4]]], device=device, requires_grad=True)
    lp = token_logprobs(z, torch.tensor([[2, 1]], device=device), chunk_size=1)
    assert close(lp, [[-L4, -L4]])
    lp.sum().backward()
    assert close(z.grad, [[[-0.25, -0.25, 0.75, -0.25], [-0.75, 0.75, 0.0, 0.0]]])
    assert token_logprobs(z.detach().bfloat16(), torch.tensor([[2, 1]], device=device)).dtype == torch.float32
