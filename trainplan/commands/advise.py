"""`trainplan advise`: search the memory ladder for configurations that fit every device, ranked."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from trainplan import config as C
from trainplan.advise import maximize
from trainplan.advise.estimate import calibration_from_records, records_from_registry
from trainplan.advise.rank import (
    SCHEMA,
    devices_text,
    entry_json,
    estimate_note,
    launch_command,
    mfu_text,
    out_toml,
    ranked,
    render_text,
    rung_blocker,
    train_blocker,
    weights_note,
)
from trainplan.advise.search import TRAIN_MODES, Request, layouts, search, what_would_fit
from trainplan.commands._common import add_registry_arg, output_file, write_output
from trainplan.errors import ConfigError, nearest
from trainplan.resolve import resolve
from trainplan.spec.model import load_model_spec
from trainplan.text import is_terminal

HELP = "search the memory ladder for configurations that fit every device, ranked, with estimated step time"
MODE_CHOICES = ("auto", *C.MODES)
PREFERENCES = ("ladder", "speed", "memory", "quality")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="preset name, HF model dir, config.json or .gguf")
    p.add_argument("--gpus", default="auto", help="devices, e.g. 8xH100-80GB, 1x24GiB, cpu (default: this machine's)")
    p.add_argument("--gpu-mem", default=None, help="override every GPU's capacity, e.g. 24GiB")
    p.add_argument("--seq", type=int, default=None, help="sequence length in tokens (default 512)")
    p.add_argument(
        "--maximize",
        default=None,
        help="seq | micro-batch: per rung, the longest sequence (largest micro-batch) that fits, longest first",
    )
    p.add_argument(
        "--global-batch", type=int, default=None, help="sequences per optimizer step (default: one per device)"
    )
    p.add_argument(
        "--mode", default="auto", help="auto (full, then LoRA, then QLoRA) | full | lora | qlora | inference"
    )
    p.add_argument("--prefer", default="ladder", help="ranking: ladder (default) | speed | memory | quality")
    p.add_argument(
        "--margin",
        type=float,
        default=0.0,
        help="fraction of each device's capacity kept free on top of the verdict's own margin, as "
        "hardware.safety_margin (0: a row fits where `trainplan plan` says FITS)",
    )
    p.add_argument("--top", type=int, default=10, help="entries to show (0: all that fit)")
    for flag in ("--micro-batch", "--grad-accum"):  # plan's flags: advise searches them, so refused with the fix
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--include-unrunnable",
        action="store_true",
        help="rank the plan-only rows (layouts `trainplan train` does not run) with the others by the "
        "preference alone; by default they come after every row train runs",
    )
    p.add_argument("--format", default="table", help="table | json")
    p.add_argument("--out", default=None, type=output_file, help="write the chosen configuration as TOML (atomically)")
    p.add_argument("--data", default=None, help="training data for --out: .txt/.jsonl file or directory (data.source)")
    length = p.add_mutually_exclusive_group()
    p.add_argument(
        "--price",
        type=float,
        default=None,
        help="what one device costs an hour (hardware.price_per_gpu_hour): with --tokens or --epochs, a cost "
        "column, the estimated run time x devices x this",
    )
    length.add_argument("--tokens", type=int, default=None, help="train on this many tokens: sets train.steps")
    length.add_argument(
        "--epochs", type=float, default=None, help="passes over the training split: sets train.steps (needs weights)"
    )
    add_registry_arg(p, "whose measured runs calibrate the step-time estimate")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other config field, kept in --out"
    )


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(flag, f"unknown value {value!r}", nearest(value, choices))


MAX_TOKENS = 10**15  # Llama 3's pretraining read 15.6 trillion; a fine-tune reads millions to billions


def request_from_args(args: argparse.Namespace) -> Request:
    for flag in ("--micro-batch", "--grad-accum"):
        if getattr(args, flag.lstrip("-").replace("-", "_"), None) is not None:
            raise ConfigError(
                flag,
                "advise searches the micro-batch and accumulation that fit",
                "give the total with --global-batch N (`trainplan plan --micro-batch` plans one you choose)",
            )
    _choice("--mode", args.mode, MODE_CHOICES)
    _choice("--prefer", args.prefer, PREFERENCES)
    _choice("--format", args.format, ("table", "json"))
    if not 0 <= args.margin < 0.9:
        raise ConfigError("--margin", f"must be in [0, 0.9) (got {args.margin})", "e.g. --margin 0.05 keeps 5% free")
    if args.top < 0:
        raise ConfigError("--top", f"must be >= 0 (got {args.top})", "give a count, or 0 for every entry")
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model  # --out runs anywhere
    settings = {
        "model.source": model,
        "hardware.gpus": args.gpus,
        "batch.seq_len": 512 if args.seq is None else args.seq,
        "hardware.safety_margin": args.margin,
    }
    if args.gpu_mem:
        settings["hardware.gpu_mem"] = args.gpu_mem
    if args.price is not None:
        settings["hardware.price_per_gpu_hour"] = args.price
    if args.data is not None:
        from trainplan.files import refuse_special

        refuse_special(args.data, "--data", "give a .txt/.jsonl file or a directory")
        if not Path(args.data).exists():
            raise ConfigError("--data", f"{args.data!r} does not exist", "give a .txt/.jsonl file or a directory")
        settings["data.source"] = str(Path(args.data).resolve())
    base = C.load(None, args.set, settings)
    if args.data is not None:  # train's own row checks, before a config naming the data is written
        from trainplan.run import sources

        unchecked = sources.check(args.data, base.data.format, "--data")
        if unchecked:
            print(f"trainplan advise: note: {unchecked}", file=sys.stderr)
    spec = load_model_spec(base.model.source)
    if spec.derived:  # bad input, not a search that finds nothing: refused before any candidate
        from trainplan.spec.layout import causal_lm_type

        causal_lm_type(spec.model_type)
    r = resolve(replace(base, mode="full", batch=C.BatchConfig(seq_len=base.batch.seq_len)), spec)  # refuses bad input
    world = len(r.devices)
    g = world if args.global_batch is None else args.global_batch
    if isinstance(g, bool) or g < 1:
        raise ConfigError("--global-batch", f"must be an integer >= 1 (got {g})", f"e.g. --global-batch {world}")
    steps, args.widest_row = training_steps(args, base, spec, g)
    if steps is not None:
        base = replace(base, train=replace(base.train, steps=steps))
    if args.widest_row is not None:  # planned at the data's longest row, the rows still cut where train cuts them
        cut = base.data.max_length or base.batch.seq_len
        base = replace(base.at_seq_len(args.widest_row), data=replace(base.data, max_length=cut))
    modes = TRAIN_MODES if args.mode == "auto" else (args.mode,)
    if args.registry is None:  # the run registry that train and accept write, when there is one
        from trainplan.verify import registry

        default = registry.path()
        args.registry = str(default) if default.is_file() else None
    elif args.registry == "off":
        args.registry = None
    calibration = {}
    if args.registry:  # only the runs measured on the requested devices calibrate their estimate
        names = {"cpu" if d.kind == "cpu" else d.name for d in r.devices}
        calibration = calibration_from_records(records_from_registry(args.registry, names))
    req = Request(base=base, spec=spec, modes=modes, global_batch=g, calibration=calibration)
    if not layouts(spec, r.devices, g)[0]:
        raise ConfigError(
            "--global-batch",
            f"{g} is not divisible by the data-parallel degree of any layout of {spec.name} on {world} devices",
            f"use a multiple of {world}",
        )
    return req


def run_cost(entry: dict, steps: int | None, devices: int, price: float) -> dict | None:
    """The run's length from --tokens / --epochs: steps x the entry's estimated step time, the device hours,
    and with a price the cost; None without a run length or a step-time estimate."""
    est = entry["estimate"]
    if steps is None or est is None or not est.get("step_seconds"):
        return None
    seconds = steps * est["step_seconds"]
    hours = seconds / 3600 * devices
    return {"steps": steps, "seconds": seconds, "device_hours": hours, "cost": hours * price if price else None}


def training_steps(
    args: argparse.Namespace, base: C.RunConfig, spec, global_batch: int
) -> tuple[int | None, int | None]:
    """(train.steps, the longest row) from --tokens (tokens per step = global batch x seq) or --epochs (the
    training split packed with the model's own tokenizer, as `trainplan train` packs it). The longest row
    only for one document a row under --epochs: an epoch's widest micro-batch holds it."""
    import math

    per_step = global_batch * base.batch.seq_len
    flag = "--tokens" if args.tokens is not None else "--epochs" if args.epochs is not None else None
    if flag and any(item.split("=", 1)[0].strip() == "train.steps" for item in args.set):
        raise ConfigError(flag, "train.steps is set too (--set)", f"give {flag} or --set train.steps, not both")
    if args.tokens is not None:
        if isinstance(args.tokens, bool) or args.tokens < 1:
            raise ConfigError("--tokens", f"must be >= 1 (got {args.tokens})", "e.g. --tokens 100000000")
        if args.tokens > MAX_TOKENS:
            raise ConfigError(
                "--tokens",
                f"{args.tokens:,} is past any training run (at most {MAX_TOKENS:.0e}, 64 times Llama 3's pretraining)",
                "give the tokens of this fine-tune, e.g. --tokens 100000000",
            )
        return math.ceil(args.tokens / per_step), None
    if args.epochs is None:
        return None, None
    if not math.isfinite(args.epochs) or args.epochs <= 0:
        raise ConfigError("--epochs", f"must be a number > 0 (got {args.epochs})", "e.g. --epochs 3")
    from trainplan.run import data, weights

    try:
        pretrained = weights.is_pretrained(base)
    except ConfigError:  # a preset: an architecture without weights
        pretrained = False
    if not pretrained:  # nor a tokenizer to count the data's tokens with
        raise ConfigError(
            "--epochs", "counting the data's tokens needs the model's own tokenizer", "give --tokens N instead"
        )
    cache = data.cache_dir(base.model.cache_dir)
    train_docs, _ = data.load(base.data, cache=cache)
    tokenizer = weights.load_tokenizer(base, spec)
    packing = data.packing_of(train_docs, base.data.packing)
    longest = base.data.max_length or base.batch.seq_len
    packed = data.pack(train_docs, tokenizer, longest, spec.vocab_size, packing=packing, cache=cache)
    widest = int(packed.lengths.max()) if packed.lengths is not None else None
    steps = data.steps_for_epochs(args.epochs, packed.ids.shape[0], global_batch)
    if steps * per_step > MAX_TOKENS:
        raise ConfigError(
            "--epochs",
            f"{args.epochs:g} passes over this data is {steps * per_step:.1e} tokens, past any training run "
            f"(at most {MAX_TOKENS:.0e})",
            "give the passes of this fine-tune, e.g. --epochs 3",
        )
    return steps, widest


# ---- ranking ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.maximize is not None:
        return run_maximize(args)
    req = request_from_args(args)
    s = search(req)
    order = ranked(s, args.prefer, include_unrunnable=args.include_unrunnable)
    top = order if args.top == 0 else order[: args.top]
    entries = [entry_json(s, o, i + 1, args.prefer) for i, o in enumerate(top)]
    steps = req.base.train.steps if args.tokens is not None or args.epochs is not None else None
    for e in entries if steps is not None else ():  # the run's length known: its time (and cost)
        e["run"] = run_cost(e, steps, len(s.devices), req.base.hardware.price_per_gpu_hour)
    doc = {
        "schema": SCHEMA,
        "model": req.spec.summary(),
        "devices": devices_text(s),
        "request": {
            "mode": args.mode,
            "prefer": args.prefer,
            "seq_len": req.base.batch.seq_len,
            "global_batch_size": req.global_batch,
            "margin": args.margin,
        },
        "rungs": len(s.outcomes),
        "fit": len(order),
        "evaluated": s.evaluated,
        "seconds": s.seconds,
        "entries": entries,
        "estimate_note": mfu_text(s, args.registry),
        "skipped_layouts": s.skipped_layouts,
        "nothing_fits": None,
        "out": None,
    }
    notes = []
    if not order:
        reason, options, spent = what_would_fit(s)
        doc["nothing_fits"] = {"reason": reason, "needs": options, "evaluated": spent}
        if args.out:
            notes.append(f"nothing fits: {args.out} not written")
    elif args.out:  # row 1 of what is shown
        write_output(args.out, out_toml(s, order[0], 1, len(order), args.prefer, args.out), "--out")
        doc["out"] = {"path": str(Path(args.out)), "row": 1, "of": len(order)}
        blocker = train_blocker(s, order[0])
        if blocker:
            notes.append(f"wrote row 1, which `trainplan train` does not run yet: {blocker}")
    if args.widest_row is not None:
        notes.append(
            f'one document a row (data.packing = "none"): planned at the data\'s longest row, {args.widest_row} '
            "tokens, the width of the widest micro-batch of any epoch (`trainplan plan --data` names its step)"
        )
    doc["notes"] = notes
    if args.format == "json":
        print(json.dumps(doc, indent=1))
    else:
        print(render_text(s, doc, args, terminal=is_terminal()))
    return 0 if order else 1


# ---- --maximize ------------------------------------------------------------------------------


def run_maximize(args: argparse.Namespace) -> int:
    """Per rung, the longest sequence (or the largest micro-batch) that fits every device."""
    _choice("--maximize", args.maximize, maximize.AXES)
    what = "sequence length" if args.maximize == "seq" else "micro-batch"
    if args.maximize == "seq" and args.seq is not None:
        raise ConfigError("--seq", "--maximize seq searches the sequence length", "drop --seq")
    if args.prefer != "ladder":
        raise ConfigError("--prefer", f"--maximize ranks by the largest {what} that fits", "drop --prefer")
    for flag, value in (("--tokens", args.tokens), ("--epochs", args.epochs)):
        if value is not None:
            raise ConfigError(
                flag, f"the run's length depends on the {what} the search finds", "set it with --set train.steps=N"
            )
    if args.maximize == "seq":
        args.seq = maximize.SEQ_STEP  # the request is checked at the smallest candidate
    req = request_from_args(args)
    micro = req.base.batch.micro_batch_size
    if args.maximize == "micro-batch" and micro is not None:
        raise ConfigError("batch.micro_batch_size", "--maximize micro-batch searches it", "drop that --set")
    micro = micro or 1
    if args.global_batch is None:  # one micro-batch per device, as the plain search's default
        req.global_batch *= micro
    m = maximize.maximize(req, args.maximize, micro_batch=micro, fixed_global_batch=args.global_batch is not None)
    blockers = {id(x): rung_blocker(x.config, x.rung, req.spec, m.devices) for x in m.ranked}
    if not args.include_unrunnable:  # the rows train runs first, each group in its order
        m.ranked.sort(key=lambda x: bool(blockers[id(x)]))
    top = m.ranked if args.top == 0 else m.ranked[: args.top]
    doc = {
        "schema": maximize.SCHEMA,
        "model": req.spec.summary(),
        "devices": devices_text(m),
        "request": {
            "maximize": args.maximize,
            "mode": args.mode,
            "seq_len": None if args.maximize == "seq" else req.base.batch.seq_len,
            "micro_batch_size": micro if args.maximize == "seq" else None,
            "global_batch_size": m.global_batch,
            "margin": args.margin,
        },
        "cap": {"value": m.cap, "reason": m.cap_reason},
        "rungs": len(m.results),
        "fit": len(m.ranked),
        "evaluated": m.evaluated,
        "seconds": m.seconds,
        "entries": [maximize.entry_json(m, x, i + 1) for i, x in enumerate(top)],
        "estimate_note": estimate_note(m.ranked[0].estimate if m.ranked else None, args.registry),
        "nothing_fits": None if m.ranked else maximize.nothing_fits(m),
        "out": None,
    }
    notes = []
    if m.ranked and args.out:  # row 1 of what is shown
        launch = launch_command(len(m.devices), args.out)
        x = m.ranked[0]
        write_output(args.out, maximize.out_toml(m, x, 1, len(m.ranked), launch, weights_note(x.config)), "--out")
        doc["out"] = {"path": str(Path(args.out)), "row": 1, "of": len(m.ranked), "run": launch}
        if blockers[id(x)]:
            notes.append(f"wrote row 1, which `trainplan train` does not run yet: {blockers[id(x)]}")
    elif args.out:
        notes.append(f"nothing fits: {args.out} not written")
    doc["notes"] = notes
    if args.format == "json":
        print(json.dumps(doc, indent=1))
    else:
        print(maximize.render_text(m, doc, terminal=is_terminal()))
    return 0 if m.ranked else 1
