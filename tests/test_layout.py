"""Package layering: nothing below `sparse_rl/cli/` imports the CLI; devices and dtypes resolve in one place."""

import ast
from pathlib import Path

import pytest
import torch

import sparse_rl
from sparse_rl.devices import resolve_device, resolve_dtype
from sparse_rl.errors import UsageError

PKG = Path(sparse_rl.__file__).parent


def _imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


def test_library_code_does_not_import_the_cli():
    offenders = [f"{p.relative_to(PKG)}: {m}" for p in PKG.rglob("*.py") if "cli" not in p.relative_to(PKG).parts[:1]
                 for m in _imports(p) if m == "sparse_rl.cli" or m.startswith("sparse_rl.cli.")]
    assert offenders == []


def test_resolve_device_and_dtype():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UsageError, match="--device tpu"):
        resolve_device("tpu")
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", "cuda:0") is torch.bfloat16
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(UsageError, match="--dtype int8"):
        resolve_dtype("int8")
