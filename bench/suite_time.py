"""The test suite's time, measured and written where the project states it (issue 47).

Run: .venv/bin/python bench/suite_time.py [--write]
         [--from-log test=LOG --from-log fast=LOG] [--wall test=SECONDS]
     .venv/bin/python bench/suite_time.py --quick   (one small test file, parsed the same way: that it runs)

Without --from-log it runs `make test-fast`, then `make test` (about 17 minutes on 2 cores), each timed
by wall clock with its output kept under /tmp. --from-log reads the output of runs made elsewhere (a
fresh clone's `CI=true bash .ci/run`, which calls `make test`), with --wall giving the wall time of a
run the script did not time. From each run it reads pytest's closing line (tests, seconds), the 15
slowest durations, the process launches and the tests' CPU-seconds (tests/conftest.py), and prints a Markdown block
with the machine's description (CPU model, cores, memory, load before the run). --write puts that block
into docs/benchmarks.md (between the suite-times markers) and the two times into README's Development
commands.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- suite-times:begin (bench/suite_time.py --write) -->", "<!-- suite-times:end -->"
TARGETS = {"test": "make test", "fast": "make test-fast"}
# --quick: one small test file through the same parsing, that the script runs (tests/test_benches_run.py)
QUICK = f"{sys.executable} -m pytest -q -p no:cacheprovider --durations 15 tests/test_suite_time.py"


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        "unknown CPU",
    )
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    mem = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    return f"{cpu} ({isa}), {os.cpu_count()} cores, {mem / 2**20:.0f} GiB"


def parse(log: str) -> dict:
    """pytest's closing line, the slowest durations and the launch totals of one run's output."""
    closing = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s", log, re.M)
    if not closing:
        raise ValueError("no pytest closing line ('N passed ... in S s') in the log: did the run finish?")
    counts, seconds = closing[-1]
    tally = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", counts)}
    slowest = re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S.*?)\s*$", log, re.M)  # an id may hold spaces
    # the totals line: launches by kind, then (since the CPU-seconds column) the suite's CPU-seconds
    launches = re.search(r"^\s*(\d+)\s+(\d+)\s+(\d+)(?:\s+(\d+))?\s+in all: (\d+) launches", log, re.M)
    counts = None
    if launches:
        torchrun, trainplan, other, cpu, total = launches.groups()
        counts = {"torchrun": int(torchrun), "trainplan": int(trainplan), "other": int(other), "all": int(total)}
        counts["cpu_s"] = int(cpu) if cpu is not None else None
    return {
        "tally": tally,
        "seconds": float(seconds),
        "slowest": [(float(s), phase, node) for s, phase, node in slowest][:15],
        "launches": counts,
    }


def run(target: str) -> tuple[str, float, float]:
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(TARGETS[target].split(), cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    Path(f"/tmp/suite-{target}.log").write_text(log)
    if proc.returncode:
        raise SystemExit(f"{TARGETS[target]} failed (exit {proc.returncode}); its output: /tmp/suite-{target}.log")
    return log, wall, load


def block(results: dict, where: str) -> str:
    lines = [BEGIN, "", f"Measured {time.strftime('%Y-%m-%d')} on {where}:", ""]
    lines += [
        "| command | tests (passed / skipped) | pytest time | wall | launches (torchrun / trainplan / other) "
        "| CPU-seconds of the tests |"
    ]
    lines += ["|---|---:|---:|---:|---|---:|"]
    for target, r in results.items():
        t, launches = r["tally"], r["launches"]
        shown = f"{launches['torchrun']} / {launches['trainplan']} / {launches['other']}" if launches else "not counted"
        cpu = f"{launches['cpu_s']:,}" if launches and launches.get("cpu_s") is not None else "not counted"
        wall = f"{r['wall']:,.0f} s" if r.get("wall") else "-"
        lines.append(
            f"| `{TARGETS[target]}` | {t.get('passed', 0):,} / {t.get('skipped', 0)} | {r['seconds']:,.0f} s "
            f"({r['seconds'] / 60:.1f} min) | {wall} | {shown} | {cpu} |"
        )
    if "test" in results:
        lines += ["", "The 15 slowest tests of `make test`:", ""]
        lines += [f"- {s:.0f} s {phase} `{node}`" for s, phase, node in results["test"]["slowest"]]
    lines += ["", "Reproduce: `.venv/bin/python bench/suite_time.py --write`.", "", END]
    return "\n".join(lines)


def write(text: str, results: dict) -> None:
    bench = ROOT / "docs" / "benchmarks.md"
    doc = bench.read_text()
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) :]
    else:
        anchor = "## The test suite's time (issue 31)\n"
        doc = doc.replace(anchor, anchor + "\n" + text + "\n\n", 1)
    bench.write_text(doc)
    readme = ROOT / "README.md"
    lines = readme.read_text()
    for target, label in (("test", "make test "), ("fast", "make test-fast")):
        if target in results:
            minutes = results[target]["seconds"] / 60
            pattern = rf"^({re.escape(label)}.*?), about [\d.]+ minutes"
            lines = re.sub(pattern, rf"\1, about {minutes:.0f} minutes", lines, count=1, flags=re.M)
    readme.write_text(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-log", action="append", default=[], metavar="TARGET=LOG", help="test=LOG or fast=LOG")
    ap.add_argument("--wall", action="append", default=[], metavar="TARGET=SECONDS", help="a logged run's wall time")
    ap.add_argument("--where", default=None, help="the machine's description (default: read from /proc)")
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md and README.md")
    ap.add_argument("--quick", action="store_true", help="one test file instead of the suites; nothing written")
    args = ap.parse_args(argv)
    if args.quick:
        if args.write or args.from_log:
            ap.error("--quick runs one test file: it writes nothing and reads no log")
        TARGETS["quick"] = QUICK
    results: dict[str, dict] = {}
    walls = dict(item.split("=", 1) for item in args.wall)
    loads = []
    for item in args.from_log:
        target, path = item.split("=", 1)
        if target not in TARGETS:
            ap.error(f"--from-log: {target!r} is not one of {', '.join(TARGETS)}")
        results[target] = {**parse(Path(path).read_text()), "wall": float(walls[target]) if target in walls else None}
    for target in ("quick",) if args.quick else ("fast", "test"):
        if target not in results and not args.from_log:
            log, wall, load = run(target)
            results[target] = {**parse(log), "wall": wall}
            loads.append(load)
    where = args.where or machine() + (f", load average {max(loads):.1f} before the runs" if loads else "")
    text = block(dict(sorted(results.items(), key=lambda kv: kv[0] != "test")), where)
    print(text)
    if args.write:
        write(text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
