"""`trainplan ui`: the planner as a local web page (page.html), served by the standard library.

The page holds no formula. Its state (the fields below, also its URL's query) becomes a `trainplan plan`
command line, which the server parses with the CLI's own parser and plans with the CLI's own code
(commands/plan.py `ledger_of`): the page shows `plan --json`'s numbers, and its "copy as command" is
that line. Bad input gets the CLI's one-line message and a 400; the server keeps serving.

Security: it binds to 127.0.0.1 unless told otherwise; it reads a local path only where the user typed
one (the model field, as `plan` does); it writes nothing."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from trainplan.errors import ConfigError, TrainplanError

# The page's fields: (query key, the `plan` flag; None: the positional model; "switch": a flag alone).
FIELDS: tuple[tuple[str, str | None], ...] = (
    ("model", None),
    ("gpus", "--gpus"),
    ("mode", "--mode"),
    ("precision", "--precision"),
    ("optimizer", "--optimizer"),
    ("lora_r", "--lora-r"),
    ("lora_targets", "--lora-targets"),
    ("micro", "--micro-batch"),
    ("accum", "--grad-accum"),
    ("seq", "--seq"),
    ("strategy", "--strategy"),
    ("tp", "--tp"),
    ("pp", "--pp"),
    ("checkpointing", "--checkpointing"),
)
SWITCHES = {"checkpointing"}


def argv_of(state: dict[str, str]) -> list[str]:
    """The `trainplan plan` arguments of a page state (empty fields left to the defaults)."""
    unknown = sorted(set(state) - {key for key, _ in FIELDS})
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; the page's fields are {', '.join(k for k, _ in FIELDS)}")
    argv = ["plan"]
    for key, flag in FIELDS:
        value = state.get(key, "").strip()
        if not value:
            continue
        if key in SWITCHES:
            if value not in ("0", "false", "off"):
                argv.append(flag)
        elif flag is None:
            argv.append(value)
        else:
            argv += [flag, value]
    return argv


def command_of(argv: list[str]) -> str:
    """The shell line that prints the same plan."""
    return shlex.join(["trainplan", *argv])


def plan_json(state: dict[str, str]) -> dict:
    """{"command", "plan"}: the plan `trainplan plan --json` prints for this state. Raises
    ValueError with the CLI's one-line message (and `field`, where it names one) on bad input."""
    from trainplan import cli
    from trainplan.commands.plan import ledger_of

    argv = argv_of(state)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli.build_parser(only="plan").parse_args(argv)
    except SystemExit:  # argparse's own refusal (a bad number), as the CLI prints it
        message = err.getvalue().strip().removeprefix("trainplan plan: error: ")
        raise BadInput(message, _flag_field(message)) from None
    try:
        ledger = ledger_of(args)
    except ConfigError as e:
        raise BadInput(str(e), e.field) from None
    except (TrainplanError, ValueError) as e:
        raise BadInput(str(e).splitlines()[0], "") from None
    return {"command": command_of(argv), "plan": ledger.to_json()}


class BadInput(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _flag_field(message: str) -> str:
    """The config key of the flag an argparse message names ("argument --seq: ..." -> batch.seq_len)."""
    from trainplan.commands._common import CONFIG_FLAGS

    for flag, key, _ in CONFIG_FLAGS:
        if f"argument {flag}:" in message:
            return key
    return ""


def page() -> bytes:
    return resources.files("trainplan.ui").joinpath("page.html").read_bytes()


class Handler(BaseHTTPRequestHandler):
    server_version = "trainplan-ui"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        if url.path == "/":
            return self._send(HTTPStatus.OK, "text/html; charset=utf-8", page())
        if url.path == "/api/plan":
            query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            try:
                body = plan_json(query)
            except BadInput as e:
                return self._json(HTTPStatus.BAD_REQUEST, {"error": str(e), "field": e.field})
            except ValueError as e:
                return self._json(HTTPStatus.BAD_REQUEST, {"error": str(e), "field": ""})
            return self._json(HTTPStatus.OK, body)
        return self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {url.path}", "field": ""})

    def _json(self, status: HTTPStatus, body: dict) -> None:
        self._send(status, "application/json", json.dumps(body).encode())

    def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        pass  # quiet: the page asks on every change


def serve(host: str, port: int) -> ThreadingHTTPServer:
    """The server, bound (port 0: any free one); the caller runs serve_forever."""
    return ThreadingHTTPServer((host, port), Handler)
