"""`trainplan ui`: the planner as a local web page (trainplan/ui/)."""

from __future__ import annotations

import argparse
import logging
import webbrowser

from trainplan.text import ascii_int

HELP = "the planner as a local web page: each device's bar against its capacity as you change the settings"

log = logging.getLogger("trainplan")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=ascii_int, default=8765, help="port to listen on (0: any free port)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1, this machine only; another one serves the page to the network)",
    )
    p.add_argument("--open", action="store_true", help="open the page in the default browser")


def run(args: argparse.Namespace) -> int:
    import sys

    from trainplan import ui

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"trainplan ui: warning: serving on {args.host}: anyone who reaches it can plan with paths on this "
            "machine (the page reads no file but a model path typed in it)",
            file=sys.stderr,
        )
    try:
        server = ui.serve(args.host, args.port)
    except OSError as e:
        from trainplan.errors import ConfigError

        raise ConfigError(
            "--port", f"cannot listen on {args.host}:{args.port} ({e.strerror})", "give another --port"
        ) from None
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
