"""`trainplan ui`: the planner as a local web page (page.html), served by the standard library.

The page holds no formula. Its state (the fields below, also its URL's query) becomes a `trainplan plan`
command line, which the server parses with the CLI's own parser and plans with the CLI's own code
(commands/plan.py `ledger_of`): the page shows `plan --json`'s numbers, and its "copy as command" is
that line. Bad input gets the CLI's one-line message and a 400; the server keeps serving.

Security: it binds to 127.0.0.1 unless told otherwise (--host warns); it reads a local path only where
the user typed one (the model field, as `plan` does); it writes nothing."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
import webbrowser
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from trainplan.errors import ConfigError, TrainplanError

HELP = "the planner as a local web page: each device's bar against its capacity as you change the settings"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1, this machine only; another one serves the page to the network)",
    )
    p.add_argument("--open", action="store_true", help="open the page in the default browser")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ConfigError("--port", f"must be 0..65535 (got {args.port})", "give a port number, or 0 for any free one")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"trainplan ui: warning: serving on {args.host}: anyone who reaches it can plan with paths on this "
            "machine (the page reads no file but a model path typed in it)",
            file=sys.stderr,
        )
    try:
        server = serve(args.host, args.port)
    except OSError as e:
        problem = f"cannot listen on {args.host}:{args.port} ({e.strerror})"
        raise ConfigError("--port", problem, "give another --port") from None
    host, port = server.server_address[:2]
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/"
    print(f"trainplan ui: {url} (Ctrl-C stops it)", flush=True)
    if args.open:
        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


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
    """{"command", "plan"}: the plan `trainplan plan --json` prints for this state. Raises BadInput
    with the CLI's one-line message (and `field`, where it names one) on bad input."""
    from trainplan.commands import plan

    argv = argv_of(state)
    args = _parse("plan", plan, argv[1:])
    try:
        ledger = plan.ledger_of(args)
    except ConfigError as e:
        raise BadInput(str(e), e.field) from None
    except (TrainplanError, ValueError) as e:
        raise BadInput(str(e).splitlines()[0], "") from None
    return {"command": command_of(argv), "plan": ledger.to_json()}


# What advise takes of the page's state: the rest (micro-batch, strategy, tp, ...) is what it searches.
ADVISE_FIELDS = (("model", None), ("gpus", "--gpus"), ("mode", "--mode"), ("seq", "--seq"))


def _parse(name: str, module, argv: list[str]) -> argparse.Namespace:
    """`trainplan <name> argv` parsed by the CLI's own parser; argparse's refusal as BadInput."""
    from trainplan.commands._common import Parser, prepare

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return prepare(Parser(prog=f"trainplan {name}"), module).parse_args(argv)
    except SystemExit:  # argparse's own refusal (a bad number), as the CLI prints it
        message = err.getvalue().strip().removeprefix(f"trainplan {name}: error: ")
        raise BadInput(message, _flag_field(message)) from None


def _advised(state: dict[str, str]):
    """(advise's argv, its search, its ranked rows) for the page's state: `trainplan advise`'s own code."""
    from trainplan.advise.rank import ranked
    from trainplan.advise.search import search
    from trainplan.commands import advise

    argv_of(state)  # the same field check
    if not state.get("model", "").strip():
        raise BadInput("model.source: advise needs a model; give one in the model field", "model.source")
    argv = ["advise"]
    for key, flag in ADVISE_FIELDS:
        value = state.get(key, "").strip()
        if value:
            argv += [value] if flag is None else [flag, value]
    args = _parse("advise", advise, argv[1:])
    try:
        s = search(advise.request_from_args(args))
    except ConfigError as e:
        raise BadInput(str(e), e.field) from None
    except (TrainplanError, ValueError) as e:
        raise BadInput(str(e).splitlines()[0], "") from None
    return argv, s, ranked(s, "ladder")


def advise_json(state: dict[str, str], top: int = 10) -> dict:
    """{"command", "fit", "entries"}: `trainplan advise`'s ranked rows (its --format json entries)."""
    from trainplan.advise.rank import entry_json

    argv, s, order = _advised(state)
    entries = [entry_json(s, o, i + 1, "ladder") for i, o in enumerate(order[:top])]
    return {"command": command_of(argv), "fit": len(order), "entries": entries}


def advise_toml(state: dict[str, str], row: str) -> str:
    """Row `row` of advise's ranked list as the TOML `advise --out` writes."""
    from trainplan.advise.rank import out_toml

    _, s, order = _advised(state)
    if not row.isascii() or not row.isdigit() or not 1 <= int(row) <= len(order):
        raise BadInput(f"row: {row!r} is not one of advise's {len(order)} rows; choose 1..{len(order)}", "row")
    return out_toml(s, order[int(row) - 1], int(row), len(order), "ladder", "trainplan.toml")


def trace_json(state: dict[str, str]) -> dict:
    """{"command", "comparison"}: `trainplan trace --json`'s comparison of the traced peak (the real
    model's step on fake tensors) with the analytic one, for the page's state."""
    from trainplan.commands import trace

    argv = ["trace", *argv_of(state)[1:]]
    args = _parse("trace", trace, argv[1:])
    try:
        _, comparison = trace.traced_of(args)
    except ConfigError as e:
        raise BadInput(str(e), e.field) from None
    except (TrainplanError, ValueError) as e:
        raise BadInput(str(e).splitlines()[0], "") from None
    return {"command": command_of(argv), "comparison": comparison}


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
    return resources.files(__package__).joinpath("page.html").read_bytes()


class Handler(BaseHTTPRequestHandler):
    server_version = "trainplan-ui"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        if url.path == "/":
            return self._send(HTTPStatus.OK, "text/html; charset=utf-8", page())
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        try:
            if url.path == "/api/plan":
                return self._json(HTTPStatus.OK, plan_json(query))
            if url.path == "/api/trace":  # seconds (it imports torch): the page asks in the background
                return self._json(HTTPStatus.OK, trace_json(query))
            if url.path == "/api/advise":
                return self._json(HTTPStatus.OK, advise_json(query))
            if url.path == "/api/advise.toml":
                row = query.pop("row", "1")
                text = advise_toml(query, row).encode()
                return self._send(HTTPStatus.OK, "application/toml; charset=utf-8", text, f"trainplan-row{row}.toml")
        except BadInput as e:
            return self._json(HTTPStatus.BAD_REQUEST, {"error": str(e), "field": e.field})
        except ValueError as e:
            return self._json(HTTPStatus.BAD_REQUEST, {"error": str(e), "field": ""})
        return self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {url.path}", "field": ""})

    def _json(self, status: HTTPStatus, body: dict) -> None:
        self._send(status, "application/json", json.dumps(body).encode())

    def _send(self, status: HTTPStatus, kind: str, body: bytes, filename: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        if filename:  # a download the browser saves where its user says: the server writes nothing
            self.send_header("Content-Disposition", f'attachment; filename="{filename}"')
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        pass  # quiet: the page asks on every change


def serve(host: str, port: int) -> ThreadingHTTPServer:
    """The server, bound (port 0: any free one); the caller runs serve_forever."""
    return ThreadingHTTPServer((host, port), Handler)
