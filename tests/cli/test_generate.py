"""`sparse-rl generate` end to end: files, stdin/stdout, n samples, log-probs, bad input."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app

PROMPTS = [
    {"id": "p1", "prompt": "2+2=", "task": "math", "answer": "4"},
    {"id": "p2", "messages": [{"role": "user", "content": "Say hi."}]},
    {"id": "p3", "prompt": "The capital of France is"},
]


@pytest.fixture(scope="module")
def sparse_model(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "sparse"
    res = CliRunner().invoke(app, ["convert", str(tiny_model_dir), str(out), "--index-topk", "8", "--index-heads", "2",
                                   "--index-dim", "16", "--rope-dim", "8", "--sink", "1", "--window", "2",
                                   "--dense-layers", "0"])
    assert res.exit_code == 0, res.output
    return out


def _write(path, lines):
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


def test_generate_file_to_file(sparse_model, tmp_path):
    src = _write(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "c.jsonl"
    res = CliRunner().invoke(app, ["generate", str(sparse_model), "--prompts", str(src), "--out", str(out),
                                   "--attention", "sparse", "--samples", "2", "--temperature", "0.8", "--top-k", "40",
                                   "--max-new-tokens", "12", "--max-batch", "4", "--logprobs", "--seed", "1",
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in rows] == [(p["id"], j) for p in PROMPTS for j in range(2)]
    for r in rows:
        assert len(r["tokens"]) == len(r["logprobs"]) <= 12 and r["finish_reason"] in ("stop", "length")
        assert all(lp <= 0 for lp in r["logprobs"]) and isinstance(r["completion"], str)
    assert rows[0]["answer"] == "4" and rows[0]["task"] == "math" and rows[0]["prompt"] == "2+2="
    assert rows[2]["prompt"].startswith("<|im_start|>user\nSay hi.<|im_end|>") and rows[2]["prompt"].endswith("assistant\n")
    # same seed, same completions
    out2 = tmp_path / "c2.jsonl"
    res = CliRunner().invoke(app, ["generate", str(sparse_model), "--prompts", str(src), "--out", str(out2),
                                   "--attention", "sparse", "--samples", "2", "--temperature", "0.8", "--top-k", "40",
                                   "--max-new-tokens", "12", "--max-batch", "2", "--logprobs", "--seed", "1",
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["tokens"] for x in out2.read_text().splitlines()] == [r["tokens"] for r in rows]


def test_generate_streams_stdin_to_stdout(sparse_model):
    """Completions of the first chunk arrive while stdin is still open; a bad line in a later chunk
    stops the run with a one-line error naming it, after the earlier chunk was written."""
    import queue
    import threading

    env = dict(os.environ, PYTHONPATH=os.getcwd())
    # --batch-size 1 -> chunks of 4 prompts
    proc = subprocess.Popen([sys.executable, "-m", "sparse_rl.cli.main", "generate", str(sparse_model), "--prompts",
                             "-", "--temperature", "0", "--max-new-tokens", "6", "--max-batch", "1", "--device", "cpu"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = [dict(p, id=f"{p['id']}-{i}") for i, p in enumerate(PROMPTS + PROMPTS[:1])]
        proc.stdin.write("".join(json.dumps(p) + "\n" for p in first))
        proc.stdin.flush()
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")] + [lines.put(None)],
                                  daemon=True)
        reader.start()
        rows = []
        while len(rows) < 4:
            try:
                rows.append(json.loads(lines.get(timeout=120)))
            except queue.Empty:
                raise AssertionError("no output for the first chunk while stdin is open: not streaming") from None
        assert [r["id"] for r in rows] == [p["id"] for p in first] and "sample" not in rows[0]
        assert "logprobs" not in rows[0] and rows[0]["answer"] == "4"
        proc.stdin.write(json.dumps(PROMPTS[1]) + "\n" + "{oops\n")
        proc.stdin.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 1
        reader.join(timeout=10)
    finally:
        proc.kill()
    assert lines.get(timeout=5) is None  # the bad chunk wrote nothing
    err_lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert err_lines == [err_lines[0]] and "<stdin> line 6: invalid JSON" in err_lines[0]


@pytest.mark.parametrize("bad,line,msg", [
    ('{"id": "x", "prompt": "a"\n', 2, "invalid JSON"),
    ('{"id": "x"}\n', 2, "needs a 'prompt'"),
    ('{"prompt": "a"}\n', 2, "missing field 'id'"),
    ('{"id": "x", "messages": "hi"}\n', 2, "'messages' must be"),
])
def test_bad_prompts_file(sparse_model, tmp_path, bad, line, msg):
    src = _write(tmp_path / "p.jsonl", [PROMPTS[0], bad, PROMPTS[2]])
    out = tmp_path / "c.jsonl"
    res = CliRunner().invoke(app, ["generate", str(sparse_model), "--prompts", str(src), "--out", str(out),
                                   "--device", "cpu", "--max-new-tokens", "4"])
    assert res.exit_code == 1
    err = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and f"line {line}" in err[0] and msg in err[0] and str(src) in err[0]
    assert not out.exists() and not list(tmp_path.glob(".c.jsonl*"))


def test_bad_flags(sparse_model, tmp_path):
    src = _write(tmp_path / "p.jsonl", PROMPTS)
    res = CliRunner().invoke(app, ["generate", str(sparse_model), "--prompts", str(src), "--top-p", "1.5"])
    assert res.exit_code == 2 and "--top-p" in res.output
    res = CliRunner().invoke(app, ["generate", str(sparse_model), "--prompts", str(src), "--samples", "8", "--max-batch", "4"])
    assert res.exit_code == 2 and "--max-batch" in res.output
    res = CliRunner().invoke(app, ["generate", str(tmp_path / "nope"), "--prompts", str(src)])
    assert res.exit_code == 1 and "no such directory" in res.output


def test_adapter_is_merged_as_peft_merges_it(sparse_model, tmp_path):
    """`--adapter DIR` samples from W + scaling * B @ A: the same tokens and log-probs as the model that
    peft's own merge_and_unload writes; a dir without an adapter is named in a one-line error."""
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(sparse_model), dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # peft starts B at zero: a non-trivial adapter
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    merged = tmp_path / "merged"
    shutil.copytree(sparse_model, merged)
    peft_model.merge_and_unload().save_pretrained(str(merged))
    src = _write(tmp_path / "p.jsonl", PROMPTS)
    rows = {}
    for name, model, extra in (("adapter", sparse_model, ["--adapter", str(tmp_path / "adapter")]),
                               ("merged", merged, []), ("plain", sparse_model, [])):
        out = tmp_path / f"{name}.jsonl"
        res = CliRunner().invoke(app, ["generate", str(model), "--prompts", str(src), "--out", str(out), "--attention",
                                       "sparse", "--temperature", "0", "--max-new-tokens", "10", "--logprobs",
                                       "--device", "cpu", *extra])
        assert res.exit_code == 0, res.output
        rows[name] = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["tokens"] for r in rows["adapter"]] == [r["tokens"] for r in rows["merged"]]
    for a, m in zip(rows["adapter"], rows["merged"]):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], m["logprobs"])) < 1e-4
    assert [r["logprobs"] for r in rows["adapter"]] != [r["logprobs"] for r in rows["plain"]]
    res = CliRunner().invoke(app, ["generate", str(sparse_model), "--prompts", str(src), "--out", str(tmp_path / "x"),
                                   "--adapter", str(tmp_path), "--device", "cpu"])
    assert res.exit_code != 0 and "--adapter" in res.output and "adapter_config.json" in res.output
    assert not (tmp_path / "x").exists()
