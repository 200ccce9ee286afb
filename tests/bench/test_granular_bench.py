"""The granular rows of `sparse-rl bench attention` (bench/granular.py) on tiny CPU inputs: every
column is filled, the selection check compares with the reference, bad specs are usage errors."""

import pytest
import torch
from typer.testing import CliRunner

from sparse_rl.bench.granular import granular_rows, markdown_granular, parse_granularity
from sparse_rl.cli.main import app
from sparse_rl.errors import UsageError


def test_parse_granularity():
    assert parse_granularity("kb16") == (16, 1) and parse_granularity("g16") == (1, 16)
    assert parse_granularity("kb4g8") == (4, 8)
    for bad in ("", "kb3", "x16", "g0"):
        with pytest.raises(UsageError, match="granularity"):
            parse_granularity(bad)


def test_granular_rows_time_check_and_skip():
    g = torch.Generator().manual_seed(0)
    B, L, H, Hkv, D = 1, 32, 4, 1, 16
    q, k, v = torch.randn(B, L, H, D, generator=g), torch.randn(B, L, Hkv, D, generator=g), torch.randn(B, L, Hkv, D, generator=g)
    index = (torch.randn(B, L, 1, 16, generator=g), torch.rand(B, L, 1, generator=g), torch.randn(B, L, 16, generator=g))
    rows = granular_rows(q, k, v, {"random": index}, ["g4", "kb16"], 16, 2, 4, torch.device("cpu"),
                         dict(warmup_ms=1, rep_ms=1), dense_ms=1.0, dense_fwdbwd_ms=2.0, grad=torch.randn_like(q),
                         check_n=8)
    g4, kb16 = rows
    assert g4["granularity"] == "g4" and g4["query_group"] == 4
    for key in ("select_ms", "attn_ms", "attn_tflops", "prefill_ms", "fwdbwd_ms", "select_fwdbwd_ms", "union_ratio"):
        assert g4[key] > 0, key
    assert g4["select_rows_equal"] == 1.0 and g4["select_recall"] == 1.0 and g4["attn_out_rel_err"] < 1e-5
    assert "no whole block of 16" in kb16["skipped"]  # 16 - 2 - 4 leaves 10 keys: no block of 16
    table = "\n".join(markdown_granular(rows))
    assert "| 32 | random | g4 |" in table and "kb16" not in table


def test_cli_rejects_a_bad_granularity():
    res = CliRunner().invoke(app, ["bench", "attention", "--seqlens", "24", "--granular", "kb3", "--device", "cpu"])
    assert res.exit_code == 2 and "kb3" in res.output
