"""`trainplan ui` (issue 37): the planner page, served in-process on a free port. Its API answers with
`trainplan plan --json`'s numbers and the CLI's one-line refusals; in headless Chromium (Playwright,
Debian's browser) the page draws each device's bar from them, follows every change, keeps its state
in the URL and marks a bad field with the CLI's message."""

import json
import os
import shutil
import threading
import urllib.error
import urllib.request
from urllib.parse import urlencode

import pytest

from trainplan import cli
from trainplan.commands import ui

# (the page's fields, as a shared link holds them): heterogeneous devices, ZeRO-3 over 8 GPUs, LoRA
CASES = {
    "heterogeneous": {"model": "Llama-3.2-3B", "gpus": "A100-80GB,RTX4090", "mode": "full", "seq": "1024"},
    "zero3-8gpu": {"model": "Llama-3.1-8B", "gpus": "8xH100-80GB", "mode": "full", "strategy": "zero3"},
    "lora": {"model": "Llama-3.1-8B", "gpus": "L4", "mode": "lora", "seq": "2048", "micro": "2"},
}


@pytest.fixture(scope="module")
def server():
    srv = ui.serve("127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def cli_plan(state: dict, tmp_path) -> dict:
    """What `trainplan plan ... --json` prints for the page's state (the CLI's own main, in-process)."""
    out = tmp_path / "plan.json"
    cli.main([*ui.argv_of(state), "--json", "-o", str(out)])
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_api_answers_what_plan_json_prints(server, tmp_path, case):
    status, body = get(f"{server}/api/plan?{urlencode(CASES[case])}")
    assert status == 200
    assert body["plan"] == cli_plan(CASES[case], tmp_path)
    assert body["command"].startswith("trainplan plan ") and "--gpus" in body["command"]


def test_bad_input_is_the_clis_one_line_refusal_and_the_server_keeps_serving(server):
    for query, field in (("seq=abc", "batch.seq_len"), ("seq=-5", "batch.seq_len"), ("gpus=9xFOO", "hardware.gpus")):
        status, body = get(f"{server}/api/plan?{query}")
        assert status == 400 and body["field"] == field, body
        assert "\n" not in body["error"] and body["error"]
    status, body = get(f"{server}/api/plan?model=--data=/etc/passwd")  # never read as a flag
    assert status == 400 and body["field"] == "model.source" and "is not a model" in body["error"]
    status, body = get(f"{server}/api/plan?model=/nonexistent/model-dir")
    assert status == 400 and body["error"].startswith("model.source: ") and "\n" not in body["error"]
    status, body = get(f"{server}/api/plan?colour=red")
    assert status == 400 and "unknown field 'colour'" in body["error"]
    status, body = get(f"{server}/api/advise?gpus=L4")
    assert status == 400 and body["error"].startswith("model.source: advise needs a model")
    status, body = get(f"{server}/api/advise.toml?{urlencode(CASES['lora'])}&row=99999")
    assert status == 400 and body["error"].startswith("row: '99999' is not one of advise's")
    assert get(f"{server}/api/plan?{urlencode(CASES['lora'])}")[0] == 200  # still serving
    assert get(f"{server}/nothing")[0] == 404


def test_a_request_for_another_host_is_refused(server):
    """DNS rebinding: a page of another site that resolves its name to 127.0.0.1 reaches this server, but
    its requests name that site in their Host header."""
    request = urllib.request.Request(f"{server}/api/plan", headers={"Host": "evil.example:80"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 403


def test_the_command_line_is_the_state_and_plans_the_same(tmp_path):
    state = {**CASES["zero3-8gpu"], "checkpointing": "1", "tp": "2"}
    argv = ui.argv_of(state)
    assert ui.command_of(argv) == (
        "trainplan plan --model Llama-3.1-8B --gpus 8xH100-80GB --mode full --strategy zero3 --tp 2 --checkpointing"
    )
    assert ui.plan_json(state)["plan"] == cli_plan(state, tmp_path)


# ---- in the browser ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make test installs it from Debian's packages)")
        pytest.skip("chromium not installed")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def painted(page, after: int = 0) -> int:
    """Wait until the page has drawn an answer later than `after`; returns its count."""
    page.wait_for_function(f"Number(document.body.dataset.painted || 0) > {after}", timeout=60_000)
    return int(page.evaluate("document.body.dataset.painted"))


def shown_totals(page) -> list[int]:
    return [int(x) for x in page.eval_on_selector_all(".device", "els => els.map(e => e.dataset.total)")]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_page_shows_each_devices_plan_and_follows_every_change(server, browser, tmp_path):
    """A shared link (the state in the URL) draws the CLI's per-device totals for the three cases; then
    changing the sequence length and the micro-batch redraws the bars and the verdict, and the URL and
    the command line follow; a bad value marks its field with the CLI's message."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    for case, state in sorted(CASES.items()):
        page.goto(f"{server}/?{urlencode(state)}")
        painted(page)
        want = cli_plan(state, tmp_path)
        assert shown_totals(page) == [d["total_bytes"] for d in want["devices"]], case
        assert page.get_attribute("#verdict", "data-state") == want["verdict"]["state"], case
        bars = page.eval_on_selector_all(".device .bar", "els => els.map(e => e.querySelectorAll('.seg').length)")
        assert len(bars) == len(want["devices"]) and all(bars), case

    page.goto(f"{server}/?{urlencode(CASES['lora'])}")
    n = painted(page)
    before = shown_totals(page)
    page.fill("input[name=seq]", "8192")
    n = painted(page, n)
    page.fill("input[name=micro]", "4")
    n = painted(page, n)
    state = {**CASES["lora"], "seq": "8192", "micro": "4"}
    want = cli_plan(state, tmp_path)
    assert shown_totals(page) == [d["total_bytes"] for d in want["devices"]] and shown_totals(page) != before
    assert page.get_attribute("#verdict", "data-state") == want["verdict"]["state"]
    assert "seq=8192" in page.url and "micro=4" in page.url
    assert page.input_value("#command") == ui.command_of(ui.argv_of(state))

    # by keyboard alone: Tab from the accumulation field to the sequence length, type a new one
    page.focus("input[name=accum]")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.name") == "seq"
    page.keyboard.press("Control+A")
    page.keyboard.type("4096")
    n = painted(page, n)
    assert "seq=4096" in page.url
    assert shown_totals(page) == [d["total_bytes"] for d in cli_plan({**state, "seq": "4096"}, tmp_path)["devices"]]
    # a narrow window: nothing wider than it
    page.set_viewport_size({"width": 420, "height": 900})
    assert page.evaluate("document.documentElement.scrollWidth") <= 420

    page.fill("input[name=seq]", "-5")
    painted(page, n)
    message = page.inner_text("#error")
    assert message.startswith("batch.seq_len: ") and "\n" not in message
    assert page.get_attribute("input[name=seq]", "aria-invalid") == "true"
    assert message in page.inner_text("label:has(input[name=seq]) .field-error")
    page.close()


def test_a_port_in_use_is_refused_in_one_line_and_another_host_is_warned_of(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["ui", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("trainplan ui: error: --port: cannot listen on 127.0.0.1:") and err.count("\n") == 1
        assert cli.main(["ui", "--host", "0.0.0.0", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert "warning: serving on 0.0.0.0" in err and "--port: cannot listen on 0.0.0.0:" in err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_advise_tab_ranks_advises_rows_and_its_toml_plans_as_written(server, browser, tmp_path):
    """The advise tab lists `trainplan advise`'s ranked rows for the page's model, devices, mode and
    sequence length; row 1's download is the TOML `advise --out` writes, and `trainplan plan` on it
    says FITS."""
    state = {"model": "Llama-3.1-8B", "gpus": "8xH100-80GB", "mode": "full", "seq": "2048"}
    page = browser.new_page()
    page.goto(f"{server}/?{urlencode(state)}")
    painted(page)
    page.click("#advise")
    page.wait_for_function("Number(document.body.dataset.advised || 0) > 0", timeout=120_000)
    want = ui.advise_json(state)
    ranks = page.eval_on_selector_all("#ladder tbody tr", "rows => rows.map(r => Number(r.dataset.rank))")
    assert ranks == [e["rank"] for e in want["entries"]] and ranks[0] == 1
    assert want["entries"][0]["summary"] in page.inner_text("#ladder tbody tr:first-child")
    with page.expect_download() as got:
        page.click("#ladder tbody tr:first-child a")
    toml = tmp_path / "row1.toml"
    got.value.save_as(toml)
    assert toml.read_text() == ui.advise_toml(state, "1")[1] and got.value.suggested_filename == "trainplan-row1.toml"
    out = tmp_path / "plan.json"
    assert cli.main(["plan", str(toml), "--json", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["verdict"]["state"] == "FITS"
    page.close()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_trace_button_shows_trace_exact_figure_beside_the_analytic_one(server, browser, tmp_path):
    """The trace button runs `trainplan trace` (the real step on fake tensors) for the page's state in the
    background and shows its peak beside the analytic one: `trace --json`'s own two figures."""
    state = {"model": "tiny-llama", "gpus": "cpu", "mode": "lora", "seq": "64", "micro": "2"}
    page = browser.new_page()
    page.goto(f"{server}/?{urlencode(state)}")
    painted(page)
    page.click("#trace")
    page.wait_for_function("Number(document.body.dataset.traced || 0) > 0", timeout=120_000)
    out = tmp_path / "trace.json"
    assert cli.main(["trace", *ui.argv_of(state)[1:], "--json", "-o", str(out)]) == 0
    want = json.loads(out.read_text())["comparison"]
    assert int(page.get_attribute("#trace-result", "data-traced")) == want["traced_peak_bytes"]
    assert int(page.get_attribute("#trace-result", "data-analytic")) == want["analytic_peak_bytes"]
    assert page.inner_text("#trace-result").startswith("peak: analytic ")
    page.close()
