"""`eval niah --preset ruler`: RULER-format samples (NVIDIA/RULER scripts/data/synthetic/*.py),
their token lengths, needle placement and RULER's metrics on hand-computed cases."""

import json
import random
import re
from collections import Counter

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.eval.niah import Haystack, NiahConfig, build_niah_prompts, build_niah_sample, load_tokenizer
from sparse_rl.eval.ruler import (DEPTHS, NOISE, TASKS, TEMPLATES, RulerBuilder, plan_tasks, sample_score,
                                  split_sentences, string_match_all, string_match_part)

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
NEEDLE_RE = re.compile(r"^One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.$")


def _essay(n_sentences=1500) -> list[str]:
    rng = random.Random(1)
    vocab = "startup founder market product users growth idea essay city money work people".split()
    words = []
    for _ in range(n_sentences):
        words += [rng.choice(vocab) for _ in range(rng.randint(4, 12))]
        words[-1] += "."
    return words


@pytest.fixture(scope="module")
def builder(bpe, tmp_path_factory):
    from sparse_rl.eval.ruler import read_hotpotqa, read_squad

    d = tmp_path_factory.mktemp("qa")
    qa = {"squad": read_squad(_squad(d / "squad.json")), "hotpotqa": read_hotpotqa(_hotpot(d / "hotpot.json"))}
    return RulerBuilder(bpe, seed=7, essay=_essay(), essay_name="essay.txt", chat=False, qa=qa)


def _context_lines(prompt: str) -> list[str]:
    """The lines between the task's first line and its question."""
    lines = prompt.split("\n")
    q = next(i for i, ln in enumerate(lines) if ln.startswith("What "))
    return lines[1:q]


# ----------------------------------------------------------------------------- metrics


def test_ruler_metrics_hand_computed():
    preds = ["The numbers are 123 and 456.", "only 123", "nothing"]
    refs = [["123", "456"], ["123", "456"], ["789"]]
    assert string_match_all(preds, refs) == 50.0  # (1 + .5 + 0) / 3 * 100
    assert string_match_part(preds, refs) == 66.67  # (1 + 1 + 0) / 3 * 100, 2 decimals
    assert string_match_all(["ABC def"], [["abc", "DEF", "x"]]) == 66.67  # case-insensitive
    rec = {"answer": ["abc", "xyz"], "meta": {"metric": "string_match_all"}}
    assert sample_score("\x01ABC\x02 and more\n", rec) == 0.5  # RULER's postprocess, unrounded term
    assert sample_score("xyz", {**rec, "meta": {"metric": "string_match_part"}}) == 1.0


# ----------------------------------------------------------------------------- lengths


@pytest.mark.parametrize("task", list(TASKS))
def test_length_is_prompt_plus_generation_and_tight(builder, task):
    length = 2048
    gen = TEMPLATES[TASKS[task].kind][2]
    make, _, _ = builder._maker(task, length)
    for index in (0, 1):
        rec = builder.sample(task, length, index)
        n = len(builder.tok(rec["prompt"], add_special_tokens=False)["input_ids"])
        assert n == rec["meta"]["input_tokens"] and n + gen <= length
        assert rec["meta"]["max_new_tokens"] == gen and rec["meta"]["length"] == length
        assert all(a in rec["prompt"] for a in rec["answer"])
        assert rec["prompt"].endswith(rec["meta"]["answer_prefix"])
    # the searched haystack is the largest that fits: one more unit does not
    size = builder._sizes[(task, length)]
    bigger = builder.render(make(builder._rng(task, length, 0), size + 1, 0))
    assert builder.count(bigger) + gen > length


# ----------------------------------------------------------------------------- format and placement


def test_niah_single_1_noise_lines_and_singular_wording(builder):
    rec = builder.sample("niah_single_1", 2048, 0)
    p = rec["prompt"]
    assert p.startswith("A special magic number is hidden within the following text. Make sure to memorize it. "
                        "I will quiz you about the number afterwards.\n")
    lines = _context_lines(p)
    needles = [ln for ln in lines if ln != NOISE]
    assert len(needles) == 1 and len(lines) == rec["meta"]["haystack_size"] + 1
    key, value = NEEDLE_RE.match(needles[0]).group(2, 3)
    assert re.fullmatch(r"[a-z]+-[a-z]+", key) and re.fullmatch(r"\d{7}", value) and rec["answer"] == [value]
    assert p.endswith(f"What is the special magic number for {key} mentioned in the provided text?"
                      f" The special magic number for {key} mentioned in the provided text is")
    assert rec["meta"]["token_position_answer"] == builder.count(p[:p.index(value)])


