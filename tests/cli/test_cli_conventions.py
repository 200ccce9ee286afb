"""The command-line conventions of docs/DESIGN.md ("Command-line conventions"), checked on every
command by walking the real Typer app: each `--help` is rendered as a user sees it."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from sparse_rl.cli.main import app

runner = CliRunner()
DEFAULT = re.compile(r"\s*\[default: [^\]]*\]")

# Flag names that several commands share with a stage-specific text; each still means one thing.
SAME_CONCEPT = {
    "--out": "the stage's main output (a file or a dir, as its help says)",
    "--data": "the text a stage trains or measures on",
    "--dtype": "the dtype the stage's weights or tensors are in",
    "--policy": "what answers the synthesised tasks (synth math / synth agent)",
    "--attention": "dense or sparse attention",
    "--steps": "optimiser steps of the stage",
    "--lr": "the learning rate of what the stage trains",
    "--finetune": "full weights or a LoRA adapter (indexer train's sparse stage, sft)",
    "--prompts": "a prompts JSONL the stage reads",
    "--score": "completions to score",
    "--batch": "the benchmark's batch",
    "--seq-len": "tokens per row",
    "--index-topk": "keys each query attends to",
}
SHORT = {"-h": "--help", "-o": "--out"}  # the only short options, one meaning each


def _commands():
    """(path, click command) for every leaf command, and the groups."""
    root = typer.main.get_command(app)
    leaves, groups = [], [((), root)]
    stack = [((), root)]
    while stack:
        path, cmd = stack.pop()
        for name, sub in getattr(cmd, "commands", {}).items():
            if hasattr(sub, "commands"):
                groups.append(((*path, name), sub))
                stack.append(((*path, name), sub))
            else:
                leaves.append(((*path, name), sub))
    return sorted(leaves), sorted(groups)


LEAVES, GROUPS = _commands()


def _visible_options(cmd):
    return [p for p in cmd.params if p.param_type_name == "option" and not p.hidden]


def _help(path) -> str:
    res = runner.invoke(app, [*path, "--help"])
    assert res.exit_code == 0, res.output
    return res.stdout


def test_walk_found_every_stage():
    names = {" ".join(p) for p, _ in LEAVES}
    assert {"model init", "convert", "indexer train", "indexer eval", "generate", "grpo", "synth math", "synth agent",
            "eval math", "eval niah", "eval fidelity", "bench attention", "bench decode", "bench rollout",
            "demo"} <= names


@pytest.mark.parametrize("path", [p for p, _ in LEAVES], ids=" ".join)
def test_help_shows_every_default_and_no_bool_metavar(path):
    cmd = dict(LEAVES)[path]
    text = _help(path)
    flat = " ".join(text.split())
    assert "<bool>" not in text
    missing = []
    ctx = cmd.make_context(" ".join(path), [], resilient_parsing=True)
    for p in _visible_options(cmd):
        if p.name == "help" or p.required:  # a required option shows [required] instead
            continue
        record = " ".join(p.get_help_record(ctx)[1].split())  # the help text plus any default Typer adds
        found = DEFAULT.search(record)
        if not found:
            missing.append(p.opts[0])
        else:
            assert found.group(0).strip() in flat, f"{' '.join(path)} {p.opts[0]}: default not rendered in --help"
    assert not missing, f"{' '.join(path)}: no [default: ...] in the help of {', '.join(missing)}"


@pytest.mark.parametrize("path", [p for p, _ in LEAVES], ids=" ".join)
def test_every_stage_takes_config_and_set_and_metavars_are_upper_case(path):
    cmd = dict(LEAVES)[path]
    names = {o for p in _visible_options(cmd) for o in p.opts}
    assert {"--config", "--set"} <= names
    for p in cmd.params:
        if p.param_type_name == "argument":
            assert p.metavar and p.metavar == p.metavar.upper(), f"{' '.join(path)}: argument {p.name} metavar"
    # the model is positional wherever a stage loads one; synth's --model names an endpoint's model
    if "--model" in names:
        assert path[0] == "synth", f"{' '.join(path)}: the model dir is the first argument, not --model"


def test_one_meaning_per_flag_name():
    texts: dict[str, dict[str, list[str]]] = {}
    for path, cmd in LEAVES:
        for p in _visible_options(cmd):
            for opt in p.opts + p.secondary_opts:
                if opt.startswith("--") and opt not in ("--help",):
                    text = DEFAULT.sub("", " ".join((p.help or "").split())).strip()
                    texts.setdefault(opt, {}).setdefault(text, []).append(" ".join(path))
                elif not opt.startswith("--"):
                    assert SHORT.get(opt) in p.opts, f"{' '.join(path)}: short option {opt} is not {SHORT.get(opt)}"
    clashes = {opt: by for opt, by in texts.items() if len(by) > 1 and opt not in SAME_CONCEPT}
    assert not clashes, "one flag name, different help texts:\n" + json.dumps(clashes, indent=1)


@pytest.mark.parametrize("path", [p for p, _ in GROUPS], ids=lambda p: " ".join(("sparse-rl", *p)))
def test_bare_group_prints_help_to_stdout_and_exits_0(path):
    res = runner.invoke(app, list(path))
    assert res.exit_code == 0 and "Usage:" in res.stdout and not res.stderr


def test_bare_sparse_rl_through_the_entry_point():
    res = subprocess.run([sys.executable, "-m", "sparse_rl.cli.main"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("Usage:") and res.stderr == ""
    res = subprocess.run([sys.executable, "-m", "sparse_rl.cli.main", "generate"], capture_output=True, text=True)
    assert res.returncode == 2 and "MODEL" in res.stderr and res.stdout == ""


def test_a_rank_of_a_multi_process_run_leaves_by_os_exit_with_its_output_and_code():
    """Under torchrun (WORLD_SIZE > 1) the entry point skips Python's finalization (no atexit handler runs, so
    no gloo / NCCL object is destroyed there) but still flushes what it printed and keeps the exit code."""
    code = ("import atexit, sys, torch.distributed; atexit.register(lambda: print('finalized', file=sys.stderr)); "
            "sys.argv = ['sparse-rl', *sys.argv[1:]]; from sparse_rl.cli.main import main; main()")
    env = {**os.environ, "WORLD_SIZE": "2"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.startswith("Usage:") and res.stderr == ""
    res = subprocess.run([sys.executable, "-c", code, "generate"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "MODEL" in res.stderr and "finalized" not in res.stderr
    single = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    res = subprocess.run([sys.executable, "-c", code, "generate"], capture_output=True, text=True, env=single)
    assert res.returncode == 2 and "finalized" in res.stderr  # one process: a plain exit


def test_output_files_refuse_to_overwrite_without_force(tmp_path):
    out = tmp_path / "tasks.jsonl"
    args = ["synth", "math", "--num-tasks", "2", "--families", "arith", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    first = out.read_text()
    res = runner.invoke(app, args + ["--seed", "1"])
    assert res.exit_code == 2 and f"--out {out}: exists already (pass --force" in res.stderr
    assert out.read_text() == first
    assert runner.invoke(app, args + ["--seed", "1", "--force"]).exit_code == 0
    assert out.read_text() != first
    # checked before any work: a benchmark refuses at once
    res = runner.invoke(app, ["bench", "decode", "--out", str(out)])
    assert res.exit_code == 2 and "exists already" in res.stderr


def test_set_reaches_any_key_and_a_flag_wins(tmp_path):
    res = runner.invoke(app, ["synth", "math", "--set", "n=3", "--set", "families=[arith]"])
    assert res.exit_code == 0, res.output
    assert len(res.stdout.splitlines()) == 3
    res = runner.invoke(app, ["synth", "math", "--set", "n=3", "--num-tasks", "2", "--families", "arith"])
    assert len(res.stdout.splitlines()) == 2
    res = runner.invoke(app, ["synth", "math", "--set", "nope=1"])
    assert res.exit_code == 2 and "unknown key 'nope'" in res.stderr
    res = runner.invoke(app, ["synth", "math", "--set", "n"])
    assert res.exit_code == 2 and "--set n: expected KEY=VALUE" in res.stderr


def test_old_spellings_still_work_with_one_warning_line():
    res = runner.invoke(app, ["synth", "math", "--n", "2", "--families", "arith"])
    assert res.exit_code == 0 and len(res.stdout.splitlines()) == 2
    assert "warning: --n is deprecated; use --num-tasks" in res.stderr


REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def _invocations(text: str):
    """(command words, flags) of every `sparse-rl ...` invocation in shell text."""
    text = text.replace("\\\n", " ")
    leaves = {" ".join(p): c for p, c in LEAVES}
    for line in text.splitlines():
        for part in line.split("|"):
            m = re.search(r"sparse-rl ([a-z]+)(?: ([a-z]+))?(.*)", part)
            if not m:
                continue
            words = f"{m.group(1)} {m.group(2)}" if f"{m.group(1)} {m.group(2)}" in leaves else m.group(1)
            rest = m.group(3) if words == f"{m.group(1)} {m.group(2)}" else f" {m.group(2) or ''}{m.group(3)}"
            yield words, re.findall(r"(?<![\w$-])(--?[a-zA-Z][\w-]*)", rest.split("#")[0])


def _docs():
    yield "recipes/pipeline_cpu.sh", (REPO / "recipes/pipeline_cpu.sh").read_text()
    for p in sorted((REPO / "recipes").glob("*.yaml")):
        yield str(p.relative_to(REPO)), "\n".join(ln for ln in p.read_text().splitlines() if ln.startswith("#"))
    for name in ("README.md", "sparse_rl/synth/README.md"):
        md = (REPO / name).read_text()
        blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", md, flags=re.S) + re.findall(r"`(sparse-rl [^`]*)`", md)
        yield name, "\n".join(blocks)


@pytest.mark.parametrize("name,text", list(_docs()), ids=[n for n, _ in _docs()])
def test_recipes_and_readmes_use_current_spellings(name, text):
    """Every `sparse-rl` line in recipes/ and the READMEs names a command and flags that exist and are
    not deprecated (a deprecated spelling is hidden from --help)."""
    leaves = {" ".join(p): c for p, c in LEAVES}
    groups = {" ".join(p) for p, _ in GROUPS}
    seen = 0
    for words, flags in _invocations(text):
        if words in groups or words not in leaves:
            assert words in groups, f"{name}: unknown command 'sparse-rl {words}'"
            continue
        seen += 1
        shown = {o for p in _visible_options(leaves[words]) for o in p.opts + p.secondary_opts}
        bad = [f for f in flags if f not in shown]
        assert not bad, f"{name}: sparse-rl {words}: {', '.join(bad)} not a current option"
    assert seen, f"{name}: no sparse-rl command found"
