import json
import re

import pytest

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.eval.niah import (TASKS, Haystack, NiahConfig, build_niah_prompts, build_niah_sample, load_tokenizer,
                                 string_match_all)
from sparse_rl.eval.niah_run import CELLS_FILE, SUMMARY_FILE, run_niah

NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d+)\.")


def oracle(prompts, max_new_tokens):
    """Answers by reading the prompt: the values of the asked keys, or the vt chain from the asked value."""
    outs = []
    for p in prompts:
        if p.startswith("Memorize and track"):
            value = re.search(r"assigned the value (\d+) in the text above", p).group(1)
            names, frontier = [], {value}
            for lhs, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", p):
                if rhs.removeprefix("VAR ") in frontier:
                    names.append(lhs)
                    frontier.add(lhs)
            outs.append(" ".join(names))
        else:
            query = re.search(r"What are all the special magic numbers for (.+?) mentioned", p).group(1)
            keys = re.split(r", | and ", query)
            outs.append(" ".join(v for k, v in NEEDLE.findall(p) if k in keys))
    return outs


def wrong(prompts, max_new_tokens):
    return ["I do not remember any numbers." for _ in prompts]


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123", ["123", "456"]) == 0.5
    assert string_match_all("ABCDE fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)
    assert string_match_all("", ["1"]) == 0.0


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [400, 1001, 2048])
def test_prompt_has_exact_token_length(bpe, task, length):
    for depth in (0.0, 0.33, 1.0):
        rec = build_niah_sample(bpe, task, length, depth, seed=3)
        assert len(bpe(rec["prompt"])["input_ids"]) == length
        assert all(a in rec["prompt"] for a in rec["answer"])


def test_exact_length_counts_bos(bpe_bos_dir):
    tok = load_tokenizer(bpe_bos_dir)
    rec = build_niah_sample(tok, "single", 777, 0.5)
    ids = tok(rec["prompt"])["input_ids"]
    assert len(ids) == 777 and ids[0] == tok.bos_token_id
    rec2 = build_niah_sample(tok, "single", 777, 0.5, add_special_tokens=False)
    assert len(tok(rec2["prompt"], add_special_tokens=False)["input_ids"]) == 777


def _needle_depth(tok, rec):
    """Measured from the final tokenisation: filler tokens before the needle / all filler tokens."""
    p = rec["prompt"]
    enc = tok(p, add_special_tokens=False)
    m = NEEDLE.search(p)
    start, end = enc.char_to_token(m.start()), enc.char_to_token(m.end() - 1) + 1
    ctx0 = enc.char_to_token(p.index("\n") + 1)
    ctx1 = enc.char_to_token(p.index("\nWhat are all"))
    filler = (ctx1 - ctx0) - (end - start)
    return (start - ctx0) / filler, start


@pytest.mark.parametrize("haystack_kind", ["noise", "file", "no-punctuation"])
def test_needle_sits_at_requested_depth(bpe, tmp_path, haystack_kind):
    if haystack_kind == "no-punctuation":  # one endless "sentence": cut into pieces of <= 40 words
        f = tmp_path / "words.txt"
        f.write_text(" ".join(["bright", "cold", "day", "in", "April", "clocks", "were", "striking"] * 100))
        hs = Haystack.from_file(f)
        assert len(hs.sentences) == 20 and all(len(x.split()) == 40 for x in hs.sentences)
    elif haystack_kind == "file":
        f = tmp_path / "book.txt"
        f.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 3
                     + "Winston Smith slipped quickly through the glass doors of Victory Mansions.\n\n" * 2)
        hs = Haystack.from_file(f)
    else:
        hs = Haystack.default()
    longest = max(len(bpe.encode(" " + s)) for s in hs.sentences)
    for length in (1024, 3000):
        for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
            rec = build_niah_sample(bpe, "single", length, depth, haystack=hs)
            got, pos = _needle_depth(bpe, rec)
            filler = rec["meta"]["filler_tokens"]
            # snapped to the nearest sentence boundary: off by at most half a sentence (+1 for a BPE join)
            assert abs(got - depth) <= (longest / 2 + 1) / filler, (length, depth, got)
            assert rec["meta"]["needle_token_pos"] == pos
    assert abs(_needle_depth(bpe, build_niah_sample(bpe, "single", 3000, 0.5, haystack=hs))[0] - 0.5) < 0.01


def test_multi_needle_tasks_place_all_needles(bpe):
    mk = build_niah_sample(bpe, "multikey", 1500, 0.5)
    assert len(NEEDLE.findall(mk["prompt"])) == 4 and len(mk["answer"]) == 1
    mv = build_niah_sample(bpe, "multivalue", 1500, 0.5)
    assert len({k for k, _ in NEEDLE.findall(mv["prompt"])}) == 1 and len(mv["answer"]) == 4
    mq = build_niah_sample(bpe, "multiquery", 1500, 0.5)
    assert len(mq["answer"]) == 4
    vt = build_niah_sample(bpe, "vt", 1500, 0.2)
    assert len(re.findall(r"VAR [A-Z]{5} = ", vt["prompt"])) == 5
    d = vt["meta"]["needle_depths"]
    assert d == sorted(d) and abs(d[0] - 0.2) < 0.02  # chain order kept, first hop at the depth


