"""Files from outside (issue 49): the run registry, a run's record.json, the error lines that echo
them, and a seeded fuzz over every reader (config TOML, config.json, data, GGUF, prompts, records,
the registry, checkpoints, output paths). Each bad file is exit 2, one line naming the field or file,
and nothing is written: reading never migrates, never creates."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest

from tests import hostile_gen
from tests.test_bad_input import _check
from trainplan import cli, text
from trainplan.verify import registry


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refused(argv, pattern, capsys) -> str:
    import re

    code = cli.main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert out == ""
    assert re.search(pattern, lines[0].split(": error: ", 1)[-1]), (pattern, lines[0])
    return lines[0]


def _registry_rows(db, create_sql, rows=()):
    with sqlite3.connect(db) as con:
        con.execute(create_sql)
        for row in rows:
            con.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(row))})", row)
    con.close()
    return db


CORE_TABLE = (
    "CREATE TABLE runs (id INTEGER PRIMARY KEY, kind TEXT, started TEXT, config_hash TEXT, model TEXT, mode TEXT)"
)
FULL_TABLE = (
    "CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    + ", ".join(f"{n} {k}" for n, k in registry.COLUMNS)
    + ")"
)


def _full_row(**values):
    row = {n: None for n, _ in registry.COLUMNS}
    row |= {"kind": "train", "started": "2026-12-01T00:00:00Z", "config_hash": "abc", "model": "m", "mode": "lora"}
    return [1, *(row | values).values()]


def test_another_programs_database_is_named_and_left_as_it_was(tmp_path, capsys):
    """`runs list --registry app.db` on another application's SQLite file once created a runs table in it."""
    db = tmp_path / "app.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE users (name TEXT)")
        con.execute("INSERT INTO users VALUES ('ada')")
    con.close()
    before = _sha(db)
    for argv in (["runs", "list"], ["runs", "show", "1"], ["runs", "compare", "1", "2"]):
        _refused(
            [*argv, "--registry", str(db)],
            r"^--registry: .*app\.db is another program's database \(no runs table; it has users\)",
            capsys,
        )
    assert _sha(db) == before


@pytest.mark.parametrize(
    ("table", "rows", "pattern"),
    [
        (
            "CREATE TABLE runs (name TEXT, size INTEGER)",
            [],
            r"has a runs table of another schema \(no id, kind, started",
        ),
        (FULL_TABLE, [_full_row(wall_seconds="fast")], r"run 1: wall_seconds holds 'fast', not real"),
        (FULL_TABLE, [_full_row(peaks_json="[" * 5000)], r"run 1: peaks_json holds '\[\[\[.*…, not text"),
        (FULL_TABLE, [_full_row(peaks_json='{"rank0:cpu": "lots"}')], r"run 1: peaks_json holds"),
        (FULL_TABLE, [_full_row(config_toml=b"\x00\xff")], r"run 1: config_toml holds b'\\x00\\xff', not text"),
    ],
    ids=["other-schema", "text-as-real", "deep-peaks", "peaks-not-bytes", "blob"],
)
def test_a_registry_of_another_shape_is_one_line_and_unchanged(table, rows, pattern, tmp_path, capsys):
    db = _registry_rows(tmp_path / "runs.db", table, rows)
    before = _sha(db)
    _refused(["runs", "list", "--registry", str(db)], pattern, capsys)
    if rows:
        _refused(["runs", "show", "1", "--registry", str(db)], pattern, capsys)
    assert _sha(db) == before


def test_an_older_registry_is_read_as_it_is_and_migrated_only_when_a_run_is_added(tmp_path, capsys):
    """A registry from before the newer columns lists its runs (those columns empty) without being
    altered; adding a run is what adds the columns."""
    db = _registry_rows(
        tmp_path / "runs.db", CORE_TABLE, [(1, "train", "2026-01-01T00:00:00Z", "abc", "GPT-2", "full")]
    )
    before = _sha(db)
    assert cli.main(["runs", "list", "--registry", str(db)]) == 0
    assert "GPT-2" in capsys.readouterr().out
    assert _sha(db) == before
    (row,) = registry.rows(db)
    assert row["peaks_json"] is None and row["output_dir"] is None
    registry.add({"kind": "train", "model": "m", "mode": "lora", "started": "x", "config_hash": "h"}, db)
    with sqlite3.connect(db) as con:
        assert {r[1] for r in con.execute("PRAGMA table_info(runs)")} >= {n for n, _ in registry.COLUMNS}
    con.close()
    assert [r["id"] for r in registry.rows(db)] == [1, 2]


@pytest.mark.parametrize("run_id", ["0", "-1", str(2**63), str(2**64)])
def test_a_run_id_sqlite_cannot_hold_is_named_not_an_overflow(run_id, tmp_path, capsys):
    db = _registry_rows(tmp_path / "runs.db", FULL_TABLE, [_full_row()])
    _refused(["runs", "show", run_id, "--registry", str(db)], rf"^runs: {run_id} is not a run id", capsys)


