"""`indexer train` robustness: a cut metrics line, orphan temporaries, a NaN guard, the resume of a run
killed after its last checkpoint, and a full disk named in the error."""

import io
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.sparse.train.trainer import run

from .test_indexer_train import TIMING_KEYS, _cfg, _metrics, _tensors, sharp_sparse  # noqa: F401  (fixture)


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_resume_drops_a_cut_last_metrics_line_and_orphan_temporaries(sharp_sparse, tmp_path):
    cfg = dict(steps=4, save_every=2)
    run(_cfg(sharp_sparse, tmp_path / "a", **cfg))
    full = _metrics(tmp_path / "a.run")
    run(_cfg(sharp_sparse, tmp_path / "b", steps=2, save_every=2))
    rd = tmp_path / "b.run"
    # a kill during step 3's append (disk full, power loss): the line is cut short
    with open(rd / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(full[2])[:57])
    # temporaries of a killed checkpoint write and of a killed --out write
    (rd / "checkpoints" / ".step-4.abc123.tmp").mkdir()
    (rd / "checkpoints" / ".step-4.abc123.tmp" / "optimizer.pt").write_bytes(b"x" * 10)
    (tmp_path / ".b.k9x2.tmp").mkdir()
    (rd / ".metrics.jsonl.q1w2.tmp").write_text("{}")
    buf = io.StringIO()
    run(_cfg(sharp_sparse, tmp_path / "b", **cfg), resume=True, force=True, console=Console(file=buf, width=400))
    said = buf.getvalue()
    assert "cut last line" in said and "metrics.jsonl" in said and "temporary" in said, said
    assert [r["step"] for r in _metrics(rd)] == [1, 2, 3, 4]  # every line whole, step 3 logged once
    assert not (rd / "checkpoints" / ".step-4.abc123.tmp").exists() and not (tmp_path / ".b.k9x2.tmp").exists()
    assert not (rd / ".metrics.jsonl.q1w2.tmp").exists()


def test_nan_stops_with_one_line_keeps_the_good_checkpoints_and_writes_no_output(sharp_sparse, tmp_path):
    out = tmp_path / "m"
    res = CliRunner().invoke(app, ["indexer", "train", str(sharp_sparse), "--out", str(out), "--steps", "6",
                                   "--seq-len", "64", "--batch-size", "1", "--lr", "1e30", "--grad-clip", "0",
                                   "--save-every", "1", "--keep-checkpoints", "2", "--device", "cpu"])
    assert res.exit_code == 1, res.output
    err = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "NaN/inf" in err[0] and "nothing was written to --out" in err[0], res.output
    assert not out.exists()
    ckpts = sorted((out.with_name("m.run") / "checkpoints").glob("step-*"))
    assert ckpts and str(ckpts[-1]) in err[0].replace(" and nothing", "").split("checkpoint is ")[-1]
    for c in ckpts:  # the kept checkpoints hold finite weights
        assert all(torch.isfinite(t).all() for t in _tensors(c / "trainable.safetensors").values()), c


def test_resume_after_a_kill_before_the_output_write_reports_the_last_step(sharp_sparse, tmp_path):
    run(_cfg(sharp_sparse, tmp_path / "a", steps=3, save_every=3))
    last = _metrics(tmp_path / "a.run")[-1]
    # as if killed between the last checkpoint and the --out write
    import shutil

    shutil.rmtree(tmp_path / "a")
    (tmp_path / "a.run" / "summary.json").unlink()
    summary = run(_cfg(sharp_sparse, tmp_path / "a", steps=3, save_every=3), resume=True)
    assert summary["steps"] == 3 and summary["last"]["step"] == 3 and summary["last"]["kl"] == last["kl"]
    assert (tmp_path / "a" / "indexer.safetensors").is_file()


def test_a_full_disk_names_the_file(sharp_sparse, tmp_path):
    """A file-size limit makes every large write fail as a full disk does (EFBIG for ENOSPC)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    out = tmp_path / "m"
    res = subprocess.run([sys.executable, "-m", "sparse_rl.cli.main", "indexer", "train", str(sharp_sparse), "--out",
                          str(out), "--steps", "1", "--seq-len", "64", "--device", "cpu"], capture_output=True,
                         text=True, timeout=300, preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 1, res.stderr
    err = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "cannot write" in err[0], res.stderr
    assert "checkpoints/" in err[0] and (".safetensors" in err[0] or ".pt" in err[0]), err[0]
    assert not out.exists()
    assert not list((out.with_name("m.run") / "checkpoints").iterdir())  # no half checkpoint either
