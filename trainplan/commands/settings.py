"""`trainplan settings` (and `trainplan config --show [CONFIG]`): every config key with its value,
default, type, one-line meaning and the flag that sets it. The meanings are config/schema.py's own
comments on each field, so they cannot drift from the code."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import textwrap

from trainplan.commands._common import CONFIG_FLAGS, SWITCHES, emit, output_file

HELP = "every config key with its value, default, type, meaning and flag (`config --show CONFIG`: a file's values)"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="a TOML config: show its values beside the defaults")
    p.add_argument("--show", action="store_true", help="show the settings (what `trainplan config` does)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting, as train does")
    p.add_argument("--json", action="store_true", help="a JSON list of {key, value, default, type, meaning, flag}")
    p.add_argument("--output", "-o", type=output_file, help="write to this file (atomically) instead of stdout")


def meanings() -> dict[str, str]:
    """`section.key` -> the comment on its field in config/schema.py (the trailing one, else the comment
    lines just above it)."""
    from trainplan import config as C

    source = open(C.schema.__file__, encoding="utf-8").read()
    lines = source.splitlines()
    classes = {cls.__name__: section for section, cls in C._SECTION_TYPES.items()} | {"RunConfig": ""}
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or node.name not in classes:
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            line = lines[item.lineno - 1]
            text = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            if not text:
                above, i = [], item.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                text = " ".join(above)
            prefix = classes[node.name]
            out[f"{prefix}.{item.target.id}" if prefix else item.target.id] = text
    return out


def rows(cfg=None) -> list[dict]:
    """Every key; `value` is cfg's (a loaded config), or the default."""
    from trainplan import config as C

    flags = {key: flag for flag, key, _ in CONFIG_FLAGS} | {key: flag for flag, key, _ in SWITCHES}
    flags["lora.target_modules"] = "--lora-targets"
    meaning = meanings()
    defaults = C.RunConfig()
    cfg = cfg or defaults
    out = []
    for name in C._TOP_KEYS:  # `mode = ...` at the top of a TOML file, or under [run]
        field = next(f for f in dataclasses.fields(C.RunConfig) if f.name == name)
        out.append(_row(name, getattr(cfg, name), field.default, field.type, meaning, flags))
    for section, cls in C._SECTION_TYPES.items():
        for field in dataclasses.fields(cls):
            key = f"{section}.{field.name}"
            default = getattr(getattr(defaults, section), field.name)
            out.append(_row(key, getattr(getattr(cfg, section), field.name), default, field.type, meaning, flags))
    return out


def _row(key: str, value, default, type_, meaning: dict, flags: dict) -> dict:
    return {
        "key": key,
        "value": value,
        "default": default,
        "type": str(type_),
        "meaning": meaning.get(key, ""),
        "flag": flags.get(key),
    }


def run(args: argparse.Namespace) -> int:
    from trainplan import config as C
    from trainplan.config import toml_literal

    cfg = C.load(args.config, args.set) if (args.config or args.set) else None
    table = rows(cfg)
    if args.json:
        emit(args, json.dumps(table, indent=1))
        return 0

    def lit(v) -> str:
        return toml_literal(v) if v is not None else "(none)"

    lines = []
    for r in table:  # two lines a key, within 100 columns
        changed = "" if r["value"] == r["default"] else f", default {lit(r['default'])}"
        flag = f", {r['flag']}" if r["flag"] else ""
        lines.append(f"{r['key']} = {lit(r['value'])}  ({r['type']}{changed}{flag})")
        lines += textwrap.wrap(r["meaning"], 100, initial_indent="    ", subsequent_indent="    ")
    lines.append("")
    lines.append("Set any of them in a TOML file ([section] key = value) or with --set section.key=value.")
    emit(args, "\n".join(lines))
    return 0
