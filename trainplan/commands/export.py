"""`trainplan export`: a run's model as others load it: merged, the PEFT adapter, or full weights."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainplan.commands._common import add_registry_arg, output_dir, quiet_libraries
from trainplan.features import qlora

HELP = "write a run's model for use elsewhere: a merged transformers directory (--merge) or the PEFT adapter"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        metavar="RUN_OR_CHECKPOINT",
        help="a run directory (its --output-dir), its result/, a checkpoints/step-N directory, or a registry run id",
    )
    p.add_argument(
        "-o", "--output", required=True, type=output_dir, metavar="DIR", help="the directory to write (atomically)"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="LoRA: merge the adapter into its base (peft merge_and_unload) and write a transformers directory",
    )
    p.add_argument(
        "--base", default=None, metavar="MODEL", help="LoRA: the base model (default: the run's model.source)"
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    add_registry_arg(p, "where a run id is looked up")


def source_path(given: str, registry_arg: str | None, field: str = "RUN_OR_CHECKPOINT") -> Path:
    """A path as given, or a registry run id's output directory."""
    path = Path(given)
    if path.exists() or not (given.isascii() and given.isdigit()):
        return path
    from trainplan.errors import ConfigError, TrainplanError
    from trainplan.verify import registry

    try:
        return Path(registry.get(int(given), registry.path(registry_arg))["output_dir"])
    except TrainplanError as e:
        raise ConfigError(
            field, f"no such directory, and no run {given} in the registry ({e})", "give a run directory or a run id"
        ) from None


def run(args: argparse.Namespace) -> int:
    from trainplan.files import require_writable
    from trainplan.run import export

    quiet_libraries()
    out = Path(args.output)
    export.refuse_existing(out, force=args.force)  # before any model loads
    require_writable(out, "-o")
    src = export.locate(source_path(args.source, args.registry), "RUN_OR_CHECKPOINT")
    export.refuse_onto_source(out, src)
    if args.base and not (args.merge and src.adapter and src.kind == "result"):
        from trainplan.errors import ConfigError

        raise ConfigError("--base", "applies only with --merge, to a LoRA run's result/", "leave --base out")
    done = export.export(src, out, merge=args.merge, base=args.base, force=args.force, field="RUN_OR_CHECKPOINT")
    what = {"transformers": "transformers model (AutoModelForCausalLM.from_pretrained)", "peft-adapter": "PEFT adapter"}
    note = " (a full run: already a complete model, nothing to merge)" if args.merge and not src.adapter else ""
    if args.merge and src.mode == qlora.MODE:
        note = " (merged into the 16-bit base; the run trained against its 4-bit quantization)"
    print(f"trainplan export: {what[done['format']]} from {src.kind} {src.path} -> {out}{note}")
    print(f"  files: {', '.join(done['files'])}")
    return 0
