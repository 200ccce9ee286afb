"""A prompt far longer than the context is refused before it is tokenised in full (a 50 MB
single-line prompt used to be tokenised for 19 minutes before `generate` said it was too long)."""

import json
import time

from typer.testing import CliRunner

from sparse_rl.cli.main import app


def test_huge_prompt_refused_quickly(tiny_model_dir, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "huge", "prompt": "lorem ipsum dolor sit amet " * 400_000}) + "\n")  # 10.8 MB
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["generate", str(tiny_model_dir), "--prompts", str(p), "--max-seq-len", "256",
                                   "--out", str(tmp_path / "o.jsonl")])
    took = time.monotonic() - t0
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert res.exit_code == 1 and len(lines) == 1 and "'huge'" in lines[0] and "longer than the context of 256" in lines[0]
    assert took < 30 and not (tmp_path / "o.jsonl").exists()
