"""`trainplan accept` end to end on a tiny model: six checks, three reports, the registry."""

import json
import re

import pytest

from trainplan import cli
from trainplan import config as C
from trainplan.commands.train import execute
from trainplan.plan import analytic
from trainplan.run.record import RunRecord
from trainplan.verify import accept, checks, registry
from trainplan.verify.plots import HELD_OUT_COLOR, MEASURED_COLOR, PLAN_COLOR

pytestmark = pytest.mark.slow


def sets(tiny_run, *extra):
    root, base = tiny_run
    return [x for item in [*base, *extra] for x in ("--set", item)]


@pytest.fixture(scope="module")
def accepted(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("accept")
    db = out / "runs.sqlite"
    code = cli.main(["accept", *sets(tiny_run, "train.steps=6"), "--output-dir", str(out), "--registry", str(db)])
    return code, out, db, json.loads((out / "accept.json").read_text())


def test_accept_passes_every_check_and_writes_three_reports(accepted):
    code, out, db, result = accepted
    assert code == 0 and result["verdict"] == "PASS", result["failing"]
    assert result["order"] == ["contract", "memory", "step", "quality", "resume", "instability"]
    checks = {c["key"]: c for c in result["checks"]}
    assert all(c["passed"] for c in checks.values())
    assert "adapter tensors changed" in checks["contract"]["summary"]
    mem = checks["memory"]["evidence"]
    assert mem["rows"] and all(r["ok"] for r in mem["rows"])
    phases = [r["phase"] for r in mem["rows"]]  # every phase of the run, each measured and compared
    assert list(dict.fromkeys(phases)) == ["load", "forward", "backward", "optimizer", "evaluate", "save"]
    assert mem["placement"][0]["cpu"]["parameters"] > 0 and mem["max_rss_bytes"][0] > 0
    q = checks["quality"]["evidence"]
    assert q["after"]["loss"] < q["before"]["loss"] and q["train_seconds"] > 0
    # before/after samples are taken (tests/run/test_export_generate.py checks them), none here:
    # this run's base is randomly initialized, so no model file holds a "before" to compare with
    assert result["record"]["samples"] == []
    assert q["settings"]["data"]["eval_documents"] > 0  # separate evaluation data
    fit = checks["step"]["evidence"]["overfit_losses"]
    assert len(fit) == 6 and fit[-1] < fit[0]
    assert checks["resume"]["evidence"]["checks"]["weights_hash"]
    for name in ("accept.json", "accept.md", "accept.html"):
        assert (out / name).stat().st_size > 0
    rows = registry.rows(db)
    assert [(r["kind"], r["verdict"], r["mode"]) for r in rows] == [("accept", "PASS", "lora")]
    assert rows[0]["metric_after"] < rows[0]["metric_before"]
    assert json.loads(rows[0]["peaks_json"])["rank0:cpu"] == mem["peaks"]["rank 0 (cpu)"]


@pytest.mark.multiprocess
def test_a_wrong_plan_fails_the_memory_check_and_names_the_component(tiny_run, tmp_path):
    """The acceptance cannot pass by construction: halve one activation term of the plan (the
    logits and loss tensors, the largest on this tiny model) and the memory check fails."""
    code = cli.main(
        [
            "accept",
            *sets(tiny_run, "train.steps=4"),
            "--output-dir",
            str(tmp_path),
            "--perturb-plan",
            "logits_loss=0.5",
            "--resume-steps",
            "3",
            "--resume-at",
            "2",
            "--overfit-steps",
            "2",
        ]
    )
    result = json.loads((tmp_path / "accept.json").read_text())
    assert code == 1 and result["verdict"] == "FAIL"
    assert result["checks"][0]["key"] == "memory"  # the failing evidence comes first
    assert result["failing"][0].startswith("Memory") and "logits_loss" in result["failing"][0]
    assert len(result["failing"]) == 1  # every other check passed
    bad = [r for r in result["checks"][0]["evidence"]["rows"] if not r["ok"]]
    assert bad and all("logits_loss" in r["components"] for r in bad)
    md = (tmp_path / "accept.md").read_text()
    assert md.index("## Failing") < md.index("## Checks")
    assert "trainplan accept: <span class='FAIL'>FAIL</span>" in (tmp_path / "accept.html").read_text()


def test_memory_check_measures_what_the_plan_omits(accepted):
    """The comparison is real: a plan with half the frozen weights fails on that group."""
    _, _, _, result = accepted
    record = RunRecord.from_json(dict(result["record"], memory=result["memory"]))
    ledger = analytic.plan(C.from_dict(record.config))
    assert checks.check_memory(record, ledger, 0.05).passed
    assert not checks.check_memory(record, accept.perturbed(ledger, {"weights": 0.5}), 0.05).passed
    with pytest.raises(Exception, match="no component 'nonsense'"):
        accept.perturbed(ledger, {"nonsense": 2.0})


def test_inference_acceptance(tiny_run, tmp_path):
    root, base = tiny_run
    cfg = C.load(accept.DEFAULT_CONFIG, [*base, "mode=inference"])
    result = accept.accept(cfg, out_dir=tmp_path)
    checks = {c["key"]: c for c in result["checks"]}
    assert result["verdict"] == "PASS", result["failing"]
    assert checks["contract"]["passed"] and "no gradient" in checks["contract"]["summary"]
    assert checks["memory"]["passed"]
    assert {r["phase"] for r in checks["memory"]["evidence"]["rows"]} == {"load", "inference"}
    assert checks["step"]["passed"] is None and checks["resume"]["passed"] is None


@pytest.mark.multiprocess
def test_html_report_renders_its_plots_in_a_headless_browser(accepted, screenshot):
    _, out, _, _ = accepted
    page = (out / "accept.html").read_text()
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:|//)", page), "the page must be self-contained"
    counts = screenshot(out / "accept.html")

    def pixels(hex_color: str) -> int:
        return counts.get(tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5)), 0)

    # the plots, matplotlib SVG (tests/verify/test_report.py checks their ticks): plan and measured
    # memory bars side by side, thousands of pixels each, and the held-out evaluations
    for plot_id in ("plot-memory", "plot-loss", "plot-grad-norm", "plot-throughput", "plot-overfit"):
        assert f'id="{plot_id}"' in page
    assert pixels(PLAN_COLOR) > 2000 and pixels(MEASURED_COLOR) > 2000 and pixels(HELD_OUT_COLOR) > 100
    # the verdict heading rendered in its colour
    assert pixels("#1a7f37") > 50


