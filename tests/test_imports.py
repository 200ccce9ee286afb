"""No import circles in sparse_rl: walk every module's imports (its AST, nothing is executed) and
fail on a cycle. Two graphs: the module-level imports (a cycle there breaks or depends on import
order), and all imports including the lazy ones inside functions (a cycle there means two modules
own each other's concepts)."""

from __future__ import annotations

import ast
from pathlib import Path

import sparse_rl

ROOT = Path(sparse_rl.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = ("sparse_rl", *p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path], module_level: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level else list(ast.walk(tree))
    if module_level:  # module level includes `if`/`try` blocks at the top, not function bodies
        stack, nodes = list(tree.body), []
        while stack:
            n = stack.pop()
            nodes.append(n)
            if isinstance(n, (ast.If, ast.Try)):
                stack.extend(ast.iter_child_nodes(n))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for n in nodes:
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING":
            continue
        targets = []
        if isinstance(n, ast.Import):
            targets = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` depends on the submodule; `from mod import name` on the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in n.names]
        for t in targets:
            while t and t not in mods:  # `import a.b.c` names a.b.c; `from a import f` names a
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("sparse_rl"):
                out.add(t)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (c := visit(v)):
                return c
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (c := visit(u)):
            return c
    return None


def _graph(module_level: bool, drop_packages: bool) -> dict[str, set[str]]:
    mods = _modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    g = {m: _imports(m, p, mods, module_level) for m, p in mods.items()}
    if drop_packages:  # a package's __init__ re-exporting its children is not a circle of concepts
        g = {m: {t for t in ts if t not in packages} for m, ts in g.items() if m not in packages}
    return g


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_level_import_cycles():
    cycle = _cycle(_graph(module_level=True, drop_packages=False))
    assert cycle is None, "module-level import circle: " + " -> ".join(cycle)


def test_no_import_cycles_between_modules_even_lazy_ones():
    cycle = _cycle(_graph(module_level=False, drop_packages=True))
    assert cycle is None, "import circle (counting imports inside functions): " + " -> ".join(cycle)
