"""Inputs and outputs shared by every stage (sparse_rl.io): what a careless user or a broken file
does to them. Each case ends in a one-line error naming the file, or in the output the user asked
for, never in a replaced device, a traceback or a half-written set of outputs."""

import io
import json
import os
import stat
import sys
import threading

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.errors import SparseRLError
from sparse_rl.io import atomic_dir, atomic_write_json, iter_jsonl, open_output

runner = CliRunner()


def _one_error_line(res) -> str:
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_device_and_fifo_outputs_are_written_in_place(tmp_path):
    """Renaming a temp file over a device would turn it into a regular file (`--stats /dev/null`)."""
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs root (CAP_MKNOD)")
    res = runner.invoke(app, ["synth", "math", "--num-tasks", "2", "--out", str(tmp_path / "t.jsonl"), "--stats", str(null)])
    assert res.exit_code == 0, res.output
    assert stat.S_ISCHR(os.stat(null).st_mode)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    atomic_write_json(fifo, {"a": 1})
    reader.join(10)
    assert json.loads(got[0]) == {"a": 1} and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_outputs_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with open_output(tmp_path / "f.txt") as fh:
            fh.write("x")
        with atomic_dir(tmp_path / "d") as d:
            (d / "x").write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "f.txt").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o755


def test_a_symlinked_output_replaces_its_target(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("{}")
    (tmp_path / "link.json").symlink_to(target)
    atomic_write_json(tmp_path / "link.json", {"b": 2})
    assert (tmp_path / "link.json").is_symlink() and json.loads(target.read_text()) == {"b": 2}


def test_json_errors_name_line_and_column_once(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\n{"a": "unterminated\n')
    with pytest.raises(SparseRLError) as e:
        list(iter_jsonl(p))
    assert str(e.value) == f"{p} line 2: invalid JSON at column 20: Invalid control character"


def test_binary_jsonl_names_file_and_line(tmp_path, tiny_model_dir):
    p = tmp_path / "bin.jsonl"
    p.write_bytes(b'{"id": "a", "prompt": "x", "answer": "1"}\n\x89PNG\r\n\x1a\n\xff\xfe\x00')
    with pytest.raises(SparseRLError, match=r"bin.jsonl line 2: not UTF-8 text \(byte 0x89 at column 1\)"):
        list(iter_jsonl(p))
    p.write_bytes(b"\n\x89PNG\r\n\x1a\n\xff\xfe\x00")
    for args in (["generate", str(tiny_model_dir), "--prompts", str(p)],
                 ["grpo", str(tiny_model_dir), "--tasks", str(p), "--out", str(tmp_path / "run")],
                 ["synth", "agent", "--tasks-in", str(p), "--out", str(tmp_path / "o.jsonl")]):
        res = runner.invoke(app, args)
        line = _one_error_line(res)
        assert res.exit_code in (1, 2) and "bin.jsonl line 2" in line and "UnicodeDecodeError" not in line, (args, line)


def test_binary_yaml_is_a_usage_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"n: 3\n\xff\xfe\x00\x01")
    res = runner.invoke(app, ["synth", "math", "--config", str(cfg)])
    assert res.exit_code == 2 and "c.yaml line 2: not UTF-8" in _one_error_line(res)


def test_tasks_from_stdin_and_closed_stdin(monkeypatch):
    from sparse_rl.rl.grpo.data import load_tasks

    recs = [{"id": "a", "prompt": "1+1?", "answer": "2"}, {"id": "b", "prompt": "2+2?"}]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(map(json.dumps, recs)) + "\n").encode())))
    with pytest.raises(SparseRLError, match=r"<stdin> line 2: task 'b' has no 'answer'"):
        load_tasks("-", "math")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((json.dumps(recs[0]) + "\n").encode())))
    assert [t["id"] for t in load_tasks("-", "math")] == ["a"]
    monkeypatch.setattr(sys, "stdin", None)  # what Python gives a process started with `<&-`
    with pytest.raises(SparseRLError, match="standard input is closed"):
        load_tasks("-", "math")


def test_agent_failing_on_one_output_writes_none(tmp_path):
    trj = tmp_path / "trajs.jsonl"
    res = runner.invoke(app, ["synth", "agent", "--n", "2", "--envs", "fs", "-k", "1", "--trajectories", str(trj),
                              "--out", "/proc/1/cannot-write-here.jsonl"])
    assert res.exit_code == 1, res.output
    assert list(tmp_path.iterdir()) == []