def test_runs_list_show_compare(accepted, tiny_run, tmp_path, capsys, monkeypatch):
    _, out, db, _ = accepted
    root, base = tiny_run
    monkeypatch.chdir(tmp_path)  # a relative output_dir: the registry keeps it absolute
    record = execute(C.load(None, [*base, "mode=full", "train.output_dir=relative-run"]), quiet=True)[0].to_json()
    assert record["registry_id"] is not None  # train runs register themselves (the suite's registry)
    rows = registry.rows(registry.path())
    assert rows[-1]["kind"] == "train" and rows[-1]["mode"] == "full"
    assert rows[-1]["output_dir"] == str((tmp_path / "relative-run").resolve())
    assert cli.main(["runs", "list", "--registry", str(db)]) == 0
    assert re.search(r"^1\s+accept\s", capsys.readouterr().out, re.M)
    assert cli.main(["runs", "show", "1", "--registry", str(db)]) == 0
    shown = capsys.readouterr().out
    assert "verdict" in shown and "[lora]" in shown
    assert cli.main(["runs", "compare", str(rows[-1]["id"]), str(rows[-1]["id"])]) == 0
    assert "config differences: none" in capsys.readouterr().out
    assert cli.main(["runs", "show", "99", "--registry", str(db)]) == 2
    assert "no run 99" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_accept_on_two_fsdp_ranks_measures_every_device(tiny_run, tmp_path):
    """torchrun, 2 FSDP2 ranks: each rank's own placement and peak, compared with its own plan."""
    code = cli.main(
        [
            "accept",
            *sets(tiny_run, "train.steps=4", "batch.micro_batch_size=2", "parallel.strategy=zero3"),
            "--output-dir",
            str(tmp_path),
            "--nproc",
            "2",
            "--resume-steps",
            "3",
            "--resume-at",
            "2",
            "--overfit-steps",
            "3",
        ]
    )
    result = json.loads((tmp_path / "accept.json").read_text())
    assert code == 0 and result["verdict"] == "PASS", result["failing"]
    mem = next(c for c in result["checks"] if c["key"] == "memory")["evidence"]
    assert {r["device"] for r in mem["rows"]} == {"rank 0 (cpu)", "rank 1 (cpu)"}
    for place in mem["placement"]:  # each rank holds shards, not the whole model
        assert place["cpu"]["sharded"] == place["cpu"]["parameters"] > 0
    assert result["record"]["hardware"]["world_size"] == 2
    # its resume check is FSDP2's through DCP, bitwise (it covers test_distributed's full-zero3 case,
    # which ran the same three launches again)
    resume = next(c for c in result["checks"] if c["key"] == "resume")["evidence"]
    assert resume["passed"] and resume["checks"]["weights_hash"] and resume["checks"]["optimizer_hash"]
    assert resume["max_deviation"] == {"loss": 0.0, "grad_norm": 0.0, "lr": 0.0}
    (ckpt,) = (tmp_path / "resume" / "checkpoints").iterdir()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= set(manifest["parts"])
    assert "model.safetensors" not in manifest["parts"] and "optimizer.pt" not in manifest["parts"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tolerance", "2"], "--tolerance: must be in (0, 1)"),
        (["--resume-steps", "2", "--resume-at", "2"], "--resume-at: must be between 1 and 1"),
        (["--perturb-plan", "nonsense=0.5"], "--perturb-plan: no plan component 'nonsense'"),
        (["--perturb-plan", "activations"], "--perturb-plan: 'activations' is not COMPONENT=FACTOR"),
        (["--set", "guard.window=1"], "guard.window: must be an integer >= 2"),
    ],
)
def test_accept_bad_input_is_one_line_and_starts_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert cli.main(["accept", "--output-dir", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_reports_and_the_terminal_show_user_strings_inert(accepted, capsys):
    """A path or model name carrying HTML or terminal escapes reached accept.md and `runs list` raw."""
    from trainplan.verify import report

    code, out, db, result = accepted
    evil = "<img src=x onerror=alert(1)><script>alert(2)</script>|\x1b[31mred"
    doctored = json.loads(json.dumps(result))
    doctored["record"]["model"]["name"] = evil
    doctored["failing"] = [f"Memory: {evil}"]
    text = report.render_markdown(doctored)
    assert "<img" not in text and "<script>" not in text and "\x1b" not in text
    assert "&lt;img src=x onerror=alert\\(1\\)&gt;" in text
    row = registry.rows(db)[0]
    registry.add({**row, "model": evil, "output_dir": "/tmp/\x1b]0;title\x07"}, db)
    assert cli.main(["runs", "list", "--registry", str(db)]) == 0
    listed = capsys.readouterr().out
    assert "\x1b" not in listed and "\x07" not in listed and "?[31mred" in "".join(listed.split())  # wrapped
