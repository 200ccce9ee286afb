"""The evidence recipe's driver (run it through run.sh): three parts of `sparse-rl` stages, each
stage skipped when its marker `OUT/.done/<stage>` exists, so a killed run continues where it stopped
and each part can run on another machine from the previous part's hand-off dir.

The stages are the real CLI commands, invoked in one Python process through the Typer app (one
torch import instead of one per stage: the CPU smoke run would otherwise spend its budget importing).
Every command is also written, as a shell line, to OUT/commands.sh: running those lines one by one
in a shell does the same thing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

SIZES = {
    # CPU smoke (a test of the plumbing; it claims nothing): tiny model, tiny tables, a few steps.
    "cpu": dict(model="tiny", device="cpu", train_dtype="float32", mixed="no",
                pre_keys="4|4,6", pre_split="1,1", pre_hops=2, pre_loss="all", pre_n=64, pre_steps=6, pre_seq=256,
                pre_bs=8, pre_lr=3e-3, pre_warmup=2,
                keys=6, hops=2, digits=4, sft_n=48, sft_steps=4, sft_seq=256, sft_bs=8, sft_lr=3e-3,
                heldout_n=4, grpo_n=16, topk=16, sink=2, window=4, index_heads=2, index_dim=16,
                idx_steps=3, idx_seq=128, idx_bs=2, idx_lr=3e-3,
                grpo_steps=2, grpo_seed=0, prompts=2, samples=2, distill_samples=4, max_new=40, grpo_lr=1e-4, max_batch=8,
                niah_lengths="256", niah_depths="0.5", niah_per_cell=1),
    # One H200 (benchmarks/results/2026-12-01-h200-evidence.md). Session 5: at lr 2e-3 on 16-row
    # tables the 5.5M model never learned the key match (run 3: 3,000 steps, 0/128). Session 6's pilots
    # (14 variants): at lr 1e-3 with 4 hops it learns 4-row tables in ~400-800 steps, and each
    # lengthening is partly re-learned while the shorter size is forgotten (2-digit 4 -> 16 -> 40 rows:
    # 0.99 exact at 40; 3-digit 4 -> 16 -> 48: 0.20 exact and rising at 48). So pre-training runs in
    # stages (`pre_keys`, '|' between stages, each stage a mix of the sizes so far; `pre_split` shares
    # `pre_steps` out; AdamW beta2 0.95 as in the pilots), then SFT lengthens to the 96-row tables of
    # the task (~1.1K tokens; k = 64). Session 7, part 1 at these sizes on the H200: 224 s of stages
    # (pre-training 2,400 steps 142 s, SFT 200 steps 35 s), SFT policy 0.75 held-out greedy accuracy
    # dense, 0.60 sparse after the indexer warm-up (SFT loss 1.12 -> 0.02).
    "gpu": dict(model="small", device="cuda", train_dtype="float32", mixed="bf16",
                pre_keys="4|4,16|4,16,48", pre_split="1,1,2", pre_hops=4, pre_loss="assistant", pre_n=30000,
                pre_steps=2400, pre_seq=1024, pre_bs=16, pre_lr=1e-3, pre_warmup=50,
                keys=96, hops=4, digits=3, sft_n=4000, sft_steps=200, sft_seq=2048, sft_bs=8, sft_lr=1e-3,
                heldout_n=128, grpo_n=1024, topk=64, sink=4, window=16, index_heads=4, index_dim=32,
                idx_steps=150, idx_seq=2048, idx_bs=8, idx_lr=1e-3,
                grpo_steps=20, grpo_seed=0, prompts=16, samples=8, distill_samples=12, max_new=80, grpo_lr=3e-5, max_batch=256,
                niah_lengths="512,1k", niah_depths="0.1,0.5,0.9", niah_per_cell=4),
}
MODES = {"dense": ["--mode", "dense"], "sparse": ["--mode", "sparse"],
         "sparse-tis": ["--mode", "sparse", "--set", "loss.mismatch=tis"],
         "sparse-distill": ["--mode", "sparse+distill"]}


def _provenance() -> dict:
    """Date, device, torch and the code's commit (EV_COMMIT, else git's HEAD of this checkout: a copied
    work tree may carry an older .git, so a launcher that knows better passes EV_COMMIT)."""
    import subprocess

    import torch

    commit = os.environ.get("EV_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                    capture_output=True, text=True, timeout=10).stdout.strip() or None
        except OSError:
            commit = None
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": dev, "torch": torch.__version__,
            "commit": commit}


def _only(items: dict) -> dict:
    """ONLY=name,name runs those GRPO modes / part-3 policies alone (several processes can share a GPU);
    a last run without ONLY skips every finished stage and writes the report and the whole commands.sh."""
    want = os.environ.get("ONLY")
    if want is None:
        return items
    names = want.split(",")
    bad = [n for n in names if n not in {"sft", *MODES}]
    if bad:
        raise SystemExit(f"ONLY={want}: unknown {bad[0]!r}; expected names among sft, {', '.join(MODES)}")
    return {k: v for k, v in items.items() if k in names}


class Recipe:
    def __init__(self, out: Path, size: str):
        self.out, self.s = out, dict(SIZES[size])
        for k, v in list(self.s.items()):  # EV_<KEY>=value overrides one size
            env = os.environ.get(f"EV_{k.upper()}")
            if env is not None:
                self.s[k] = type(v)(env)
        self.s["SIZE"] = size
        self.commands: list[str] = []
        (out / ".done").mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        (out / "sizes.json").write_text(json.dumps(self.s, indent=1))
        self.sub = "ONLY" in os.environ  # a share of the work: commands.sh is left to the whole run
        if not (out / "provenance.json").exists():
            (out / "provenance.json").write_text(json.dumps(_provenance(), indent=1))

    def stage(self, name: str, args: list[str], resumable: Path | None = None) -> None:
        """Run `sparse-rl ARGS` unless done; stdout goes to logs/<name>.out. A trainer whose run dir
        exists continues with --resume; any other stage restarts with --force (its outputs are atomic)."""
        self.commands.append(shlex.join(["sparse-rl", *args]) + f" > {shlex.quote(str(self.out / 'logs' / name))}.out")
        self._write_commands()
        if (self.out / ".done" / name).exists():
            print(f"[evidence] {name}: done already", file=sys.stderr)
            return
        if resumable is not None and resumable.exists():
            extra = ["--resume"]
        elif resumable is not None and args[0] == "grpo":
            extra = []  # a fresh grpo run dir
        else:
            extra = ["--force"]
        from sparse_rl.cli.main import app

        t0 = time.time()
        print(f"[evidence] {name}: sparse-rl {shlex.join(args)}", file=sys.stderr)
        with open(self.out / "logs" / f"{name}.out", "w") as fh, contextlib.redirect_stdout(fh):
            rc = app([*args, *extra], standalone_mode=False, prog_name="sparse-rl")
        if rc not in (None, 0):
            raise SystemExit(f"[evidence] {name} failed (exit {rc}); fix and re-run: finished stages are kept")
        (self.out / ".done" / name).write_text(json.dumps({"seconds": time.time() - t0}))

    def python(self, name: str, fn, *args) -> None:
        """A bookkeeping step of sparse_rl.eval.evidence (scoring, hand-off), with the same skip rule."""
        call = f"{fn.__name__}({', '.join(repr(str(a)) for a in args if a is not None)})"
        self.commands.append(shlex.join(["python", "-c", f"from sparse_rl.eval import evidence; evidence.{call}"]))
        self._write_commands()
        if (self.out / ".done" / name).exists():
            return
        res = fn(*args)
        (self.out / ".done" / name).write_text(json.dumps(res))

    def _write_commands(self) -> None:
        if self.sub:
            return
        (self.out / "commands.sh").write_text("\n".join(self.commands) + "\n")

    def _pre_stages(self) -> list[tuple[str, int]]:
        """[(table sizes of the stage's mix, its steps)] from pre_keys ('4|4,16|...') and pre_split."""
        mixes = str(self.s["pre_keys"]).split("|")
        split = [float(x) for x in str(self.s["pre_split"]).split(",")]
        if len(split) != len(mixes):
            raise SystemExit(f"EV_PRE_SPLIT={self.s['pre_split']}: one share per stage of EV_PRE_KEYS={self.s['pre_keys']}")
        total = int(self.s["pre_steps"])
        return [(m, max(1, round(total * w / sum(split)))) for m, w in zip(mixes, split)]

    # ------------------------------------------------------------------ part 1
    def part1(self) -> None:
        s, o = self.s, self.out / "part1"
        dev = ["--device", s["device"]]
        o.mkdir(exist_ok=True)
        self.stage("p1-model", ["model", "init", str(o / "base"), "--size", s["model"], "--seed", "0"])
        stages = self._pre_stages()
        tasks = [(f"pretrain{j}", 10 + j, mix, s["pre_hops"], s["pre_n"]) for j, (mix, _) in enumerate(stages)]
        for name, seed, keys, hops, n in (*tasks, ("sft", 2, s["keys"], s["hops"], s["sft_n"]),
                                          ("heldout", 3, s["keys"], s["hops"], s["heldout_n"]),
                                          ("grpo", 4, s["keys"], s["hops"], s["grpo_n"])):
            self.stage(f"p1-tasks-{name}", ["synth", "lookup", "--num-tasks", str(n), "--seed", str(seed), "--keys",
                                            str(keys), "--hops", str(hops), "--digits", str(s["digits"]), "--out", str(o / f"{name}.jsonl")])
        # pre-training from scratch on the solutions of short tables, lengthened stage by stage (Zoology:
        # recall on short contexts first); each stage continues from the previous stage's model
        train = ["--lr-warmup", str(s["pre_warmup"]), "--adam-beta2", "0.95", "--dtype", s["train_dtype"],
                 "--mixed-precision", s["mixed"], "--save-every", "250", *dev]  # every pre-training stage and SFT
        src = o / "base"
        for j, (_, steps) in enumerate(stages):
            dst = o / f"pre{j}"
            self.stage(f"p1-pretrain{j}", ["sft", str(src), "--data", str(o / f"pretrain{j}.jsonl"), "--out", str(dst),
                                           "--loss-on", s["pre_loss"], "--seq-len", str(s["pre_seq"]), "--batch-size",
                                           str(s["pre_bs"]), "--steps", str(steps), "--lr", str(s["pre_lr"]), *train],
                       resumable=o / f"pre{j}.run")
            src = dst
        self.stage("p1-sft", ["sft", str(src), "--data", str(o / "sft.jsonl"), "--out", str(o / "sft"),
                              "--run-dir", str(o / "sft.run"), "--seq-len", str(s["sft_seq"]), "--batch-size",
                              str(s["sft_bs"]), "--steps", str(s["sft_steps"]), "--lr", str(s["sft_lr"]), *train],
                   resumable=o / "sft.run")
        self.stage("p1-convert", ["convert", str(o / "sft"), str(o / "sparse"), "--index-topk", str(s["topk"]),
                                  "--index-heads", str(s["index_heads"]), "--index-dim", str(s["index_dim"]),
                                  "--sink", str(s["sink"]), "--window", str(s["window"]), "--dense-layers", "0"])
        self.stage("p1-indexer", ["indexer", "train", str(o / "sparse"), "--out", str(o / "indexer"), "--stage", "warmup",
                                  "--data", str(o / "sft.jsonl"), "--seq-len", str(s["idx_seq"]), "--batch-size",
                                  str(s["idx_bs"]), "--steps", str(s["idx_steps"]), "--lr", str(s["idx_lr"]), *dev],
                   resumable=o / "indexer.run")
        from sparse_rl.eval import evidence

        self.python("p1-handoff", evidence.handoff, o / "indexer", o / "handoff")
        for f in ("heldout.jsonl", "grpo.jsonl"):  # the tasks travel with the hand-off
            (o / "handoff" / f).write_bytes((o / f).read_bytes())

    # ------------------------------------------------------------------ part 2
    def part2(self) -> None:
        from sparse_rl import runs
        from sparse_rl.eval import evidence

        s, h, o = self.s, self.out / "part1" / "handoff", self.out / "part2"
        o.mkdir(exist_ok=True)
        for mode, flags in _only(MODES).items():
            samples = s["distill_samples"] if mode == "sparse-distill" else s["samples"]
            run = o / f"grpo-{mode}"
            self.stage(f"p2-grpo-{mode}", ["grpo", str(h), "--tasks", str(h / "grpo.jsonl"), "--out", str(run), *flags,
                                           "--samples", str(samples), "--keep", str(s["samples"]),
                                           "--prompts-per-step", str(s["prompts"]), "--max-new-tokens", str(s["max_new"]),
                                           "--steps", str(s["grpo_steps"]), "--lr", str(s["grpo_lr"]), "--reward", "synth",
                                           "--eval-tasks", str(h / "heldout.jsonl"), "--eval-every", "10",
                                           "--checkpoint-every", "10", "--seed", str(s["grpo_seed"]), "--device", s["device"],
                                           "--dtype", s["train_dtype"],
                                           "--set", f"rollout.max_batch={s['max_batch']}"], resumable=run)
            found = runs.latest(run)
            if found is None:
                raise SystemExit(f"[evidence] {run}: no checkpoint after GRPO")
            adapter = found[1] / "adapter"
            self.python(f"p2-handoff-{mode}", evidence.handoff, found[1] / "policy", o / "handoff" / mode,
                        adapter if adapter.is_dir() else None)
        (o / "handoff" / "heldout.jsonl").write_bytes((h / "heldout.jsonl").read_bytes())
        mb = evidence.dir_mb(o / "handoff")
        print(f"[evidence] part 2 hand-off: {mb:.1f} MB in {o / 'handoff'}", file=sys.stderr)

    # ------------------------------------------------------------------ part 3
    def part3(self) -> None:
        from sparse_rl.eval import evidence

        s, o = self.s, self.out / "part3"
        dev = ["--device", s["device"]]
        policies = _only({"sft": self.out / "part1" / "handoff", **{m: self.out / "part2" / "handoff" / m for m in MODES}})
        tasks = self.out / "part2" / "handoff" / "heldout.jsonl"
        for pol, model in policies.items():
            d = o / pol
            d.mkdir(parents=True, exist_ok=True)
            # the sparse policy of sparse+distill is theta + phi (its LoRA adapter); the dense one is theta
            adapter = ["--adapter", str(model / "adapter")] if (model / "adapter").is_dir() else []
            for att in ("dense", "sparse"):
                comp = d / f"completions-{att}.jsonl"
                self.stage(f"p3-{pol}-generate-{att}", ["generate", str(model), "--prompts", str(tasks), "--out", str(comp),
                                                        "--attention", att, "--temperature", "0", "--max-new-tokens",
                                                        str(s["max_new"]), "--max-batch", str(s["max_batch"]), *dev,
                                                        *(adapter if att == "sparse" else [])])
                self.python(f"p3-{pol}-score-{att}", evidence.score_file, comp, tasks, d / f"acc-{att}.json")
            self.stage(f"p3-{pol}-fidelity", ["eval", "fidelity", str(model), "--data", str(d / "completions-sparse.jsonl"),
                                              "--out", str(d / "fidelity"), *adapter, *dev])
            self.stage(f"p3-{pol}-niah", ["eval", "niah", str(model), "--kinds", "single", "--lengths",
                                          s["niah_lengths"], "--depths", s["niah_depths"], "--per-cell",
                                          str(s["niah_per_cell"]), "--max-new-tokens", "8", "--out", str(d / "niah"), *dev])
        if "ONLY" not in os.environ:
            self.python("p3-report", evidence.report, self.out)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: [SIZE=cpu|gpu] [PART=1|2|3|2,3|all] bash recipes/evidence/run.sh OUT")
    size, part = os.environ.get("SIZE", "gpu"), os.environ.get("PART", "all")
    parts = {"1", "2", "3"} if part == "all" else set(part.split(","))
    if size not in SIZES or not parts or not parts <= {"1", "2", "3"}:
        raise SystemExit(f"SIZE={size} PART={part}: expected SIZE in cpu|gpu and PART in 1|2|3|all (or a list: 2,3)")
    r = Recipe(Path(argv[0]), size)
    for p, fn in (("1", r.part1), ("2", r.part2), ("3", r.part3)):
        if p in parts:
            t0 = time.time()
            fn()
            print(f"[evidence] part {p}: {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