@pytest.mark.parametrize("task,kind", [("niah_multikey_2", "numbers"), ("niah_multikey_3", "uuids")])
def test_needle_haystack_is_distractor_needles_one_per_line(builder, task, kind):
    rec = builder.sample(task, 2048, 0)
    lines = _context_lines(rec["prompt"])
    parsed = [NEEDLE_RE.match(ln) for ln in lines]
    assert all(parsed) and {m.group(1) for m in parsed} == {kind}
    key = re.search(r"for (\S+) mentioned in the provided text\?", rec["prompt"]).group(1)
    hits = [m.group(3) for m in parsed if m.group(2) == key]
    assert hits == rec["answer"]  # the asked key is on exactly one line
    if kind == "uuids":
        assert re.fullmatch(UUID, key) and re.fullmatch(UUID, hits[0])


def test_essay_needles_sit_between_sentences_at_ruler_depths(builder):
    for task, n_needles in (("niah_single_2", 1), ("niah_multikey_1", 4), ("niah_multivalue", 4),
                            ("niah_multiquery", 4)):
        rec = builder.sample(task, 2048, 0)
        body = rec["prompt"].split("\n")[1]  # the essay context is one line
        needle = r"One of the special magic numbers for \S+ is: \d{7}\.\s*"
        pieces = re.split(needle, body)
        assert len(pieces) == n_needles + 1, task
        essay_text = " ".join(p.strip() for p in pieces if p.strip())
        n_essay = len(split_sentences(essay_text))
        for j in range(n_needles):
            before_text = " ".join(p.strip() for p in pieces[:j + 1] if p.strip())
            at_end = not "".join(pieces[j + 1:]).strip()
            # between sentences (RULER's last essay sentence may be cut mid-way: then only at the end)
            assert not before_text or before_text.endswith(".") or at_end, (task, before_text[-30:])
            before = len(split_sentences(before_text)) if before_text else 0
            assert any(int(n_essay * d / 100) == before for d in DEPTHS), (task, before, n_essay)
    multivalue = builder.sample("niah_multivalue", 2048, 0)
    key = re.search(r"numbers for (\S+) mentioned", multivalue["prompt"]).group(1)
    assert sorted(multivalue["answer"]) == sorted(re.findall(rf"for {key} is: (\d{{7}})\.", multivalue["prompt"]))
    assert "Some special magic numbers are hidden" in multivalue["prompt"]  # plural: 4 values asked
    multiquery = builder.sample("niah_multiquery", 2048, 0)
    query = re.search(r"numbers for (.+?) mentioned in the provided text\?", multiquery["prompt"]).group(1)
    keys = re.fullmatch(r"(\S+), (\S+), (\S+), and (\S+)", query).groups()
    assert multiquery["answer"] == [re.search(rf"for {k} is: (\d{{7}})\.", multiquery["prompt"]).group(1) for k in keys]


