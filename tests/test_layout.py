"""The one-way house: imports run cli -> commands -> verify / advise -> plan -> run -> resolve /
spec / config, with no circle anywhere. The graph is read from the source (every import statement,
module level or inside a function), so a lazy import cannot hide an arrow pointing back. Imports
under `if TYPE_CHECKING:` are names for annotations, never run: they are no arrow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trainplan"

# What each room may import from trainplan (beyond itself). The foundation (config, errors,
# files, resolve, spec, startup, text, _torch_private) is open to everyone and imports only within itself.
FOUNDATION = {"config", "errors", "features", "files", "resolve", "spec", "startup", "text", "_torch_private"}
ALLOWED = {
    "cli": {"commands"},
    "commands": {"verify", "advise", "plan", "run"},
    "verify": {"plan", "run"},
    "advise": {"plan"},
    "plan": {"run"},  # plan/traced traces the engine's own build, step and measure
    "run": set(),
}
FOUNDATION_ORDER = {  # inside the foundation, still one way
    "errors": set(),
    "text": set(),
    "startup": set(),  # the process's collector through start-up: the entry (cli) and the loop ask it
    "files": {"errors"},
    "_torch_private": {"errors"},
    "config": {"errors", "files"},  # files: the checked readers (parse_nested), below config and spec
    "spec": {"config", "errors", "files"},
    "features": {"config", "errors", "spec"},  # each memory option's rules, read by resolve and all above
    "resolve": {"config", "errors", "features", "spec"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every trainplan module this file imports, at any depth of the file."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # drop the type-only blocks
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("trainplan")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainplan"):
            for alias in node.names:  # `from trainplan.run import step` imports trainplan.run.step
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _is_module(candidate) else node.module)
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) - {module_name(p)} for p in PACKAGE.rglob("*.py")}


# A feature's folder (trainplan/features/<name>/) holds its rules (__init__.py, the foundation), its plan
# terms (plan.py, the planner's room) and what it does in the engine (engine.py, the engine's room).
FEATURE_SIDES = {"plan": "plan", "engine": "run"}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 4 and parts[1] == "features" and parts[3] in FEATURE_SIDES:
        return FEATURE_SIDES[parts[3]]
    return parts[1] if len(parts) > 1 else "trainplan"


def test_every_arrow_runs_one_way():
    wrong = []
    for mod, deps in graph().items():
        src = room(mod)
        if src in ("trainplan", "__main__"):
            continue
        for dep in deps:
            dst = room(dep)
            if dst == src or dst == "trainplan":
                continue
            allowed = FOUNDATION_ORDER.get(src, FOUNDATION | ALLOWED.get(src, set()))
            if dst not in allowed:
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "imports against the one-way arrows: " + "; ".join(sorted(wrong))


def test_the_engine_imports_neither_planner_nor_verification_nor_commands():
    engine = {m: deps for m, deps in graph().items() if room(m) == "run"}
    assert len(engine) >= 15  # the walk found the engine's modules
    leaks = [
        f"{m} -> {d}" for m, deps in engine.items() for d in deps if room(d) in ("plan", "verify", "commands", "cli")
    ]
    assert not leaks, leaks


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if dep not in g:
                continue
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep] if dep in stack else [node, dep]
            if dep not in state:
                cycle = visit(dep, [*stack, dep])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for start in sorted(g):
        if start not in state:
            cycle = visit(start, [start])
            assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("bad", ["trainplan.cli", "trainplan.plan.analytic", "trainplan.verify.accept"])
def test_the_walk_would_see_a_backward_import(tmp_path, bad):
    """The check can fail: an engine module importing backwards is caught."""
    f = tmp_path / "m.py"
    f.write_text(f"def later():\n    from {bad.rsplit('.', 1)[0]} import {bad.rsplit('.', 1)[1]}\n")
    assert imports(f) == {bad}


def test_the_walk_skips_type_only_imports(tmp_path):
    """A name imported for annotations only is no arrow; a lazy import beside it still is."""
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainplan.resolve import Resolved\n"
        "def later():\n    from trainplan.plan import analytic\n"
    )
    assert imports(f) == {"trainplan.plan.analytic"}


def test_the_examples_are_kept_once():
    """examples/ at the top is a link to the shipped trainplan/examples/, so the two cannot drift."""
    top = PACKAGE.parent / "examples"
    assert top.is_symlink() and top.resolve() == (PACKAGE / "examples").resolve()
    assert sorted(p.name for p in top.iterdir()) == sorted(p.name for p in (PACKAGE / "examples").iterdir())


# Sizes (issue 31): a module stays readable, the loop's entry points short, a dataclass one concern.
MAX_MODULE_LINES, MAX_RUN_LINES, MAX_FIELDS = 600, 40, 25
FIELD_EXCEPTIONS = {  # dataclass -> why it is larger
    "RunRecord": "record.json's schema, read back by the registry and the checks: a split changes the file format",
}


def test_no_module_is_over_600_lines():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long


def test_the_loops_entry_points_are_short():
    tree = ast.parse((PACKAGE / "run" / "loop.py").read_text())
    sizes = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert sizes["run"] <= MAX_RUN_LINES and sizes["train"] <= 70, sizes


def test_no_dataclass_has_over_25_fields_but_the_listed():
    wide = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                fields = sum(isinstance(b, ast.AnnAssign) for b in node.body)
                if fields > MAX_FIELDS:
                    wide[node.name] = fields
    assert set(wide) == set(FIELD_EXCEPTIONS), wide


def test_no_test_can_hang_the_suite(request):
    """pytest-timeout bounds every test (pyproject.toml): a hung process fails its test, not CI's 90 minutes."""
    assert request.config.pluginmanager.hasplugin("timeout")
    assert 0 < float(request.config.getini("timeout")) <= 1800
