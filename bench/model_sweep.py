"""Every causal-LM architecture of the pinned transformers through `trainplan plan` (issue 69): each model_type at
its config class's defaults (transformers' own flagship sizes), LoRA on one H100 and full ZeRO-3 on eight, in
process. Each answer is one of: planned (exit 0 FITS/TIGHT or 1 DOES NOT FIT), refused in one line naming the part
(exit 2), or an internal error (exit 4, which must not happen). Prints the counts and a Markdown table.

Run: .venv/bin/python bench/model_sweep.py [--write docs/model-sweep.md] [--only gpt_oss,deepseek_v3]
     .venv/bin/python bench/model_sweep.py --quick   (four families: that it runs; tests/test_benches_run.py)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

QUICK = ("llama", "gpt_oss", "deepseek_v3", "bamba")
LAYOUTS = (("lora", ["--gpus", "1xH100-80GB"]), ("full", ["--gpus", "8xH100-80GB", "--strategy", "zero3"]))
PER_CASE_S = 300


def sweep(types: list[str], tmp: Path) -> list[dict]:
    import transformers

    from trainplan import cli

    def expired(signum, frame):
        raise TimeoutError

    signal.signal(signal.SIGALRM, expired)
    rows = []
    for t in types:
        try:
            config = transformers.CONFIG_MAPPING[t]().to_dict()
        except Exception as e:  # transformers' own defaults do not validate: nothing to plan
            rows.append({"type": t, "mode": "-", "code": "config", "s": 0.0, "line": f"{type(e).__name__}"})
            continue
        path = tmp / f"{t}.json"
        path.write_text(json.dumps({**config, "model_type": t}))
        for mode, flags in LAYOUTS:
            err = io.StringIO()
            t0 = time.perf_counter()
            signal.alarm(PER_CASE_S)
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    code = cli.main(["plan", "--model", str(path), "--mode", mode, *flags, "--json"])
            except TimeoutError:
                code = "timeout"
            finally:
                signal.alarm(0)
            line = (err.getvalue().strip().splitlines() or [""])[-1].replace(f"{tmp}/", "")  # the file's name
            rows.append({"type": t, "mode": mode, "code": code, "s": time.perf_counter() - t0, "line": line})
            print(f"{t:28s} {mode:4s} {code!s:7s} {rows[-1]['s']:6.1f} s  {line[:150]}", flush=True)
    return rows


def kind(row: dict) -> str:
    return {0: "planned", 1: "planned", 2: "refused", 4: "internal error"}.get(row["code"], str(row["code"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated model_types")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--write", type=Path, default=None, help="write the table here (Markdown)")
    args = ap.parse_args()
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.quick or args.only:
        types = [t for t in types if t in (QUICK if args.quick else args.only.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        rows = sweep(types, Path(tmp))
    counts = collections.Counter(kind(r) for r in rows if r["mode"] != "-")
    summary = (
        f"{len(types)} model_types of transformers {transformers.__version__}, {len(rows)} plans: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + f"; {sum(r['mode'] == '-' for r in rows)} whose default config transformers itself refuses"
    )
    print(summary)
    if args.write:
        lines = [
            "# Every causal LM of the pinned transformers, planned (issue 69)",
            "",
            f"`.venv/bin/python bench/model_sweep.py --write {args.write}` ({time.strftime('%Y-%m-%d')}): each "
            "model_type at its config class's defaults, `trainplan plan` for LoRA on 1 x H100-80GB and full "
            "fine-tuning under ZeRO-3 on 8 x H100-80GB. Planned: exit 0 or 1 (DOES NOT FIT is an answer); "
            "refused: exit 2, one line naming the part; internal error: exit 4.",
            "",
            f"**{summary}.**",
            "",
            "| model_type | mode | answer | seconds | the line (refusals) |",
            "|---|---|---|---:|---|",
        ]
        for r in rows:
            line = r["line"].split(": error: ", 1)[-1].replace("|", "/")[:200] if kind(r) != "planned" else ""
            lines.append(f"| {r['type']} | {r['mode']} | {kind(r)} | {r['s']:.1f} | {line} |")
        args.write.write_text("\n".join(lines) + "\n")
    return 1 if counts.get("internal error") else 0


if __name__ == "__main__":
    sys.exit(main())
