"""Every YAML recipe names its launch command in its header and loads into that stage's config
dataclass (torchtune style): a renamed or removed option breaks this test, not a user's run."""

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from sparse_rl.config import load_config

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))

# launch command -> the dataclass its --config fills
CONFIG_OF = {
    "model init": "sparse_rl.modelinit:ModelInitConfig",
    "convert": "sparse_rl.sparse.convert:ConvertConfig",
    "indexer train": "sparse_rl.sparse.train.trainer:IndexerTrainConfig",
    "indexer eval": "sparse_rl.sparse.train.trainer:IndexerEvalConfig",
    "generate": "sparse_rl.rl.rollout.generate:GenerateConfig",
    "grpo": "sparse_rl.rl.grpo.config:GRPOConfig",
    "synth math": "sparse_rl.synth.pipeline:SynthMathConfig",
    "synth agent": "sparse_rl.synth.pipeline:SynthAgentConfig",
    "eval math": "sparse_rl.eval.math_eval:MathEvalConfig",
    "eval niah": "sparse_rl.eval.niah:NiahConfig",
    "eval fidelity": "sparse_rl.eval.fidelity:FidelityConfig",
    "demo": "sparse_rl.demo:DemoConfig",
    "bench rollout": "sparse_rl.bench.rollout:BenchRolloutConfig",
}


def _class(path):
    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def test_there_are_recipes():
    assert len(RECIPES) >= 5


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_recipe_loads_into_its_stage_config(recipe):
    launch = [line for line in recipe.read_text().splitlines() if line.startswith("# Launch:")]
    assert launch, f"{recipe.name}: no '# Launch: sparse-rl ...' line in the header comment"
    m = re.search(r"sparse-rl ((?:[a-z]+ )?[a-z]+)(?= |$)", launch[0])
    assert m, f"{recipe.name}: the launch line does not run sparse-rl"
    words = m.group(1)
    key = words if words in CONFIG_OF else words.split()[0]
    assert key in CONFIG_OF, f"{recipe.name}: unknown stage '{words}'"
    cls = _class(CONFIG_OF[key])
    # flags given on the launch line that are config keys too (e.g. --endpoint for a teacher recipe)
    fields = {f.name for f in dataclasses.fields(cls)}
    flags = dict(re.findall(r"--([a-z][a-z-]*) ([^ -][^ ]*)", launch[0]))
    overrides = {k.replace("-", "_"): v for k, v in flags.items() if k.replace("-", "_") in fields and k != "config"}
    cfg = load_config(cls, recipe, overrides)
    assert isinstance(cfg, cls)


def test_unknown_key_in_a_recipe_is_rejected(tmp_path):
    from sparse_rl.errors import UsageError

    bad = tmp_path / "bad.yaml"
    bad.write_text((RECIPES[0].read_text()) + "\nnot_an_option: 1\n")
    with pytest.raises(UsageError, match="not_an_option"):
        load_config(_class(CONFIG_OF["grpo"]) if "grpo" in RECIPES[0].name else _class(CONFIG_OF["synth math"]), bad)
