"""`bench rollout`'s kernel-choice options (--decode-select, --decode-long, --score-block, --sync-min-batch, --qkv-pad,
--pdl): validated
at config time, and passed to the engine's runner as arguments."""

import pytest

from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench
from sparse_rl.errors import UsageError
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT, DecodeSelect


@pytest.mark.parametrize("bad", [{"decode_select": "rows"}, {"decode_long": "auto"}, {"qkv_pad": 0}, {"score_block": 48},
                                 {"step_timing": "fast"}, {"sync_min_batch": -1}])
def test_bad_kernel_choices_are_usage_errors(bad):
    with pytest.raises(UsageError, match="--decode-select|--qkv-pad|--score-block|--step-timing|--sync-min-batch"):
        BenchRolloutConfig(**bad)


def test_kernel_choices_reach_the_runner():
    cfg = BenchRolloutConfig(shape="tiny", device="cpu", dtype="float32", long_new_tokens=[16], decode_select="fine",
                             decode_long="row", qkv_pad=8)
    eng = _Bench(cfg, lambda m: None, None).engine(2, 64)
    assert eng.runner.decode_select == DecodeSelect("fine", long="row", score_block=64, sync_min_batch=0)
    assert eng.runner.qkv_pad == 8
    sync = BenchRolloutConfig(shape="tiny", device="cpu", dtype="float32", long_new_tokens=[16], sync_min_batch=32)
    assert _Bench(sync, lambda m: None, None).engine(2, 64).runner.decode_select.sync_min_batch == 32
    assert _Bench(BenchRolloutConfig(shape="tiny", device="cpu", dtype="float32", long_new_tokens=[16]),
                  lambda m: None, None).engine(2, 64).runner.decode_select == ENGINE_SELECT


def test_pdl_option_reaches_the_runner_and_resolves_off_on_the_cpu():
    """--pdl: the runner's `pdl` request (no error where PDL is impossible: resolved off on a CPU)."""
    from typer.testing import CliRunner

    from sparse_rl.cli.main import app

    cfg = BenchRolloutConfig(shape="tiny", device="cpu", dtype="float32", long_new_tokens=[16], pdl=True)
    b = _Bench(cfg, lambda m: None, None)
    assert b.cfg.pdl is True and b.engine(2, 64).runner.pdl == 0
    res = CliRunner().invoke(app, ["bench", "rollout", "--help"])
    assert "--pdl" in res.output and "--no-pdl" in res.output and "--sync-min-batch" in res.output


def test_integration_contexts_straddle_every_power_of_two():
    """The integrated whole generation times steps on both sides of each power of two (the decode select's
    launch constants double there, so the step jumps) and of top-k, and at both ends."""
    from sparse_rl.bench.rollout import _span_contexts

    pts = _span_contexts(128, 32896, topk=2048, bucket=256)
    assert pts[0] == 129 and pts[-1] == 32896
    for p in (256, 512, 1024, 2048, 4096, 8192, 16384):
        assert p in pts and p + 256 in pts, p
    assert 32768 in pts and 32768 + 256 not in pts  # past the end: the end itself (32896) is the other side
    assert 2048 + 256 in pts and pts == sorted(set(pts)) and all(128 < c <= 32896 for c in pts)
    assert 65536 not in pts and 16384 + 512 not in pts
