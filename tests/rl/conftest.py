"""Shared by the rl tests: a tiny sparse model with tasks and a torchrun launcher (the multi-process GRPO tests),
and a random decode cache (the engine-step tests)."""

import json
import os
import socket
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tiny llama dense + sparse dirs, 8 arithmetic tasks and a reward that varies within a group."""
    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("grpo_multi")
    init_model(root / "dense", ModelInitConfig(arch="llama", size="tiny", seed=0))
    sc = SparseConfig(topk=6, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=3))
    (root / "tasks.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i), "task": "math"}) + "\n"
        for i in range(8)))
    (root / "rw.py").write_text("def varied(completions, tasks):\n"
                                "    return [(sum(map(ord, c['completion'])) % 97) / 97 for c in completions]\n")
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list, check: bool = True, nproc: int = 2) -> subprocess.CompletedProcess:
    """`sparse-rl ARGS` in `nproc` gloo processes under torchrun on the CPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), "-m", "sparse_rl.cli.main", *[str(a) for a in args]]
    envv = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=envv)
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.fixture
def torchrun():
    return launch


@pytest.fixture
def random_cache():
    """fill(eng, slots, seed): the engine's decode cache for `slots` positions with random K/V and index keys (a
    step's kernels never run on zeros), returned."""
    import torch

    def fill(eng, slots: int, seed: int):
        cache = eng._ensure_cache(slots)
        g = torch.Generator().manual_seed(seed)
        for t in (cache.k, cache.v, cache.idx):
            t.copy_(torch.randn(t.shape, generator=g))
        return cache

    return fill

