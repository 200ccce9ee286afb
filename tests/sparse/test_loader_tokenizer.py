"""A model dir must come with a usable tokenizer: without one, every prompt would encode to no
tokens (NIAH waits for tokens forever, GRPO trains on empty prompts), so loading refuses it."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.errors import SparseRLError
from sparse_rl.sparse.loader import load_tokenizer


def _weights_only(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def test_dir_without_tokenizer_is_refused(tiny_model_dir, tmp_path):
    d = _weights_only(tiny_model_dir, tmp_path / "no-tok")
    with pytest.raises(SparseRLError, match=f"^{d}: no tokenizer in this model dir"):
        load_tokenizer(d)
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "prompt": "1+1?", "answer": "2"}) + "\n")
    res = CliRunner().invoke(app, ["grpo", str(d), "--tasks", str(tasks), "--out", str(tmp_path / "run"), "--steps", "1"])
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert res.exit_code == 1 and len(lines) == 1 and "no tokenizer in this model dir" in lines[0], res.output


def test_tokenizer_that_encodes_nothing_is_refused(tiny_model_dir, tmp_path):
    """A 2-entry vocabulary without an unknown token: it loads, and encodes all text to []."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    d = _weights_only(tiny_model_dir, tmp_path / "empty-tok")
    Tokenizer(BPE(vocab={"<s>": 0, "</s>": 1}, merges=[])).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "bos_token": "<s>", "eos_token": "</s>"}))
    with pytest.raises(SparseRLError, match=f"^{d}: the tokenizer encodes text to no tokens"):
        load_tokenizer(d)
    assert load_tokenizer(tiny_model_dir)("hello world", add_special_tokens=False)["input_ids"]
