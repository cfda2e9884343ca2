"""`trainplan runs`: the run registry that train and accept write."""

from __future__ import annotations

import argparse
import json

from trainplan.commands._common import add_registry_arg
from trainplan.errors import TrainplanError
from trainplan.text import is_terminal

HELP = "the run registry: list | show ID | compare A B"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "show", "compare"), help="list | show ID | compare A B")
    p.add_argument("ids", nargs="*", type=int, help="run ids (from `trainplan runs list`)")
    add_registry_arg(p, "read")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from trainplan.verify import registry

    db = registry.path(args.registry)
    want = {"list": 0, "show": 1, "compare": 2}[args.action]
    if len(args.ids) != want:
        raise TrainplanError(
            f"runs {args.action}: takes {want} run id(s), got {len(args.ids)}; `trainplan runs list` shows the ids"
        )
    terminal = is_terminal()
    if args.action == "list":
        items = registry.rows(db)
        print(json.dumps(items, indent=1) if args.json else registry.render_list(items, terminal=terminal))
    elif args.action == "show":
        item = registry.get(args.ids[0], db)
        print(json.dumps(item, indent=1) if args.json else registry.render_show(item, terminal=terminal))
    else:
        a, b = (registry.get(i, db) for i in args.ids)
        print(json.dumps([a, b], indent=1) if args.json else registry.render_compare(a, b, terminal=terminal))
    return 0
