"""`trainplan generate`: try a model: a base, a base with an adapter, or a run's result, side by side."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from trainplan.commands._common import quiet_libraries, seed
from trainplan.errors import ConfigError
from trainplan.files import parse_nested, read_text, refuse_special

HELP = "complete prompts with a model, a model + LoRA adapter, or a run's result (--compare: base vs fine-tuned)"
MAX_NEW_TOKENS = 4096


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        metavar="MODEL",
        help='"default", an HF model directory or cached Hub id, a .gguf, or a run (its directory, result/ or a '
        "checkpoints/step-N)",
    )
    p.add_argument("--adapter", default=None, metavar="DIR", help="a PEFT adapter (a LoRA run's result/) on MODEL")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", default=None, metavar="TEXT", help="one prompt")
    given.add_argument(
        "--prompts", default=None, metavar="FILE", help='prompts: one a line, or .jsonl lines of {"prompt": ...}'
    )
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy, deterministic; > 0: sampled"
    )
    p.add_argument("--seed", type=seed, default=0, help="the sampling seed (temperature > 0), 0 to 2^53")
    p.add_argument(
        "--compare", action="store_true", help="the base model and the fine-tuned one, one after the other, labelled"
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="feed the prompt as plain text even where the tokenizer has a chat template",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON document (token ids included) instead of streamed text"
    )


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise ConfigError("--prompt", "is empty", "give the text to complete")
        return [args.prompt]
    path = Path(args.prompts)
    refuse_special(path, "--prompts", 'give a text file, one prompt a line, or .jsonl of {"prompt": ...}')
    if path.is_dir():
        raise ConfigError("--prompts", f"{args.prompts!r} is a directory", "give a text file, one prompt a line")
    if not path.is_file():
        raise ConfigError(
            "--prompts",
            f"no such file {args.prompts!r}",
            'give a text file, one prompt a line, or .jsonl of {"prompt": ...}',
        )
    lines = [ln for ln in read_text(path, "--prompts").splitlines() if ln.strip()]
    if path.suffix != ".jsonl":
        prompts = lines
    else:
        prompts = []
        for n, line in enumerate(lines, 1):
            try:
                row = parse_nested(json.loads, line, "--prompts", f"{path.name} line {n}")
            except json.JSONDecodeError as e:
                raise ConfigError(
                    "--prompts", f"{path.name} line {n}: invalid JSON ({e.msg})", "one object a line"
                ) from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ConfigError(
                    "--prompts", f'{path.name} line {n} has no "prompt" string', 'write {"prompt": "..."}'
                )
            prompts.append(row["prompt"])
    if not prompts:
        raise ConfigError("--prompts", f"{args.prompts!r} holds no prompt", "write one prompt a line")
    return prompts


def check_numbers(args: argparse.Namespace) -> None:
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise ConfigError("--max-new-tokens", f"must be 1..{MAX_NEW_TOKENS} (got {args.max_new_tokens})", "e.g. 64")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError("--temperature", f"must be >= 0 (got {args.temperature})", "0 for greedy, e.g. 0.7 to sample")


def is_run(path: Path) -> bool:
    """A run's model (its directory, result/ or a checkpoint), as opposed to a base model source."""
    if not path.is_dir():
        return False
    own = ("result", "manifest.json", "adapter_config.json")
    return any((path / name).exists() for name in own) or (path.parent / "record.json").is_file()


class Models:
    """The model to sample, and how to sample its base for --compare."""

    def __init__(self, args: argparse.Namespace, device) -> None:
        from trainplan.run import export, generate

        self.base_model = None
        path = Path(args.model)
        if is_run(path):
            if args.adapter:
                raise ConfigError(
                    "--adapter",
                    f"MODEL {args.model!r} is a run's model already",
                    "give its base as MODEL, or leave --adapter out",
                )
            self.src = export.locate(path, "MODEL")
            if self.src.adapter and self.src.config is None:
                raise ConfigError(
                    "MODEL",
                    f"{args.model!r} is an adapter without the run record that names its base model",
                    "give the base model as MODEL and this directory as --adapter",
                )
            self.model, self.tokenizer = export.load_trained(self.src, device, field="MODEL")
            self.label = f"fine-tuned ({self.src.kind} {self.src.path})"
        else:
            self.src = None
            loaded = generate.load(args.model, device, field="MODEL")
            self.model, self.tokenizer = loaded.model, loaded.tokenizer
            if args.adapter:
                self.model = generate.attach_adapter(self.model, Path(args.adapter), field="--adapter")
            self.label = f"fine-tuned ({args.model} + {args.adapter})" if args.adapter else args.model
        self.peft = hasattr(self.model, "disable_adapter")
        if args.compare and not self.peft:
            base = self.src.base_source if self.src is not None else None
            if base is None:
                raise ConfigError(
                    "--compare",
                    "needs a base and a fine-tuned model",
                    "give --adapter DIR, or a run (its directory or result/) as MODEL",
                )
            self.base_model = generate.load(
                base, device, field="--compare (the run's base model)", tokenizer=False
            ).model

    def complete(self, which: str, ids: list[int], args: argparse.Namespace, streamer) -> list[int]:
        """New tokens from the fine-tuned model, or from the base (the adapter switched off, or
        the run's base model)."""
        import contextlib

        from trainplan.run import generate

        model, context = self.model, contextlib.nullcontext()
        if which == "base":
            if self.base_model is not None:
                model = self.base_model
            else:
                context = self.model.disable_adapter()
        with context:
            return generate.complete(
                model,
                self.tokenizer,
                ids,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                seed=args.seed,
                streamer=streamer,
            )


def run(args: argparse.Namespace) -> int:
    from trainplan.run import generate

    quiet_libraries()
    check_numbers(args)
    prompts = read_prompts(args)
    if args.adapter and not Path(args.adapter).is_dir():
        raise ConfigError("--adapter", f"no such directory {args.adapter!r}", "give a LoRA run's result/ directory")
    models = Models(args, generate.device_default())
    tok = models.tokenizer
    results = []
    for i, prompt in enumerate(prompts, 1):
        ids = generate.prompt_ids(tok, prompt, chat_template=not args.no_chat_template)
        if not args.json and len(prompts) > 1:
            print(f"### prompt {i}: {prompt}")
        entry = {"prompt": prompt, "prompt_tokens": len(ids)}
        for which in ("base", "fine_tuned") if args.compare else ("fine_tuned",):
            if args.compare and not args.json:
                print(f"--- {'base' if which == 'base' else models.label}:")
            new = models.complete(which, ids, args, None if args.json else _streamer(tok))
            entry[which if args.compare else "completion"] = {"text": generate.decode(tok, new), "tokens": new}
        results.append(entry)
    if args.json:
        doc = {
            "schema": "trainplan.generate/1",
            "model": args.model,
            "adapter": args.adapter,
            "chat_template": not args.no_chat_template and bool(getattr(tok, "chat_template", None)),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "results": results,
        }
        print(json.dumps(doc, indent=1))
    sys.stdout.flush()
    return 0


def _streamer(tokenizer):
    from transformers import TextStreamer

    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
