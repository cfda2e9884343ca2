"""`trainplan ui`: the planner as a local web page (page.html), served by the standard library.

The page holds no formula. Its state (the fields below, also its URL's query) becomes a `trainplan plan`
command line, which the server parses with the CLI's own parser and plans with the CLI's own code
(commands/plan.py `ledger_of`): the page shows `plan --json`'s numbers, and its "copy as command" is
that line. Bad input gets the CLI's one-line message and a 400; the server keeps serving.

Security: it binds to 127.0.0.1 unless told otherwise (--host warns); it reads a local path only where
the user typed one (the model field, as `plan` does); it writes nothing."""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import sys
import threading
import webbrowser
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from trainplan.errors import ConfigError

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
    except (OSError, OverflowError) as e:
        problem = f"cannot listen on {args.host}:{args.port} ({getattr(e, 'strerror', None) or e})"
        raise ConfigError("--port", problem, "give another --port, or another --host") from None
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


# The page's fields: (query key, the `plan` flag: CONFIG_FLAGS' and SWITCHES').
FIELDS: tuple[tuple[str, str], ...] = (
    ("model", "--model"),
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
# What advise takes of the page's state: the rest (micro-batch, strategy, tp, ...) is what it searches.
ADVISE_FIELDS = ("model", "gpus", "mode", "seq")


class BadInput(ValueError):
    """The page's input refused, with the CLI's one-line message and the field it names."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def argv_of(state: dict[str, str], command: str = "plan", keys=None) -> list[str]:
    """The `trainplan <command>` arguments of a page state (empty fields left to the defaults; keys:
    the fields the command takes, all by default). advise takes the model as its positional argument."""
    unknown = sorted(set(state) - {key for key, _ in FIELDS})
    if unknown:
        raise BadInput(f"unknown field {unknown[0]!r}; the page's fields are {', '.join(k for k, _ in FIELDS)}", "")
    argv = [command]
    for key, flag in FIELDS:
        value = state.get(key, "").strip()
        if not value or (keys is not None and key not in keys):
            continue
        if key in SWITCHES:
            if value not in ("0", "false", "off"):
                argv.append(flag)
        elif key == "model":  # never read as a flag (--data=... would tokenize a file)
            if value.startswith("-"):
                raise BadInput(
                    f"model.source: {value!r} is not a model; give a preset, a directory, a .gguf or a Hub id",
                    "model.source",
                )
            argv += [value] if command == "advise" else [flag, value]
        else:
            argv += [flag, value]
    return argv


def command_of(argv: list[str]) -> str:
    """The shell line that prints the same answer."""
    return shlex.join(["trainplan", *argv])


def _parse(module, argv: list[str]) -> argparse.Namespace:
    """`trainplan <argv>` parsed by the CLI's own parser; its refusal (a bad number) as BadInput, with the
    message the CLI prints."""
    from trainplan.commands._common import Parser, prepare
    from trainplan.text import error_lines

    class PageParser(Parser):
        def error(self, message: str):  # raised, not printed: the server answers many requests at once
            line = " ".join(error_lines(message))
            raise BadInput(f"{line}; see {self.prog} --help", _flag_field(line))

        def exit(self, status=0, message=None):  # --help and the like: no flag of the page asks for them
            raise BadInput(f"{self.prog} takes no such request", "")

    return prepare(PageParser(prog=f"trainplan {argv[0]}"), module).parse_args(argv[1:])


def _flag_field(message: str) -> str:
    """The config key of the flag an argparse message names ("argument --seq: ..." -> batch.seq_len)."""
    from trainplan.commands._common import CONFIG_FLAGS

    for flag, key, _ in CONFIG_FLAGS:
        if f"argument {flag}:" in message:
            return key
    return ""


def plan_json(state: dict[str, str]) -> dict:
    """{"command", "plan"}: the plan `trainplan plan --json` prints for this state (commands/plan.py)."""
    from trainplan.commands import plan

    argv = argv_of(state)
    return {"command": command_of(argv), "plan": plan.ledger_of(_parse(plan, argv)).to_json()}


def _advised(state: dict[str, str]):
    """(advise's argv, its search, its ranked rows) for the page's state: `trainplan advise`'s own code,
    ranked as it ranks by default (the ladder, the rows train runs first)."""
    from trainplan.advise.rank import ranked
    from trainplan.advise.search import search
    from trainplan.commands import advise

    if not state.get("model", "").strip():
        raise BadInput("model.source: advise needs a model; give one in the model field", "model.source")
    argv = argv_of(state, "advise", ADVISE_FIELDS)
    args = _parse(advise, argv)
    s = search(advise.request_from_args(args))
    return argv, s, ranked(s, args.prefer, include_unrunnable=args.include_unrunnable)


def advise_json(state: dict[str, str], top: int = 10) -> dict:
    """{"command", "fit", "entries"}: `trainplan advise`'s ranked rows (its --format json entries)."""
    from trainplan.advise.rank import entry_json

    argv, s, order = _advised(state)
    entries = [entry_json(s, o, i + 1, "ladder") for i, o in enumerate(order[:top])]
    return {"command": command_of(argv), "fit": len(order), "entries": entries}


def advise_toml(state: dict[str, str], row: str) -> tuple[str, str]:
    """(file name, text): row `row` of advise's ranked list as the TOML `advise --out` writes."""
    from trainplan.advise.rank import out_toml
    from trainplan.text import ascii_int

    _, s, order = _advised(state)
    try:
        n = ascii_int(row)
    except ValueError:
        n = 0
    if not 1 <= n <= len(order):
        raise BadInput(f"row: {row!r} is not one of advise's {len(order)} rows; choose 1..{len(order)}", "row")
    name = f"trainplan-row{n}.toml"
    return name, out_toml(s, order[n - 1], n, len(order), "ladder", name)


_TRACING = threading.Lock()  # one trace at a time: it holds the process's one (fake) process group


def trace_json(state: dict[str, str]) -> dict:
    """{"command", "comparison"}: `trainplan trace --json`'s comparison of the traced peak (the real
    model's step on fake tensors) with the analytic one, for the page's state (commands/trace.py)."""
    from trainplan.commands import trace

    argv = ["trace", *argv_of(state)[1:]]
    args = _parse(trace, argv)
    with _TRACING:
        _, comparison = trace.traced_of(args)
    return {"command": command_of(argv), "comparison": comparison}


def answer(ask, *args) -> tuple[HTTPStatus, dict]:
    """(status, body) of one request: the CLI's one-line message for bad input (400) and for a bug
    (500, its traceback saved), as `trainplan` prints them (commands/_common.py `error_text`); the
    server goes on either way."""
    from trainplan.commands._common import error_text

    try:
        return HTTPStatus.OK, ask(*args)
    except BadInput as e:
        return HTTPStatus.BAD_REQUEST, {"error": str(e), "field": e.field}
    except Exception as e:
        users, text = error_text(e)
        status = HTTPStatus.BAD_REQUEST if users else HTTPStatus.INTERNAL_SERVER_ERROR
        field = getattr(e, "field", "model.source" if isinstance(e, OSError) else "")  # a path: the model's
        return status, {"error": text.splitlines()[0], "field": field}


def page() -> bytes:
    return resources.files(__package__).joinpath("page.html").read_bytes()


API = {"/api/plan": plan_json, "/api/advise": advise_json, "/api/trace": trace_json}


class Handler(BaseHTTPRequestHandler):
    server_version = "trainplan-ui"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        if not self.server.serves(self.headers.get("Host", "")):  # another site's page, or DNS rebinding
            return self._json(HTTPStatus.FORBIDDEN, {"error": "this page answers its own address only", "field": ""})
        if url.path == "/":
            return self._send(HTTPStatus.OK, "text/html; charset=utf-8", page())
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        if url.path in API:
            return self._json(*answer(API[url.path], query))
        if url.path == "/api/advise.toml":
            row = query.pop("row", "1")
            status, body = answer(advise_toml, query, row)
            if status != HTTPStatus.OK:
                return self._json(status, body)
            name, text = body
            return self._send(status, "application/toml; charset=utf-8", text.encode(), name)
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


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def serves(self, host_header: str) -> bool:
        """Whether a request's Host header names this server: its own address, or any when it was bound
        to every interface on purpose (--host 0.0.0.0)."""
        bound, port = self.server_address[:2]
        if bound in ("0.0.0.0", "::"):
            return True
        names = {bound, "localhost", "127.0.0.1", "[::1]"} if bound in ("127.0.0.1", "::1") else {bound}
        return host_header in {f"{n}:{port}" for n in names} | {f"[{bound}]:{port}"}


def serve(host: str, port: int) -> Server:
    """The server, bound (port 0: any free one); the caller runs serve_forever."""
    if ":" in host:  # an IPv6 address
        return type("Server6", (Server,), {"address_family": socket.AF_INET6})((host, port), Handler)
    return Server((host, port), Handler)
