"""`grpo --resume` robustness: a cut last metrics line, a run dir that holds no run yet, orphan
temporaries, and a full disk named in the error."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

from .test_grpo import _base, _err, _metrics, _run, env  # noqa: F401  (fixture)


def _args(env, out, steps):
    return _base(env, "dense", "--out", out, "--steps", str(steps), "--mode", "dense", "--checkpoint-every", "2",
                 "--reward", f"{env / 'rewards.py'}:varied")


def test_resume_drops_a_cut_last_metrics_line_and_cleans_orphans(env, tmp_path):
    out = tmp_path / "run"
    res = _run(_args(env, out, 2))
    assert res.exit_code == 0, res.output
    rec = _metrics(out)[-1]
    with open(out / "metrics.jsonl", "a") as fh:  # killed (or disk full) while appending step 3
        fh.write(json.dumps({**rec, "step": 3})[:231])
    (out / "checkpoints" / ".step-4.x1y2.tmp").mkdir()
    (out / ".curves.png.tmp.png").write_bytes(b"")
    res = _run(["grpo", env / "dense", "--tasks", env / "tasks.jsonl", "--out", out, "--resume", "--steps", "3"])
    assert res.exit_code == 0, res.output
    err = res.stderr.replace("\n", "")  # the console wraps long paths
    assert "cut last line" in err and "metrics.jsonl" in err, res.stderr
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3]
    assert not (out / "checkpoints" / ".step-4.x1y2.tmp").exists() and not (out / ".curves.png.tmp.png").exists()


def test_resume_of_a_dir_without_a_run_starts_one_like_indexer_training(env, tmp_path):
    out = tmp_path / "run"
    out.mkdir()  # killed before its config was written
    res = _run([*_args(env, out, 1), "--resume"])
    assert res.exit_code == 0, res.output
    assert "starting a new one" in res.stderr and [r["step"] for r in _metrics(out)] == [1]
    # a dir with checkpoints but no config is not silently restarted
    (out / "config.yaml").unlink()
    res = _run([*_args(env, out, 2), "--resume"])
    assert res.exit_code == 2 and "no config.yaml" in _err(res)


def test_a_full_disk_names_the_file(env, tmp_path):
    """A file-size limit makes large writes fail as a full disk does (EFBIG for ENOSPC)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))

    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "sparse_rl.cli.main", *[str(a) for a in _args(env, out, 1)]],
                         capture_output=True, text=True, timeout=300, preexec_fn=limit,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 1, res.stderr
    err = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "cannot write" in err[0] and "checkpoint" in err[0], res.stderr
    assert not [p for p in (out / "checkpoints").iterdir()]  # no half checkpoint left
