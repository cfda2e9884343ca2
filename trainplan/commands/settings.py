"""`trainplan settings`: every config key, its default and type, and the flag that sets it."""

from __future__ import annotations

import argparse
import dataclasses
import json

from trainplan.commands._common import CONFIG_FLAGS, SWITCHES, emit

HELP = "every config key with its default, type and flag (what a TOML file or --set KEY=VALUE can set)"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="a JSON list of {key, default, type, flag}")
    p.add_argument("--output", "-o", help="write to this file (atomically) instead of stdout")


def rows() -> list[dict]:
    from trainplan import config as C

    flags = {key: flag for flag, key, _ in CONFIG_FLAGS} | {key: flag for flag, key, _ in SWITCHES}
    flags["lora.target_modules"] = "--lora-targets"
    out = []
    for name in C._TOP_KEYS:  # `mode = ...` at the top of a TOML file, or under [run]
        field = next(f for f in dataclasses.fields(C.RunConfig) if f.name == name)
        out.append({"key": name, "default": field.default, "type": str(field.type), "flag": flags.get(name)})
    defaults = C.RunConfig()
    for section, cls in C._SECTION_TYPES.items():
        values = getattr(defaults, section)
        for field in dataclasses.fields(cls):
            key = f"{section}.{field.name}"
            default = getattr(values, field.name)
            out.append({"key": key, "default": default, "type": str(field.type), "flag": flags.get(key)})
    return out


def run(args: argparse.Namespace) -> int:
    from trainplan.config import toml_literal

    table = rows()
    if args.json:
        text = json.dumps(table, indent=1)
    else:
        width = max(len(r["key"]) for r in table)
        lines = [f"{'key':{width}}  {'default':24}  {'type':16}  flag", "-" * (width + 50)]
        for r in table:
            default = toml_literal(r["default"]) if r["default"] is not None else "(none)"
            lines.append(f"{r['key']:{width}}  {default:24}  {r['type']:16}  {r['flag'] or ''}".rstrip())
        lines.append("")
        lines.append("Set any of them in a TOML file ([section] key = value) or with --set section.key=value.")
        text = "\n".join(lines)
    emit(args, text)
    return 0
