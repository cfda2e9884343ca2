"""The advisor's ranked lists, byte for byte: the speed work on the search (issue 22) must not
change a single entry. The cases are bench/advise_speed.py's. Regenerate on purpose only:

    TRAINPLAN_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/test_advise_snapshots.py
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from trainplan import cli

SNAPSHOTS = Path(__file__).parent / "advise_snapshots.json"


def advise(argv: list[str]) -> dict:
    """The sha256 of the JSON document of every entry that fits (without the search's wall time),
    and one line per entry, so that a difference shows where it is."""
    out = io.StringIO()
    with redirect_stdout(out):
        cli.main([*argv, "--format", "json", "--top", "0", "--registry", "off"])
    doc = json.loads(out.getvalue())
    doc.pop("seconds")
    text = json.dumps(doc, indent=1, sort_keys=True)
    ranked = [
        f"{e['rank']} {e['summary']} | micro {e['micro_batch_size']} | peak {e['peak']['total_bytes']} on "
        f"{e['peak']['device']} | step {e['estimate'] and e['estimate']['step_seconds']!r}"
        for e in doc["entries"]
    ]
    counts = {k: doc[k] for k in ("rungs", "fit", "evaluated")}
    counts["planned"] = doc["evaluated"] + (doc["nothing_fits"]["evaluated"] if doc["nothing_fits"] else 0)
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "counts": counts, "ranked": ranked}


@pytest.fixture(scope="module")
def searched(bench_script) -> dict[str, dict]:
    return {" ".join(argv): advise(argv) for argv in bench_script("advise_speed").argvs()}


def test_ranked_lists_are_byte_identical_to_the_snapshots(searched):
    got = searched
    if os.environ.get("TRAINPLAN_UPDATE_SNAPSHOTS"):
        SNAPSHOTS.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(SNAPSHOTS.read_text())
    assert sorted(got) == sorted(want)
    for case, doc in got.items():
        assert doc["counts"] == want[case]["counts"], case
        assert doc["ranked"] == want[case]["ranked"], case  # shows the first entry that differs
        assert doc["sha256"] == want[case]["sha256"], case  # every field of every entry, byte for byte


def test_the_docs_speed_table_quotes_todays_counts(searched, bench_script):
    """docs/advise.md's table (written by bench/advise_speed.py --write-doc): one row per bench case,
    and its rungs, candidates planned and fit are what the search produces now."""
    bench = bench_script("advise_speed")
    text = bench.DOC.read_text()
    table = text[text.index(bench.BEGIN) : text.index(bench.END)]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 4 and cells[1].isdigit():
            rows[cells[0]] = [int(c.replace(",", "")) for c in cells[1:4]]
    assert sorted(rows) == sorted(bench.label(c) for c in bench.CASES)
    for case in bench.CASES:
        counts = searched[" ".join(bench.argv(case))]["counts"]
        assert rows[bench.label(case)] == [counts["rungs"], counts["planned"], counts["fit"]], bench.label(case)
