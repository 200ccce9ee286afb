"""File helpers shared by every stage: JSONL with line-numbered errors (binary input included),
`-` for stdin/stdout, and atomic writes (temp file or temp directory, then rename) so a killed run
never leaves a half-written output behind. Only regular files are replaced by rename; a device,
FIFO or /dev/stdout is written in place. Outputs get the usual umask-governed modes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

from sparse_rl.errors import SparseRLError, UsageError


def _name(path: str | Path) -> str:
    return "<stdin>" if str(path) == "-" else str(path)


def _stdin_bytes(flag: str | None) -> IO[bytes]:
    if sys.stdin is None or sys.stdin.closed:
        raise SparseRLError(f"{flag + ' ' if flag else ''}-: standard input is closed (pass a file instead)")
    return getattr(sys.stdin, "buffer", sys.stdin)


def iter_jsonl(path: str | Path, required: Iterable[str] = (), any_of: Iterable[str] = (),
               check: Callable[[dict, str, int], dict] | None = None, flag: str | None = None) -> Iterator[dict]:
    """Yield records of a JSONL file (or stdin for `-`), checking them as they stream.

    Raises SparseRLError naming the file and line on bytes that are not UTF-8, bad JSON, a
    non-object line, a missing `required` field, or none of `any_of` present. Blank lines are
    skipped. `check(rec, name, lineno)` validates (and may transform) each record; `flag` prefixes
    the file-not-found error.
    """
    required, any_of = tuple(required), tuple(any_of)
    name = _name(path)
    if str(path) == "-":
        fh: IO[bytes] = _stdin_bytes(flag)
        close = False
    else:
        p = Path(path)
        if not p.is_file():
            raise SparseRLError(f"{flag + ' ' if flag else ''}{name}: file not found")
        fh = p.open("rb")
        close = True
    try:
        for lineno, raw in enumerate(fh, 1):
            line = _decode(raw, name, lineno)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                msg = e.msg[:-3] if e.msg.endswith(" at") else e.msg  # "Unterminated string starting at"
                raise SparseRLError(f"{name} line {lineno}: invalid JSON at column {e.colno}: {msg}") from None
            if not isinstance(rec, dict):
                raise SparseRLError(f"{name} line {lineno}: expected a JSON object, got {type(rec).__name__}")
            for key in required:
                if key not in rec:
                    raise SparseRLError(f"{name} line {lineno}: missing field '{key}'")
            if any_of and not any(k in rec for k in any_of):
                raise SparseRLError(f"{name} line {lineno}: needs one of the fields {', '.join(repr(k) for k in any_of)}")
            yield check(rec, name, lineno) if check is not None else rec
    finally:
        if close:
            fh.close()


def _decode(raw: bytes | str, name: str, lineno: int) -> str:
    if isinstance(raw, str):  # a text stream stood in for stdin (tests)
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SparseRLError(f"{name} line {lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                            f"{len(raw[:e.start].decode('utf-8', 'replace')) + 1}); is this a binary file?") from None


def read_jsonl(path: str | Path, required: Iterable[str] = (), any_of: Iterable[str] = ()) -> list[dict]:
    return list(iter_jsonl(path, required, any_of))


def dumps(rec: Any) -> str:
    return json.dumps(rec, ensure_ascii=False)


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new output file gets under the umask (what `open` would give; mkstemp gives 0600)."""
    return 0o666 & ~_umask()


def _replaceable(p: Path) -> bool:
    """Whether the output may be written beside and renamed over `p`: only a regular file (or a
    new name). A device, FIFO, socket or /dev/stdout is written in place: renaming over
    /dev/null would turn the device into a regular file."""
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except FileNotFoundError:
        return True


@contextlib.contextmanager
def _open_one(path: str | Path | None, force: bool):
    """(file handle, commit) for one output; commit() renames it into place."""
    if path is None or str(path) == "-":
        yield sys.stdout, sys.stdout.flush
        return
    p = Path(path)
    if (p.is_file() or p.is_dir()) and not force:  # a device or FIFO is written in place, not replaced
        raise UsageError(f"{p}: exists already (pass --force to overwrite)")
    if not _replaceable(p):
        with open(p, "w", encoding="utf-8") as fh:
            yield fh, fh.flush
        return
    p = Path(os.path.realpath(p))  # a symlink to a file: replace the file, keep the link
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; an output file follows the umask
        with writing(p), os.fdopen(fd, "w", encoding="utf-8") as fh:
            def commit():
                with writing(p):
                    fh.flush()
                    os.replace(tmp, p)
            yield fh, commit
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def open_outputs(*paths: str | Path | None, force: bool = True):
    """Open several outputs that succeed or fail together: each is written to a temp file, and
    only when the block finished are all renamed into place (one after the other, in the order
    given), so a failed run leaves none of them. `-`/None is stdout; a non-regular file (device,
    FIFO) is written directly."""
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(_open_one(p, force)) for p in paths]
        yield [fh for fh, _ in opened]
        for _, commit in opened:
            commit()


