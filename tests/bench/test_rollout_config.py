"""`bench rollout`'s kernel-choice options (--decode-select, --decode-long, --score-block, --qkv-pad): validated
at config time, and passed to the engine's runner as arguments."""

import pytest

from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench
from sparse_rl.errors import UsageError
from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect


@pytest.mark.parametrize("bad", [{"decode_select": "rows"}, {"decode_long": "auto"}, {"qkv_pad": 0}, {"score_block": 48}])
def test_bad_kernel_choices_are_usage_errors(bad):
    with pytest.raises(UsageError, match="--decode-select|--qkv-pad|--score-block"):
        BenchRolloutConfig(**bad)


def test_kernel_choices_reach_the_runner():
    cfg = BenchRolloutConfig(shape="tiny", device="cpu", dtype="float32", long_new_tokens=[16], decode_select="fine",
                             decode_long="row", qkv_pad=8)
    eng = _Bench(cfg, lambda m: None, None).engine(2, 64)
    assert eng.runner.decode_select == DecodeSelect("fine", long="row", score_block=64) and eng.runner.qkv_pad == 8