def test_vt_has_the_one_shot_example_and_ruler_needles(builder):
    rec = builder.sample("vt", 2048, 0)
    p = rec["prompt"]
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    assert p.startswith(head) and p.count(head) == 2  # the one-shot example, then the task
    shot, task = p[len(head):].split("\n\n" + head)
    shot_names = shot.split("they are: ")[1].split()
    assert len(shot_names) == 5 and all(re.fullmatch(r"[A-Z]{3}", n) for n in shot_names)
    assert "12345" not in shot  # renamed and revalued per sample, as RULER's randomize_icl
    lines = task.split("\nQuestion:")[0].split("\n")
    chain = [ln for ln in lines if ln.startswith("VAR ")]
    assert all(ln == NOISE for ln in lines if not ln.startswith("VAR "))
    names = rec["answer"]
    value = re.fullmatch(rf"VAR {names[0]} = (\d{{5}})", chain[0]).group(1)
    assert chain[1:] == [f"VAR {names[i + 1]} = VAR {names[i]} " for i in range(4)]  # no period, RULER's space
    assert p.endswith(f" Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                      f"are assigned the value {value}, they are: ")


def test_cwe_answers_are_the_ten_most_common_words(builder):
    rec = builder.sample("cwe", 2048, 0)  # below 4096: RULER's 6/1 repeats, a 20-word one-shot example
    main = rec["prompt"].split("Below is a numbered list of words.")[2]
    listed = re.findall(r"\d+\. ([a-z]+)", main.split("\nQuestion:")[0])
    counts = Counter(listed)
    assert sorted(rec["answer"]) == sorted(w for w, c in counts.items() if c == 6)
    assert len(rec["answer"]) == 10 and all(c == 1 for w, c in counts.items() if w not in rec["answer"])


def test_fwe_answers_are_the_three_most_frequent_coded_words(builder):
    rec = builder.sample("fwe", 2048, 0)
    words = rec["prompt"].split("coded words. ")[1].split("\nQuestion:")[0].split()
    ranked = [w for w, _ in Counter(words).most_common()]
    assert ranked[0] == "..." and ranked[1:4] == rec["answer"]


def test_chat_template_wraps_the_task_and_the_answer_prefix_follows(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    chat = RulerBuilder(tok, seed=0, chat=True).sample("niah_single_1", 2048, 0)
    base = RulerBuilder(tok, seed=0, chat=False).sample("niah_single_1", 2048, 0)
    prefix = chat["meta"]["answer_prefix"]
    user = chat["prompt"][:-len(prefix)]
    start = tok.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False, add_generation_prompt=True)
    assert user.startswith(start.split("X")[0]) and user.endswith(start.split("X")[1])
    assert not base["prompt"].startswith(start.split("X")[0]) and base["prompt"].endswith(prefix)


def test_samples_are_seeded(bpe):
    a = RulerBuilder(bpe, seed=1, chat=False).sample("niah_multikey_2", 1024, 3)
    b = RulerBuilder(bpe, seed=1, chat=False).sample("niah_multikey_2", 1024, 3)
    c = RulerBuilder(bpe, seed=2, chat=False).sample("niah_multikey_2", 1024, 3)
    assert a == b and a["prompt"] != c["prompt"]


# ----------------------------------------------------------------------------- plan, config, CLI


def test_plan_skips_essay_and_qa_tasks_with_a_reason():
    tasks, notes = plan_tasks(None, have_essay=False)
    assert tasks == ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"]
    assert any("niah_single_2" in n and "--haystack" in n for n in notes)
    assert any("qa_1, qa_2" in n for n in notes)
    assert len(plan_tasks(None, have_essay=True)[0]) == 11
    with pytest.raises(UsageError, match="unknown RULER task 'single'"):
        plan_tasks(["single"], True)
    with pytest.raises(UsageError, match="--haystack"):
        plan_tasks(["niah_single_2"], False)


def test_config_defaults_and_errors_per_preset():
    cfg = NiahConfig(preset="ruler")
    cfg.check()
    assert cfg.samples == 500 and cfg.lengths[0] == 4096 and cfg.lengths[-1] == 131072
    grid = NiahConfig()
    grid.check()
    assert grid.tasks == ["single"] and grid.samples == 1 and grid.depths == [0.0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(UsageError, match="--depths"):
        NiahConfig(preset="ruler", depths=[0.5]).check()
    with pytest.raises(UsageError, match="--chat"):
        NiahConfig(chat=True).check()
    with pytest.raises(UsageError, match="--squad"):
        NiahConfig(squad="s.json").check()
    with pytest.raises(UsageError, match="--preset bogus"):
        NiahConfig(preset="bogus").check()


def test_cli_builds_ruler_prompts_and_says_what_it_skipped(bpe_dir, tmp_path):
    out = tmp_path / "ruler.jsonl"
    res = CliRunner().invoke(app, ["eval", "niah", "--preset", "ruler", "--tokenizer", str(bpe_dir),
                                   "--lengths", "2048", "--per-cell", "2", "--prompts-out", str(out)])
    assert res.exit_code == 0, res.output
    assert "skipped niah_single_2" in res.output and "--haystack" in res.output
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 6 * 2 and {r["task"] for r in recs} == set(plan_tasks(None, False)[0])
    essay = tmp_path / "essay.txt"
    essay.write_text(" ".join(_essay(600)))
    res = CliRunner().invoke(app, ["eval", "niah", "--preset", "ruler", "--tokenizer", str(bpe_dir),
                                   "--kinds", "niah_single_2,vt", "--lengths", "2k", "--per-cell", "1",
                                   "--haystack", str(essay), "--prompts-out", str(out), "--force"])
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task"] for r in recs] == ["niah_single_2", "vt"] and recs[0]["meta"]["haystack"] == str(essay)
    res = CliRunner().invoke(app, ["eval", "niah", "--preset", "ruler", "--tokenizer", str(bpe_dir),
                                   "--depths", "0.5", "--prompts-out", str(out), "--force"])
    assert res.exit_code == 2 and "--depths" in res.output


def test_cli_ruler_runs_on_a_tiny_model_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["eval", "niah", str(tiny_model_dir), "--preset", "ruler", "--kinds", "niah_single_1,vt",
            "--lengths", "2048", "--per-cell", "2", "--out", str(out), "--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["preset"] == "ruler" and summary["tasks"] == ["niah_single_1", "vt"] and summary["depths"] == []
    table = summary["modes"]["dense"]["ruler"]
    assert set(table["by_task_length"]) == {"niah_single_1", "vt"} and set(table["avg"]) == {"2048"}
    cells = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    assert [c["id"] for c in cells] == ["dense/niah_single_1/L2048", "dense/vt/L2048"]
    assert all(c["depth"] is None and c["n"] == 2 for c in cells)
    assert (out / "heatmap_dense.png").stat().st_size > 0
    res = CliRunner().invoke(app, args)  # resume: nothing left to run
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == summary


# ----------------------------------------------------------------------------- grid haystack guard


class _EmptyTokenizer:
    """Encodes everything to no tokens."""

    is_fast = False

    def encode(self, text, add_special_tokens=False):
        return []

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": []}

    def decode(self, ids, **kw):
        return ""


def test_tokenizer_that_encodes_nothing_is_a_one_line_error_not_a_hang():
    with pytest.raises(SparseRLError, match="encodes its sentences to no tokens") as e:
        build_niah_sample(_EmptyTokenizer(), "single", 64, 0.5)
    assert "\n" not in str(e.value)
    with pytest.raises(SparseRLError, match="no tokens"):
        Haystack.default().stream(_EmptyTokenizer(), 10)
    with pytest.raises(SparseRLError, match="does not grow"):
        build_niah_prompts(_EmptyTokenizer(), NiahConfig(preset="ruler", tasks=["niah_single_1"], lengths=[256],
                                                         samples=1, chat=False))


# ----------------------------------------------------------------------------- QA (local SQuAD / HotpotQA files)


def _squad(path):
    def para(a, j):
        return {"context": f"Paragraph {j} of article {a}. The river flows to the sea near town {a}{j}.",
                "qas": [{"question": f"Where does the river of {a}{j} flow?", "is_impossible": False,
                         "answers": [{"text": f"sea near town {a}{j}"}, {"text": "the sea"}]},
                        {"question": "Unanswerable?", "is_impossible": True, "answers": []}]}
    data = {"data": [{"title": a, "paragraphs": [para(a, j) for j in range(3)]} for a in "AB"]}
    path.write_text(json.dumps(data))
    return path


def _hotpot(path):
    data = [{"question": f"Which city hosts museum {i}?", "answer": f"City{i}",
             "context": [[f"Museum {i}", [f"Museum {i} is in City{i}.", " It is old."]],
                         [f"Park {i}", [f"Park {i} is green."]]]} for i in range(4)]
    path.write_text(json.dumps(data))
    return path


def test_qa_tasks_from_local_files(bpe, tmp_path):
    from sparse_rl.eval.ruler import read_hotpotqa, read_squad

    squad = read_squad(_squad(tmp_path / "squad.json"))
    hotpot = read_hotpotqa(_hotpot(tmp_path / "hotpot.json"))
    assert len(squad[0]) == 6 and len(squad[1]) == 6  # impossible questions dropped; distinct paragraphs
    b = RulerBuilder(bpe, seed=0, chat=False, qa={"squad": squad, "hotpotqa": hotpot})
    rec = b.sample("qa_1", 1024, 1)  # the file's question 1: article A, paragraph 1
    assert rec["meta"]["metric"] == "string_match_part" and rec["meta"]["max_new_tokens"] == 32
    assert rec["answer"] == ["sea near town A1", "the sea"]
    assert "Paragraph 1 of article A." in rec["prompt"] and "Question: Where does the river of A1 flow?" in rec["prompt"]
    assert rec["meta"]["input_tokens"] + 32 <= 1024 and rec["prompt"].endswith(" Answer:")
    n_docs = len(re.findall(r"^Document (\d+):$", rec["prompt"], flags=re.M))
    assert n_docs >= 6 and re.findall(r"^Document (\d+):$", rec["prompt"], flags=re.M) == [str(i + 1) for i in range(n_docs)]
    rec2 = b.sample("qa_2", 1024, 2)
    assert rec2["answer"] == ["City2"] and "Museum 2\nMuseum 2 is in City2. It is old." in rec2["prompt"]
    assert sample_score("It is the sea.", rec) == 1.0 and sample_score("a lake", rec) == 0.0
    with pytest.raises(UsageError, match="--squad FILE"):
        RulerBuilder(bpe, chat=False).sample("qa_1", 1024, 0)
    tasks, notes = plan_tasks(["qa_1", "qa_2", "vt"], False, ("squad",))
    assert tasks == ["qa_1", "vt"] and "--hotpotqa FILE" in notes[0]
    with pytest.raises(SparseRLError, match="not SQuAD's format"):
        read_squad(_hotpot(tmp_path / "wrong.json"))