@contextlib.contextmanager
def open_output(path: str | Path | None, force: bool = True):
    """Open an output for writing: stdout for `-`/None, else a temp file renamed into place on
    success (removed on failure), so the target is either complete or absent."""
    with open_outputs(path, force=force) as (fh,):
        yield fh


def write_jsonl(path: str | Path | None, records: Iterable[dict]) -> int:
    n = 0
    with open_output(path) as fh:
        for rec in records:
            fh.write(dumps(rec) + "\n")
            n += 1
    return n


def append_jsonl(path: str | Path, rec: dict) -> None:
    """Append one record and flush it to disk (metrics logs: a crash loses at most the current line,
    which `drop_cut_last_line` removes when the writer resumes)."""
    with writing(path):
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def drop_cut_last_line(path: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """Make an append-only JSONL file whole again before a writer resumes it; returns `path`.

    A crash or a full disk during `append_jsonl` can leave the last line cut short: that line is
    removed (and `log` told so in one line; default: stderr). A last line that parses but lacks its
    newline gets one, so the next append starts a line of its own. Earlier bad lines are left for
    the reader to report (they are damage, not an interruption)."""
    p = Path(path)
    if not p.is_file():
        return p
    data = p.read_bytes()
    if not data or data.endswith(b"\n"):
        return p
    head, _, last = data.rpartition(b"\n")
    lineno = data.count(b"\n") + 1
    try:
        json.loads(last)
        fixed = data + b"\n"
    except ValueError:  # JSONDecodeError, or bytes cut inside a UTF-8 sequence
        fixed = head + b"\n" if head else b""
        say = log or (lambda msg: print(msg, file=sys.stderr))
        say(f"{p}: dropped its cut last line (line {lineno}, left by an interrupted write)")
    with writing(p), open_output(p) as fh:
        fh.write(fixed.decode("utf-8"))
    return p


@contextlib.contextmanager
def writing(path: str | Path, what: str = ""):
    """Name the file being written in a write error (a full disk says only `[Errno 28]`, torch's
    serializer only `inline_container.cc ... unexpected pos`)."""
    try:
        yield
    except SparseRLError:
        raise
    except Exception as e:  # OSError, torch's RuntimeError, safetensors' SafetensorError
        if not _is_write_error(e):  # e.g. the caller failing to read an input inside the block: not ours to name
            raise
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:160]
        raise SparseRLError(f"{what + ' ' if what else ''}{path}: cannot write it ({why}); free disk space and "
                            "rerun (runs resume with --resume)") from None


def _is_write_error(e: Exception) -> bool:
    import errno

    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO)
    msg = str(e)  # torch.save / safetensors report a failed write as a RuntimeError
    return any(s in msg for s in ("inline_container", "unexpected pos", "PytorchStreamWriter", "file write failed",
                                  "No space left", "File too large", "Disk quota", "StorageFull", "FileTooLarge",
                                  "code: 28", "code: 27"))


def atomic_write_text(path: str | Path, text: str) -> None:
    with open_output(path) as fh:
        fh.write(text)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | Path, force: bool = False, flag: str = "OUT"):
    """Build a directory under a temporary name beside `path` and rename it into place at the end.

    On any failure the temporary directory is removed and `path` is untouched. An existing `path`
    is an error unless `force`, in which case it is replaced only once the new one is complete.
    """
    p = Path(path)
    if p.exists() and not force:
        raise UsageError(f"{flag} {p}: exists already (pass --force to overwrite)")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; an output directory follows the umask
    try:
        yield tmp
        if p.exists():
            old = p.with_name(f".{p.name}.old-{os.getpid()}")
            os.replace(p, old)
            os.replace(tmp, p)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

