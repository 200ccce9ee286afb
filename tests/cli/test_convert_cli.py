"""`model init` and `convert` through the real CLI, including every error path."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, list(map(str, args)))


def _err_line(res):
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_version_and_help():
    assert _run("--version").stdout.startswith("sparse-rl ")
    res = _run("--help")
    assert res.exit_code == 0 and "convert" in res.stdout and "model" in res.stdout
    for sub in (["model", "init"], ["convert"]):
        assert _run(*sub, "--help").exit_code == 0


def test_model_init_loads_with_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "m"
    res = _run("model", "init", out, "--arch", "qwen3", "--seed", "3")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["kv_heads"] < summary["heads"]  # GQA on by default
    assert 1e5 < summary["params"] < 1e6
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("Alice has 123 apples.")["input_ids"]
    assert tok.decode(ids) == "Alice has 123 apples."
    assert max(ids) < model.config.vocab_size


def test_model_init_errors(tmp_path):
    res = _run("model", "init", tmp_path / "x", "--arch", "gpt2")
    assert res.exit_code == 2 and "--arch gpt2" in _err_line(res)
    assert not (tmp_path / "x").exists()
    (tmp_path / "exists").mkdir()
    res = _run("model", "init", tmp_path / "exists")
    assert res.exit_code == 2 and "--force" in _err_line(res)
    bad = tmp_path / "bad.yaml"
    bad.write_text("arch: llama\nwidth: 3\n")
    res = _run("model", "init", tmp_path / "y", "--config", bad)
    assert res.exit_code == 2 and "unknown key 'width'" in _err_line(res) and str(bad) in res.stderr


def test_convert_round_trip(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "sparse"
    res = _run("convert", tiny_model_dir, out, "--index-topk", "16", "--index-dim", "16", "--rope-dim", "8",
               "--window", "4", "--sink", "2", "--dense-layers", "0")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["sparse_layers"] == [1, 2, 3]
    cfg = json.loads((out / "sparse_config.json").read_text())
    assert cfg["topk"] == 16 and cfg["dense_layers"] == [0]
    # base weights untouched, byte for byte
    assert (out / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    keys = load_file(out / "indexer.safetensors").keys()
    assert {k.split(".")[1] for k in keys} == {"1", "2", "3"}
    from sparse_rl.sparse.layer import layer_state
    from sparse_rl.sparse.loader import load_model

    m = load_model(out, attention="sparse")
    assert layer_state(m.model.layers[1].self_attn).cfg.topk == 16
    # converting the sparse dir again with the block selector replaces the selector
    res = _run("convert", out, tmp_path / "block", "--selector", "block", "--block-size", "8", "--topk-blocks", "4")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "block" / "indexer.safetensors").exists()


def test_convert_error_paths(tiny_model_dir, tmp_path):
    out = tmp_path / "o"
    # missing input
    res = _run("convert", tmp_path / "nope", out)
    assert res.exit_code == 1 and "no such directory" in _err_line(res)
    # not a model dir
    (tmp_path / "empty").mkdir()
    res = _run("convert", tmp_path / "empty", out)
    assert res.exit_code == 1 and "config.json" in _err_line(res)
    # unsupported architecture
    import shutil

    gpt = tmp_path / "gpt"
    shutil.copytree(tiny_model_dir, gpt)
    cfg = json.loads((gpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (gpt / "config.json").write_text(json.dumps(cfg))
    res = _run("convert", gpt, out)
    assert res.exit_code == 1 and "unsupported architecture 'gpt2'" in _err_line(res)
    # corrupt config and corrupt weights
    bad = tmp_path / "badcfg"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "config.json").write_text("{not json")
    res = _run("convert", bad, out)
    assert res.exit_code == 1 and "corrupt config.json" in _err_line(res)
    badw = tmp_path / "badw"
    shutil.copytree(tiny_model_dir, badw)
    (badw / "model.safetensors").write_bytes(b"\x00" * 100)
    res = _run("convert", badw, out)
    assert res.exit_code == 1 and "corrupt weights" in _err_line(res)
    # existing output without --force
    out.mkdir()
    res = _run("convert", tiny_model_dir, out)
    assert res.exit_code == 2 and "--force" in _err_line(res)
    assert list(out.iterdir()) == []
    # bad options are usage errors
    res = _run("convert", tiny_model_dir, tmp_path / "o2", "--sink", "10", "--window", "10", "--index-topk", "8")
    assert res.exit_code == 2 and "--index-topk" in _err_line(res)
    res = _run("convert", tiny_model_dir, tmp_path / "o3", "--dense-layers", "0,9")
    assert res.exit_code == 1 and "--dense-layers" in _err_line(res)
    res = _run("convert", tiny_model_dir, tmp_path / "o4", "--dense-layers", "a,b")
    assert res.exit_code == 2
    # nothing half-written anywhere
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == [] and not any((tmp_path / n).exists() for n in ("o2", "o3", "o4"))


def test_console_script_debug_traceback(tmp_path):
    """The installed entry point: one line normally, the traceback with SPARSE_RL_DEBUG=1."""
    cmd = [sys.executable, "-m", "sparse_rl.cli.main", "convert", str(tmp_path / "nope"), str(tmp_path / "o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0
    res = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "SPARSE_RL_DEBUG": "1"})
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_usage_errors_are_one_line_through_the_entry_point():
    res = subprocess.run([sys.executable, "-m", "sparse_rl.cli.main", "convert", "--bogus"], capture_output=True,
                         text=True)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["error: No such option: --bogus (see 'sparse-rl convert --help')"] or \
        (len(res.stderr.strip().splitlines()) == 1 and "--bogus" in res.stderr)
