"""Terminal output of plan, advise and runs: rich tables within 100 columns off a terminal, with
no ANSI code, every reason shown whole (wrapped, never cut), and colour only on a terminal."""

from __future__ import annotations

import json

import pytest

from trainplan import cli, text
from trainplan.verify import registry

WIDE_PLAN = ["plan", "--model", "Llama-3.1-8B", "--gpus", "2xA100-80GB,1xRTX4090,1xL4", "--mode", "lora"]
ADVISE = [
    "advise",
    "Llama-3.1-70B",
    "--gpus",
    "2xA100-80GB,2xRTX4090",
    "--seq",
    "2048",
    "--mode",
    "qlora",
    "--registry",
    "off",
]


def words(s: str) -> str:
    return " ".join(s.split())


def check_width(out: str) -> None:
    assert "\x1b" not in out, "ANSI codes in output that is not a terminal"
    assert "…" not in out, "a cell was cut short"
    too_wide = [line for line in out.splitlines() if len(line) > text.WIDTH]
    assert not too_wide, too_wide


def test_plan_table_fits_100_columns_and_keeps_its_facts(capsys):
    assert cli.main(WIDE_PLAN) == 0
    out = capsys.readouterr().out
    check_width(out)
    for fact in ("GPU 0 (+1 alike)", "RTX4090", "L4", "TOTAL (GiB)", "headroom (GiB)", "at forward", "Why (GPU 0"):
        assert fact in out
    assert cli.main([*WIDE_PLAN, "--json"]) == 0
    ledger = json.loads(capsys.readouterr().out)
    first = ledger["devices"][0]
    shown = [r for c, r in first["explain"].items() if first["components"].get(c)]
    assert len(shown) >= 4
    for reason in shown:  # the why of each component, whole, in the text
        assert words(reason) in words(out)
    assert words(ledger["verdict"]["summary"]) in words(out)


def test_advise_table_fits_100_columns_with_every_why_whole(capsys):
    assert cli.main([*ADVISE, "--prefer", "quality", "--top", "4"]) == 0
    out = capsys.readouterr().out
    check_width(out)
    assert cli.main([*ADVISE, "--prefer", "quality", "--top", "4", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["entries"]) == 4
    for e in doc["entries"]:
        assert words(e["why"]) in words(out)  # long reasons wrap onto more lines, never cut
        assert f"{e['peak']['total_bytes'] / 2**30:.1f} / {e['peak']['usable_bytes'] / 2**30:.1f}" in out
    assert max(len(e["why"]) for e in doc["entries"]) > text.WIDTH  # the case is a real test of wrapping


def test_runs_tables_fit_100_columns(tmp_path, capsys):
    db = tmp_path / "runs.sqlite"
    long_model = "/data/models/" + "a-very-long-model-directory-name-" * 3 + "Llama-3.1-8B-Instruct"
    row = {
        "kind": "accept",
        "started": "2026-12-01T05:09:55Z",
        "model": long_model,
        "mode": "qlora",
        "devices": "8x80GiB",
        "peaks_json": json.dumps({f"rank{i}:cuda:{i}": 70 << 30 for i in range(8)}),
        "metric_before": 2.8123,
        "metric_after": 2.5361,
        "wall_seconds": 147.2,
        "train_seconds": 75.4,
        "verdict": "PASS",
        "output_dir": "/runs/" + "x" * 150,
        "config_toml": 'mode = "qlora"\n',
    }
    registry.add(row, db)
    registry.add({**row, "mode": "lora", "verdict": "FAIL"}, db)
    for argv in (["list"], ["show", "1"], ["compare", "1", "2"]):
        assert cli.main(["runs", *argv, "--registry", str(db)]) == 0
        out = capsys.readouterr().out
        check_width(out)
        assert "2m27s" in out  # the run wall time, written as the report writes it
    assert "config differences: none" in out


@pytest.mark.parametrize("terminal", [False, True])
def test_colour_only_on_a_terminal(monkeypatch, terminal):
    t = text.table("a", "b>")
    t.add_row(text.cell("fits", "green"), "1.00")
    monkeypatch.setattr(text.shutil, "get_terminal_size", lambda fallback: __import__("os").terminal_size((120, 40)))
    out = text.render(t, terminal=terminal)
    assert ("\x1b[" in out) == terminal


def test_user_strings_stay_inert_in_cells():
    t = text.table("model")
    t.add_row(text.cell("[bold]x[/bold] \x1b[31mred"))
    out = text.render(t)
    assert "[bold]x[/bold]" in out and "?[31mred" in out and "\x1b" not in out