def test_build_is_deterministic_and_too_short_is_an_error(bpe):
    cfg = NiahConfig(tasks=["single", "vt"], lengths=[512], depths=[0.0, 1.0], samples=2, seed=7)
    a, b = build_niah_prompts(bpe, cfg), build_niah_prompts(bpe, cfg)
    assert a == b and len(a) == 8 and len({r["id"] for r in a}) == 8
    assert a[0]["prompt"] != a[1]["prompt"]  # samples differ
    with pytest.raises(UsageError, match="too short"):
        build_niah_sample(bpe, "multiquery", 40, 0.5)
    with pytest.raises(UsageError, match="unknown task"):
        NiahConfig(tasks=["nope"]).check()


def test_oracle_scores_one_and_wrong_scores_zero(bpe, tmp_path):
    cfg = NiahConfig(tasks=list(TASKS), lengths=[512, 1024], depths=[0.0, 0.5, 1.0], samples=2)
    prompts = build_niah_prompts(bpe, cfg)
    budgets = set()

    def oracle_spy(ps, n):
        budgets.add(n)
        return oracle(ps, n)

    s = run_niah(prompts, {"dense": oracle_spy, "sparse": wrong}, tmp_path / "r", progress=False)
    assert s["modes"]["dense"]["mean"] == 1.0 and s["modes"]["sparse"]["mean"] == 0.0
    assert all(v == 1.0 for v in s["modes"]["dense"]["by_task"].values())
    assert budgets == {128, 30}
    # grid: rows = depths, columns = lengths
    assert s["modes"]["dense"]["grid"] == [[1.0, 1.0]] * 3
    assert s["difference"]["sparse-dense"]["grid"] == [[-1.0, -1.0]] * 3
    cells = [json.loads(line) for line in (tmp_path / "r" / CELLS_FILE).read_text().splitlines()]
    assert len(cells) == 2 * 5 * 2 * 3 and all(c["n"] == 2 for c in cells)
    for name in ("heatmap_dense.png", "heatmap_sparse.png", "diff_sparse_minus_dense.png"):
        assert (tmp_path / "r" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "r" / SUMMARY_FILE).read_text()) == s


def test_resume_skips_done_cells(bpe, tmp_path):
    calls = []

    def counting(ps, n):
        calls.append(len(ps))
        return oracle(ps, n)

    cfg = NiahConfig(tasks=["single"], lengths=[512], depths=[0.0, 1.0])
    run_niah(build_niah_prompts(bpe, cfg), {"dense": counting}, tmp_path, progress=False)
    assert calls == [2]  # both cells in one batch
    run_niah(build_niah_prompts(bpe, cfg), {"dense": counting}, tmp_path, progress=False)
    assert calls == [2]  # nothing recomputed
    cfg.depths = [0.0, 0.25, 0.5, 1.0]
    s = run_niah(build_niah_prompts(bpe, cfg), {"dense": counting}, tmp_path, batch=1, progress=False)
    assert calls == [2, 1, 1] and s["modes"]["dense"]["grid"] == [[1.0]] * 4  # only the new cells, one a call
    cfg.max_new_tokens = 7  # another budget is another result: not reused
    with pytest.raises(SparseRLError, match="different prompts"):
        run_niah(build_niah_prompts(bpe, cfg), {"dense": counting}, tmp_path, progress=False)
    cfg.max_new_tokens = 0
    cfg.seed = 1  # other prompts for the same cells: refuse to mix them
    with pytest.raises(SparseRLError, match="different prompts"):
        run_niah(build_niah_prompts(bpe, cfg), {"dense": counting}, tmp_path, progress=False)


def test_rerun_drops_a_cut_last_cell_and_redoes_it(bpe, tmp_path, capsys):
    calls = []

    def counting(ps, n):
        calls.append(len(ps))
        return oracle(ps, n)

    cfg = NiahConfig(tasks=["single"], lengths=[512], depths=[0.0, 1.0])
    run_niah(build_niah_prompts(bpe, cfg), {"dense": counting}, tmp_path, batch=1, progress=False)
    path = tmp_path / CELLS_FILE
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1][:40])  # killed while appending the second cell
    s = run_niah(build_niah_prompts(bpe, cfg), {"dense": counting}, tmp_path, batch=1, progress=False)
    assert calls == [1, 1, 1] and s["modes"]["dense"]["grid"] == [[1.0]] * 2  # only the cut cell again
    assert "cut last line" in capsys.readouterr().err
    assert [json.loads(x)["depth"] for x in path.read_text().splitlines()] == [0.0, 1.0]