@pytest.mark.parametrize(
    ("record", "pattern"),
    [
        (b"{not json", r"record\.json' is not valid JSON"),
        (b"[1, 2]", r"record\.json' is not a trainplan run record"),
        (b'{"config": {"mode": "sideways"}}', r"record\.json' is not a trainplan run record"),
        (b"[" * 100_000, r"record\.json' is nested too deeply"),
        (b"\xff\xfe{}", r"record\.json' is not UTF-8 text"),
    ],
    ids=["not-json", "a-list", "no-mode", "deep", "utf16"],
)
def test_a_run_record_that_is_not_trainplans_is_refused_before_anything_loads(record, pattern, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "result").mkdir(parents=True)
    (run / "result" / "adapter_config.json").write_text("{}")
    (run / "record.json").write_bytes(record)
    out = tmp_path / "exported"
    _refused(["export", str(run), "-o", str(out)], rf"^RUN_OR_CHECKPOINT: .*{pattern}", capsys)
    assert not out.exists()


def test_error_lines_keep_the_terminal_and_the_screen_whole():
    """An error echoes user text: escape sequences reach the terminal as text, an echoed value of a
    megabyte is cut, and a config with a thousand problems prints five lines."""
    (line,) = text.error_lines("model.source: unknown preset '\x1b[2J\x1b]0;pwned\x07x'")
    assert "\x1b" not in line and "\x07" not in line and "\\x1b[2J" in line
    (line,) = text.error_lines("data.source: no such file '" + "a" * 10**6 + "'; give a path")
    assert len(line) < 200 and line.endswith("…'; give a path")
    lines = text.error_lines("\n".join(f"field{i}: unknown key" for i in range(1000)))
    assert lines[:4] == [f"field{i}: unknown key" for i in range(4)]
    assert lines[4] == "and 996 more problems of the same input" and len(lines) == 5
    assert text.error_lines("a: b\nc: d") == ["a: b", "c: d"]  # a few problems: each on its line


# ---- the fuzz: every reader, every class, drawn from seeded generators (tests/hostile_gen.py) ----

CASES = hostile_gen.cases()


def test_the_fuzz_reaches_every_reader():
    assert len(CASES) >= 300
    assert {name for name, _ in CASES} == set(hostile_gen.CLASSES)
    assert len({n for n in hostile_gen.COUNTS.values()}) > 1  # not one flat list


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{name}-{i}" for i, (name, _) in enumerate(CASES)])
def test_a_hostile_file_is_one_line_exit_2_and_nothing_written(case, tmp_path, capsys, monkeypatch):
    """Exit 2, one line matching the reader's field, nothing on stdout, no traceback, nothing new in
    the directory (no output, no run started): for each generated file."""
    name, build = CASES[case]
    argv, pattern = build(tmp_path)
    _check(argv, pattern, tmp_path, capsys, monkeypatch)


def _edge_cases(tmp):
    run = tmp / "run"
    (run / "result").mkdir(parents=True)
    (run / "result" / "config.json").write_text(json.dumps(hostile_gen.TINY))
    (run / "record.json").write_text(json.dumps({"config": {"mode": "full", "model": {"source": "x"}}}))
    (tmp / "blob").mkdir()
    (tmp / "blob" / "a.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    return [
        (["plan", "--set", "optim.lr=5e-324"], r"^optim\.lr: 5e-324 is below fp32's smallest normal number"),
        (["plan", "--set", "hardware.cuda_context_mib=1000000000000000"], r"^hardware\.cuda_context_mib: .* past any"),
        (["plan", "--set", 'train.output_dir="a\x1b[2Jb"'], r"^train\.output_dir: holds a control character"),
        (["generate", "default", "--prompt", "hi", "--seed", str(2**64)], r"^argument --seed: .* outside 0 to 2\^53"),
        *(
            (["export", str(run), "-o", str(out), "--force"], r"^-o: .* is, holds or lies inside the result")
            for out in (run, run / "result", run / "result" / "inner")
        ),
        (
            ["advise", "GPT-2", "--registry", "off", "--data", str(tmp / "blob"), "--out", "x.toml"],
            r"^--data: .*binary",
        ),
    ]


@pytest.mark.parametrize("case", range(8))
def test_numbers_and_outputs_at_the_edges_are_refused(case, tmp_path, capsys, monkeypatch):
    """Each was accepted with exit 0 (or an internal error): a learning rate that is 0 in fp32, a
    CUDA context of an exabyte, an escape sequence in a directory name, a seed SQLite and torch cannot
    hold, an export --force onto the run it reads (which deleted the run), a data directory of images."""
    cases = _edge_cases(tmp_path)
    assert len(cases) == 8
    argv, pattern = cases[case]
    _check(argv, pattern, tmp_path, capsys, monkeypatch)
    assert (tmp_path / "run" / "record.json").is_file()  # the run is still there


def test_train_asked_for_a_gpu_on_a_machine_without_one_refuses_rather_than_run_on_the_cpu(
    tiny_run, tmp_path, capsys, monkeypatch
):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the run would be a real one")
    root, base = tiny_run
    argv = ["train", *(a for item in base for a in ("--set", item)), "--gpus", "H100-80GB", "--output-dir", "out"]
    _check(
        argv, r"^hardware\.gpus: 'H100-80GB' asks for GPUs, but this process sees none", tmp_path, capsys, monkeypatch
    )
