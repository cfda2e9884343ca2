"""One owner per feature: each memory option's settings are read in its own module under
trainplan/features/, and each refusal is written once. Read from the source (the AST), so prose in
docstrings and comments may name an option freely; code that reads the setting may not."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from trainplan import features

PACKAGE = Path(__file__).resolve().parents[1] / "trainplan"

# The option -> how code reads it: a config field (an attribute of that name) or a value of a field.
OPTIONS = {
    "qlora": ("value", "qlora"),
    "adamw-8bit": ("value", "adamw-8bit"),
    "step_in_backward": ("field", "step_in_backward"),
    "offload_optimizer": ("field", "offload_optimizer"),
    "offload_activations": ("field", "offload_activations"),
    "checkpointing_policy": ("field", "checkpointing_policy"),
    "compile": ("field", "train.compile"),
    "tiled_mlp": ("field", "tiled_mlp"),
}
OWNER = {
    "qlora": {"features/qlora/", "features/lora/"},  # lora: the adapter modes, QLoRA's too
    "adamw-8bit": {"features/optim8bit/"},
    "step_in_backward": {"features/step_in_backward/"},
    "offload_optimizer": {"features/optimizer_offload/"},
    "offload_activations": {"features/activation_offload/"},
    "checkpointing_policy": {"features/checkpointing/"},
    "compile": {"features/torch_compile/"},
    "tiled_mlp": {"features/tiled_mlp/"},
}
# The exceptions, each with its reason.
EVERYONE = {"config/schema.py"}  # the schema: declares every field, its accepted values, and checks each one's type
EXCEPTIONS = {
    # ParallelDims is the one validated layout object (STYLE.md): it carries the flag because at
    # data-parallel degree 1 FSDP2 stays for it (the offload needs the policy)
    "offload_optimizer": {"spec/parallel.py"},
}


def readers(option: str, root: Path = PACKAGE) -> dict[str, list[int]]:
    """Module (relative to the package) -> lines where code reads the option."""
    kind, name = OPTIONS[option]
    out: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if kind == "value":
                hit = isinstance(node, ast.Constant) and node.value == name
            elif "." in name:
                outer, attr = name.split(".")
                hit = (
                    isinstance(node, ast.Attribute)
                    and node.attr == attr
                    and isinstance(node.value, ast.Attribute)
                    and node.value.attr == outer
                )
            else:  # the field, not `features.<module>` (a feature module is named after its option)
                hit = isinstance(node, ast.Attribute) and node.attr == name
                hit = hit and not (isinstance(node.value, ast.Name) and node.value.id == "features")
            if hit:
                out.setdefault(str(path.relative_to(root)), []).append(node.lineno)
    return out


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_option_is_read_in_its_feature_module_only(option):
    allowed = tuple(OWNER[option] | EVERYONE | EXCEPTIONS.get(option, set()))  # a folder, or one file
    found = readers(option)
    assert all(any(m.startswith(owner) for m in found) for owner in OWNER[option]), (
        f"{option}: its feature no longer reads it (the walk is wrong)"
    )
    stray = {m: lines for m, lines in found.items() if not m.startswith(allowed)}
    assert not stray, f"{option} is read outside its feature module: {stray}; ask trainplan/features/ instead"


def test_the_walk_finds_a_stray_read(tmp_path):
    """The check can fail: a module reading an option's field or value directly is caught."""
    (tmp_path / "m.py").write_text(
        "def f(cfg, features):\n"
        "    a = cfg.optim.step_in_backward\n"
        "    b = features.step_in_backward.on(cfg)\n"  # the feature's own answer: allowed
        "    c = cfg.mode == 'qlora'\n"
        "    d = cfg.train.compile\n"
    )
    assert readers("step_in_backward", tmp_path) == {"m.py": [2]}
    assert readers("qlora", tmp_path) == {"m.py": [4]}
    assert readers("compile", tmp_path) == {"m.py": [5]}


def refusals(root: Path = PACKAGE) -> list[tuple[str, str, str]]:
    """(module, field, problem) of every ConfigError / NotRunnable raised in the package, with the
    problem's f-string holes as {}."""

    def text(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        return None

    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("ConfigError", "NotRunnable"):
                if len(node.args) >= 2 and text(node.args[0]) and text(node.args[1]):
                    out.append((str(path.relative_to(root)), text(node.args[0]), text(node.args[1])))
    return out


def test_no_refusal_is_written_twice():
    found = refusals()
    assert len(found) > 100  # the walk sees the package's refusals
    twice = [key for key, n in Counter((field, problem) for _, field, problem in found).items() if n > 1]
    assert not twice, f"refusals written twice: {twice}"


def test_every_feature_module_is_registered_and_answers_the_four_questions():
    modules = {p.parent.name for p in (PACKAGE / "features").glob("*/__init__.py")}
    assert {f.__name__.rsplit(".", 1)[1] for f in features.FEATURES} == modules
    for feature in features.FEATURES:
        for name in ("refuse", "runnable", "untraceable"):
            assert callable(getattr(feature, name)), f"{feature.__name__} has no {name}()"


def test_each_features_plan_and_engine_sides_are_applied_in_their_one_place():
    """A feature's plan.py `adjust` is in the planner's ADJUSTMENTS and its engine.py `apply` in the
    engine's CONVERTERS, and those hold nothing else: a side written but never applied fails here."""
    import importlib

    from trainplan.plan import analytic
    from trainplan.run import build

    registries = {
        ("plan", "adjust"): [f.__module__ for f in analytic.ADJUSTMENTS],
        ("engine", "apply"): [
            f.__module__ for _, f in build.CONVERTERS if f.__module__.startswith("trainplan.features")
        ],
    }
    for (side, hook), registered in registries.items():
        sides = sorted(p.parent.name for p in (PACKAGE / "features").glob(f"*/{side}.py"))
        assert sides, side
        with_hook = {
            f"trainplan.features.{name}.{side}"
            for name in sides
            if hasattr(importlib.import_module(f"trainplan.features.{name}.{side}"), hook)
        }
        assert sorted(with_hook) == sorted(registered), (side, hook, registered)
        assert len(set(registered)) == len(registered)  # each applied once
