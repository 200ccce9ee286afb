"""`sparse-rl sft` through the CLI: the loss mask, packing without cross-document attention, exact
resume after an interruption, a bad record named by its line, LoRA output."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.sft import data as data_mod

CONV = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 3"},
                     {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4 more?"},
                     {"role": "assistant", "content": "9 then"}]}
RECORDS = [CONV, {"prompt": "add 4 and 3", "completion": "7"}, {"text": "The cat sat on the mat."},
           {"prompt": "add 1 and 1", "solution": "1 + 1 = 2"}, {"prompt": "what is 6 times 7", "completion": "42"}]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sft(model, data, out, *extra):
    return CliRunner().invoke(app, ["sft", str(model), "--data", str(data), "--out", str(out), "--seq-len", "64",
                                    "--batch-size", "2", "--steps", "6", "--lr", "1e-3", "--save-every", "2",
                                    "--device", "cpu", *extra])


def _weights(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_loss_mask_is_exactly_the_assistant_turns(tiny_model_dir):
    from sparse_rl.sparse.loader import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    doc = data_mod.encode_record(CONV, tok, "x")
    full = tok.apply_chat_template(CONV["messages"], tokenize=False)
    assert tok.decode(doc.ids) == full
    # the targets are each assistant turn's content and its end-of-turn token, nothing else
    runs, cur = [], []
    for i, m in zip(doc.ids, doc.mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assert runs == ["5<|im_end|>", "9 then<|im_end|>"]
    text = data_mod.encode_record({"text": "plain words"}, tok, "x")
    assert all(text.mask) and text.ids[-1] == tok.eos_token_id


def test_packing_keeps_documents_separate(tiny_model_dir):
    from sparse_rl.sparse.loader import load_model, load_tokenizer
    from sparse_rl.sft.trainer import targets

    tok = load_tokenizer(tiny_model_dir)
    docs = [data_mod.encode_record(r, tok, "x") for r in RECORDS]
    rows, dropped = data_mod.pack(docs, 80, tok.pad_token_id)
    assert dropped == 0 and rows["input_ids"].shape[0] < len(docs)  # several documents share a row
    model = load_model(tiny_model_dir, device="cpu", dtype="float32")
    with torch.no_grad():
        packed = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False).logits
        pos = rows["position_ids"]
        for r in range(pos.shape[0]):
            starts = (pos[r] == 0).nonzero().flatten().tolist() + [pos.shape[1]]
            for a, b in zip(starts[:-1], starts[1:]):
                alone = model(input_ids=rows["input_ids"][r:r + 1, a:b], use_cache=False).logits[0]
                torch.testing.assert_close(packed[r, a:b], alone, atol=1e-5, rtol=1e-4)
    tgt = targets(rows)  # no target across a document boundary
    assert (tgt[pos[:, 1:] == 0] == -100).all()
    n_targets = sum(sum(d.mask) for d in docs) - sum(d.mask[0] for d in docs)
    assert int((tgt != -100).sum()) == n_targets


def test_sft_cli_trains_and_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    data = _write(tmp_path / "d.jsonl", RECORDS * 4)
    res = _sft(tiny_model_dir, data, tmp_path / "a")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6
    recs = [json.loads(x) for x in (tmp_path / "a.run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert recs[-1]["loss"] < recs[0]["loss"]
    # HF's cosine-with-floor schedule (sparse_rl.schedule), no warm-up by default: the peak at step 1,
    # lr * (0.1 + 0.9 * (1 + cos(pi s / 6)) / 2) at step s + 1
    want = [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 6))) for s in range(6)]
    assert [r["lr"] for r in recs] == pytest.approx(want, rel=1e-9)

    batch = data_mod.Rows.batch

    def interrupted(self, cursor, count):  # dies fetching step 6's rows: step 5 ran after checkpoint 4
        if cursor >= 5 * 2:
            raise KeyboardInterrupt
        return batch(self, cursor, count)

    monkeypatch.setattr(data_mod.Rows, "batch", interrupted)
    res = _sft(tiny_model_dir, data, tmp_path / "b")
    assert res.exit_code == 130 and not (tmp_path / "b").exists()
    monkeypatch.setattr(data_mod.Rows, "batch", batch)
    res = _sft(tiny_model_dir, data, tmp_path / "b")  # refuses to clobber the run without --resume/--force
    assert res.exit_code == 2 and "--resume" in res.output
    res = _sft(tiny_model_dir, data, tmp_path / "b", "--resume")
    assert res.exit_code == 0, res.output
    resumed = [json.loads(x) for x in (tmp_path / "b.run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in recs]  # the schedule resumes with the optimizer
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    w0 = _weights(tiny_model_dir)
    assert any(not torch.equal(w0[k], wa[k]) for k in w0)


def test_bad_record_names_its_line(tiny_model_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(RECORDS[1]) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]})
                    + "\n")
    res = _sft(tiny_model_dir, data, tmp_path / "o")
    assert res.exit_code == 1
    assert "bad.jsonl line 2" in res.output and "no assistant turn" in res.output
    data.write_text(json.dumps(RECORDS[1]) + "\n{not json\n")
    res = _sft(tiny_model_dir, data, tmp_path / "o")
    assert res.exit_code == 1 and "line 2" in res.output
    assert not (tmp_path / "o").exists()


def test_lora_writes_the_merged_model_and_the_adapter(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    data = _write(tmp_path / "d.jsonl", RECORDS * 2)
    res = _sft(tiny_model_dir, data, tmp_path / "o", "--finetune", "lora", "--lr", "1e-2")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "o" / "adapter" / "adapter_model.safetensors").is_file()
    merged = _weights(tmp_path / "o")
    base = _weights(tiny_model_dir)
    assert merged.keys() == base.keys()  # a plain model dir: no lora_ tensors left
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(any(t in k for t in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in changed)
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "o"))


def test_bf16_mixed_precision_keeps_float32_weights_and_tracks_the_float32_loss(tiny_model_dir, tmp_path):
    data = _write(tmp_path / "d.jsonl", RECORDS * 2)
    losses = {}
    for mp in ("no", "bf16"):
        res = _sft(tiny_model_dir, data, tmp_path / mp, "--mixed-precision", mp, "--dtype", "float32", "--steps", "2")
        assert res.exit_code == 0, res.output
        rows = [json.loads(x) for x in (tmp_path / f"{mp}.run" / "metrics.jsonl").read_text().splitlines()]
        losses[mp] = rows[0]["loss"]
        assert all(v.dtype == torch.float32 for v in _weights(tmp_path / mp).values())
    # the same first batch under autocast: bf16 rounding only (a different loss would mean other data or masks)
    assert losses["bf16"] != losses["no"] and abs(losses["bf16"] - losses["no"]) < 0.05 * losses["no"]
    res = _sft(tiny_model_dir, data, tmp_path / "x", "--mixed-precision", "fp8")
    assert res.exit_code != 0 and "--mixed-precision fp8" in res.output


def test_adam_beta2_reaches_the_optimizer_and_a_bad_one_is_a_usage_error(tiny_model_dir, tmp_path):
    data = _write(tmp_path / "d.jsonl", RECORDS * 2)
    res = _sft(tiny_model_dir, data, tmp_path / "a", "--adam-beta2", "0.95", "--save-every", "1")
    assert res.exit_code == 0, res.output
    step_dir = sorted((tmp_path / "a.run" / "checkpoints").iterdir())[-1]
    opt = torch.load(step_dir / "optimizer.pt", weights_only=True)["optimizer"]
    assert all(g["betas"] == (0.9, 0.95) or list(g["betas"]) == [0.9, 0.95] for g in opt["param_groups"])
    res = _sft(tiny_model_dir, data, tmp_path / "b", "--adam-beta2", "1.0")
    assert res.exit_code == 2 and "--adam-beta2" in res.output and not (tmp_path / "b").exists()
