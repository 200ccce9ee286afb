"""A file system confined to a temporary directory: list_dir, read_file, write_file, search.

Confinement: paths are relative to the workspace root; absolute paths and NUL bytes are refused;
the joined path is normalised (`..` resolved) and then fully resolved with `realpath` (symlinks
followed), and both must stay inside the root's realpath, so neither `../x` nor a symlink pointing
out can reach the host. Walks never follow symlinks. Reads are capped at 20 000 characters.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

from sparse_rl.synth.envs.base import Env, ToolError, check_state_files, write_state_files
from sparse_rl.synth.schema import tool

WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island", "jungle",
         "kettle", "lantern", "meadow", "nectar", "orbit", "pepper", "quartz", "river", "saddle", "timber",
         "umbra", "velvet", "willow", "xenon", "yarrow", "zephyr"]
MAX_READ = 20_000


class FsEnv(Env):
    name = "fs"
    mutating = frozenset({"write_file"})

    def __init__(self, state: dict):
        super().__init__(state)
        self.root = Path(tempfile.mkdtemp(prefix="sparse-rl-fs-")).resolve()
        try:
            write_state_files(self.root, state.get("files", {}))
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    @classmethod
    def check_state(cls, state: dict) -> None:
        check_state_files(state.get("files", {}))

    @classmethod
    def tools(cls) -> list[dict]:
        return [
            tool("list_dir", "List a directory of the workspace (directories end with '/').",
                 {"path": {"type": "string", "description": "relative path, '.' for the root"}}),
            tool("read_file", "Read a text file of the workspace.", {"path": {"type": "string"}}),
            tool("write_file", "Create or overwrite a text file (parent directories are created).",
                 {"path": {"type": "string"}, "content": {"type": "string"}}),
            tool("search", "Find lines containing a literal string in all files under a directory.",
                 {"pattern": {"type": "string"}, "path": {"type": "string"}}, required=["pattern"]),
        ]

    def resolve(self, path: str) -> Path:
        if "\x00" in path:
            raise ToolError("path contains a NUL byte")
        if os.path.isabs(path):
            raise ToolError(f"{path}: paths are relative to the workspace root")
        joined = os.path.normpath(os.path.join(self.root, path))
        real = os.path.realpath(joined)
        for p in (joined, real):
            if p != str(self.root) and not p.startswith(str(self.root) + os.sep):
                raise ToolError(f"{path}: outside the workspace")
        return Path(joined)

    def rel(self, p: Path) -> str:
        return str(p.relative_to(self.root))

    def tool_list_dir(self, path: str = ".") -> str:
        p = self.resolve(path)
        if not p.is_dir():
            raise ToolError(f"{path}: not a directory")
        return "\n".join(sorted(c.name + ("/" if c.is_dir() and not c.is_symlink() else "") for c in p.iterdir())) or "(empty)"

    def tool_read_file(self, path: str) -> str:
        p = self.resolve(path)
        if not p.is_file():
            raise ToolError(f"{path}: no such file")
        text = p.read_text(errors="replace")
        return text[:MAX_READ] + ("\n[truncated]" if len(text) > MAX_READ else "")

    def tool_write_file(self, path: str, content: str) -> str:
        p = self.resolve(path)
        if p == self.root or p.is_dir():
            raise ToolError(f"{path}: is a directory")
        p.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted at the leaf after resolve() still cannot redirect the write.
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(content)
        return f"wrote {len(content)} characters to {self.rel(p)}"

    def tool_search(self, pattern: str, path: str = ".") -> str:
        base = self.resolve(path)
        if not pattern:
            raise ToolError("empty pattern")
        hits = []
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            dirnames.sort()
            for fn in sorted(filenames):
                f = Path(dirpath) / fn
                if f.is_symlink():
                    continue
                for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                    if pattern in line:
                        hits.append(f"{self.rel(f)}:{i}: {line}")
        return "\n".join(hits[:50]) if hits else "no matches"

    def check(self, spec: dict) -> bool:
        if spec["kind"] == "file":
            p = self.root / spec["path"]
            return p.is_file() and p.read_text().strip() == spec["equals"].strip()
        raise ValueError(f"fs env: unknown check {spec['kind']!r}")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------------------------------------------------- tasks


def _gen_total(rng: random.Random, level: int) -> dict:
    files: dict[str, str] = {}
    subdirs = ["data"] + (["data/q1", "data/q2"] if level >= 3 else [])
    total = 0
    n_txt = 1 + level
    for i in range(n_txt):
        d = rng.choice(subdirs)
        lines = []
        for _ in range(rng.randint(1, 2 + level)):
            c = rng.randint(1, 50 * level)
            total += c
            lines.append(f"item={rng.choice(WORDS)} cost={c}")
        files[f"{d}/part{i}.txt"] = "\n".join(lines) + "\n"
    if level >= 2:  # distractors that must be ignored
        files["data/notes.log"] = "\n".join(f"item={rng.choice(WORDS)} cost={rng.randint(1, 99)}" for _ in range(3)) + "\n"
        files["data/archive/old.txt"] = f"item=old cost={rng.randint(100, 999)}\n"
    extra = " Ignore other file types and everything under data/archive." if level >= 2 else ""
    prompt = ("Add up every cost= value in the .txt files under data/ (including subdirectories)." + extra +
              " Write the total to report.txt as a single line `total=<N>`, then reply with the total.")
    used = sorted({p.rsplit("/", 1)[0] for p in files} - {"data/archive"})
    solution = [{"name": "list_dir", "arguments": {"path": d}} for d in used]
    solution += [{"name": "read_file", "arguments": {"path": p}} for p in sorted(files)
                 if p.endswith(".txt") and not p.startswith("data/archive/")]
    solution.append({"name": "write_file", "arguments": {"path": "report.txt", "content": f"total={total}\n"}})
    return {"prompt": prompt, "answer": str(total), "answer_kind": "number", "state": {"files": files},
            "solution": solution, "checks": [{"kind": "file", "path": "report.txt", "equals": f"total={total}"}]}


def _gen_find(rng: random.Random, level: int) -> dict:
    token = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(8))
    n = 3 + 2 * level
    dirs = ["docs", "src", "misc/old"][: 1 + min(2, level // 2)]
    paths = sorted({f"{rng.choice(dirs)}/{rng.choice(WORDS)}_{i}.txt" for i in range(n)})
    target = rng.choice(paths)
    files = {}
    for p in paths:
        lines = [" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(3 + level)]
        if p == target:
            lines.insert(rng.randrange(len(lines) + 1), f"code word: {token}")
        elif level >= 2 and rng.random() < 0.5:  # near-miss distractor: one character differs
            k = rng.randrange(len(token))
            near = token[:k] + ("X" if token[k] != "X" else "Y") + token[k + 1:]
            lines.insert(rng.randrange(len(lines) + 1), f"code word: {near}")
        files[p] = "\n".join(lines) + "\n"
    prompt = f"Exactly one file in the workspace contains the code word {token}. Reply with that file's path."
    return {"prompt": prompt, "answer": target, "answer_kind": "text", "state": {"files": files},
            "solution": [{"name": "search", "arguments": {"pattern": token, "path": "."}}], "checks": []}


TEMPLATES = {"total": _gen_total, "find": _gen_find}
