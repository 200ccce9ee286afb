import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`-n 2`, as .ci/run runs) each worker takes one core: one torch thread each, set before
# torch is imported, so two workers do not oversubscribe a 2-core machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run on the CPU through the interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_setup(item):
    """Tests marked `interpreter` run Triton kernels on CPU tensors, which only the interpreter can: skipped where
    the environment turned it off (a GPU run with TRITON_INTERPRET=0)."""
    if item.get_closest_marker("interpreter") and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1; conftest sets it unless the "
                    "environment says otherwise)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny llama model dir built once per session by the real CLI (`sparse-rl model init`)."""
    from typer.testing import CliRunner

    from sparse_rl.cli.main import app

    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    res = CliRunner().invoke(app, ["model", "init", str(out), "--arch", "llama", "--size", "tiny", "--seed", "0"])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture
def pdl_kernel_name():
    """Under the interpreter, called from a stand-in for `gdc_wait` / `gdc_launch_dependents`: the name of the
    kernel whose prologue (`ops.pdl.pdl_enter`) made the call, past the interpreter's own frames."""
    import sys

    def name():
        f = sys._getframe(2)
        while f.f_code.co_name != "pdl_enter":
            f = f.f_back
        f = f.f_back
        while "sparse_rl" not in f.f_code.co_filename:
            f = f.f_back
        return f.f_code.co_name

    return name
