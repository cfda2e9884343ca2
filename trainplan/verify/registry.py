"""The run registry: every `train` and `accept` run, one row each, in a local SQLite database.

Path: `--registry PATH`, else ~/.cache/trainplan/runs.sqlite; `--registry off` records nothing.
The path is passed explicitly, from the command's flag to here; no environment variable carries it.
`trainplan runs list | show ID | compare A B` reads it; `trainplan advise --registry` calibrates
its step-time estimate from the measured tokens/s here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from trainplan import text
from trainplan.errors import TrainplanError
from trainplan.files import special
from trainplan.spec.devices import format_gib

DEFAULT = "~/.cache/trainplan/runs.sqlite"
COLUMNS = (
    ("kind", "TEXT"),  # train | accept
    ("started", "TEXT"),  # UTC, ISO 8601
    ("config_hash", "TEXT"),
    ("model", "TEXT"),
    ("mode", "TEXT"),
    ("device", "TEXT"),  # cpu, or the GPU's name
    ("devices", "TEXT"),  # e.g. 2xcpu, 8x80GiB
    ("peaks_json", "TEXT"),  # {device label: peak bytes}
    ("metric", "TEXT"),
    ("metric_before", "REAL"),
    ("metric_after", "REAL"),
    ("wall_seconds", "REAL"),
    ("train_seconds", "REAL"),
    ("tokens_per_s", "REAL"),  # median over steps
    ("verdict", "TEXT"),  # PASS | FAIL
    ("output_dir", "TEXT"),
    ("config_toml", "TEXT"),
)


OFF = "off"


def path(explicit: str | None = None) -> Path | None:
    """The registry a command uses: its --registry value, else the default; None for 'off'."""
    if explicit == OFF:
        return None
    return Path(explicit or DEFAULT).expanduser()


# The columns every registry has had since the first (newer ones are added to an older registry when
# a run is recorded; a table without these is another program's, never migrated)
CORE = ("id", "kind", "started", "config_hash", "model", "mode")
MAX_ID = 2**63 - 1  # SQLite's INTEGER


@contextlib.contextmanager
def _connect(db: Path, *, create: bool) -> Iterator[sqlite3.Connection]:
    """A connection to the registry. Writing (`create`): the table is created in a new file, or newer
    columns added to an older registry. Reading: the file is opened read-only and never altered. A
    file that is not a trainplan registry (another program's database, another schema) is one line
    naming --registry, in both cases: its tables are never touched."""
    what = special(db) or ("is a directory" if db.is_dir() else None)
    if what:  # SQLite would wait on a FIFO, or read a device
        raise TrainplanError(f"--registry: {str(db)!r} {what}, not a run registry; give a file path, or --registry off")
    if not create and not db.is_file():
        raise TrainplanError(f"registry: no run registry at {db}; run `trainplan train` or `trainplan accept` first")
    try:
        if create:
            db.parent.mkdir(parents=True, exist_ok=True)
            con = sqlite3.connect(db, timeout=30)
        else:
            con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            con.row_factory = sqlite3.Row
            _check_schema(con, db, create=create)
            with con:
                yield con
        finally:
            con.close()
    except sqlite3.Error as e:
        raise TrainplanError(
            f"--registry: {db} is not a readable trainplan run registry ({e}); give another path, or move it aside"
        ) from None


def _check_schema(con: sqlite3.Connection, db: Path, *, create: bool) -> None:
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "runs" not in tables:
        if not create or tables - {"sqlite_sequence"}:
            raise TrainplanError(
                f"--registry: {db} is another program's database (no runs table; it has "
                f"{', '.join(sorted(tables)[:5]) or 'no tables'}); give a trainplan registry's path, or a new file"
            )
        cols = ", ".join(f"{name} {kind}" for name, kind in COLUMNS)
        con.execute(f"CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, {cols})")
        return
    have = {r[1] for r in con.execute("PRAGMA table_info(runs)")}
    missing = [c for c in CORE if c not in have]
    if missing:
        raise TrainplanError(
            f"--registry: {db} has a runs table of another schema (no {', '.join(missing)}); give a trainplan "
            "registry's path, or move it aside"
        )
    if create:
        for name, kind in COLUMNS:
            if name not in have:
                con.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")


def _checked(row: sqlite3.Row, db: Path) -> dict:
    """A row as the renderers need it: every column of COLUMNS (None where an older registry lacks it),
    each of its declared type; a value of another type is the registry's fault, named."""
    out = dict(row)
    if not isinstance(out.get("id"), int):
        raise TrainplanError(f"--registry: {db} holds a run whose id is {out.get('id')!r}, not an integer")
    for name, kind in COLUMNS:
        v = out.setdefault(name, None)
        ok = v is None or (isinstance(v, str) if kind == "TEXT" else isinstance(v, int | float))
        if ok and name == "peaks_json" and v is not None:
            ok = _peaks_problem(v) is None
        if not ok:
            raise TrainplanError(
                f"--registry: {db} run {out['id']}: {name} holds {text.clip(repr(v), 60)}, not {kind.lower()}; "
                "the file was written by something else: move it aside"
            )
    return out


def _peaks_problem(v: str) -> str | None:
    try:
        peaks = json.loads(v)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(peaks, dict) or not all(isinstance(b, int | float) or b is None for b in peaks.values()):
        return "not {device: bytes}"
    return None


def config_hash(cfg_dict: dict) -> str:
    return hashlib.sha256(json.dumps(cfg_dict, sort_keys=True).encode()).hexdigest()[:12]


def row_from_record(record, *, kind: str, verdict: str, device: str) -> dict:
    """The registry row of a RunRecord (accept adds its verdict)."""
    from trainplan.config import from_dict, to_toml

    cfg = record.config
    rates = sorted(s["tokens_per_s"] for s in record.steps)
    peaks = {}
    for rank, m in enumerate((record.memory or {}).get("per_rank", [])):
        peaks[f"rank{rank}:{m['device']}"] = m.get("peak_bytes")
    return {
        "kind": kind,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config_hash": config_hash(cfg),
        "model": cfg["model"]["source"],
        "mode": cfg["mode"],
        "device": device,
        "devices": record.hardware["devices"],
        "peaks_json": json.dumps(peaks),
        "metric": "held-out loss",
        "metric_before": record.eval_before["loss"],
        "metric_after": record.eval_after["loss"],
        "wall_seconds": record.wall_seconds,
        "train_seconds": record.train_seconds,
        "tokens_per_s": rates[len(rates) // 2] if rates else None,
        "verdict": verdict,
        # absolute and resolved: `runs show` finds the run from any directory, not only the one it started in
        "output_dir": str(Path(cfg["train"]["output_dir"]).resolve()) if cfg["train"]["output_dir"] else None,
        "config_toml": to_toml(from_dict(cfg)),
    }


def add(row: dict, db: Path | None) -> int | None:
    """Insert a run; None when the registry is switched off (db None)."""
    if db is None:
        return None
    with _connect(db, create=True) as con:
        names = [n for n, _ in COLUMNS]
        cur = con.execute(
            f"INSERT INTO runs ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
            [row.get(n) for n in names],
        )
        return int(cur.lastrowid)


def _required(db: Path | None) -> Path:
    if db is None:
        raise TrainplanError("--registry: 'off' has no runs to read; give the registry's path or leave it out")
    return db


def rows(db: Path | None) -> list[dict]:
    db = _required(db)
    with _connect(db, create=False) as con:
        return [_checked(r, db) for r in con.execute("SELECT * FROM runs ORDER BY id")]


def get(run_id: int, db: Path | None) -> dict:
    db = _required(db)
    if not 1 <= run_id <= MAX_ID:
        raise TrainplanError(f"runs: {text.clip(str(run_id), 40)} is not a run id; `trainplan runs list` shows the ids")
    with _connect(db, create=False) as con:
        row = con.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        raise TrainplanError(f"runs: no run {run_id} in {db}; `trainplan runs list` shows the ids")
    return _checked(row, db)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _value(key: str, v) -> str:
    """A registry value as shown; durations as the reports write them (run/record.py: wall_seconds)."""
    if key in ("wall_seconds", "train_seconds") and v is not None:
        from trainplan.run.progress import duration

        return duration(v)
    return _fmt(v)


def _peaks(r: dict) -> str:
    return ", ".join(f"{d} {format_gib(v)}" for d, v in json.loads(r.get("peaks_json") or "{}").items())


def render_list(items: list[dict], *, terminal: bool = False) -> str:
    from trainplan.text import cell, render, table

    t = table(
        "id",
        "kind",
        "started (UTC)",
        "mode",
        "devices",
        "peak>",
        "loss\nbefore>",
        "loss\nafter>",
        "run wall\ntime>",
        "verdict",
        "model",
    )
    for col in t.columns[:-1]:
        col.no_wrap = True  # short values: only the model (a name or a path) wraps
    for r in items:
        peaks = [v for v in json.loads(r["peaks_json"] or "{}").values() if v is not None]
        verdict = r["verdict"] or "-"
        t.add_row(
            str(r["id"]),
            cell(r["kind"]),
            cell((r["started"] or "").replace("T", " ")[:16]),
            cell(r["mode"]),
            cell(r["devices"]),
            format_gib(max(peaks) if peaks else None),
            _fmt(r["metric_before"]),
            _fmt(r["metric_after"]),
            _value("wall_seconds", r["wall_seconds"]),
            cell(verdict, "green" if verdict == "PASS" else "bold red" if verdict == "FAIL" else ""),
            cell(Path(r["model"]).name or r["model"]),
        )
    return render(t, terminal=terminal)


def render_show(r: dict, *, terminal: bool = False) -> str:
    from trainplan.text import cell, render, table

    t = table("field", "value")
    for k, v in r.items():
        if k not in ("config_toml", "peaks_json"):
            t.add_row(k, cell(_value(k, v)))
    t.add_row("peaks", cell(_peaks(r)))
    config = ["config:", *("  " + line for line in (r["config_toml"] or "").splitlines())]
    return render(t, cell("\n".join(config)), terminal=terminal)


def render_compare(a: dict, b: dict, *, terminal: bool = False) -> str:
    """Two runs side by side; '*' marks what differs. Config lines that differ are listed too."""
    from trainplan.text import cell, render, table

    t = table("", "field", f"run {a['id']}", f"run {b['id']}")
    for k in [k for k, _ in COLUMNS if k not in ("config_toml", "peaks_json")] + ["peaks_json"]:
        va, vb = (_peaks(r) if k == "peaks_json" else _value(k, r.get(k)) for r in (a, b))
        differs = va != vb and k != "started"
        t.add_row("*" if differs else "", "peaks" if k == "peaks_json" else k, cell(va), cell(vb))
    ca, cb = (a["config_toml"] or "").splitlines(), (b["config_toml"] or "").splitlines()
    diff = _config_diff(ca, cb)
    lines = ["config differences:" + ("" if diff else " none")] + [f"  {k}: {x} -> {y}" for k, x, y in diff]
    return render(t, cell("\n".join(lines)), terminal=terminal)


def _config_diff(a: list[str], b: list[str]) -> list[tuple[str, str, str]]:
    def flat(lines: list[str]) -> dict[str, str]:
        out, section = {}, ""
        for line in lines:
            if line.startswith("["):
                section = line.strip("[]") + "."
            elif "=" in line:
                k, v = line.split("=", 1)
                out[section + k.strip()] = v.strip()
        return out

    fa, fb = flat(a), flat(b)
    return [(k, fa.get(k, "-"), fb.get(k, "-")) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
