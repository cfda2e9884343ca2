"""Text that came from users (paths, model names, data sources, error messages) made safe for
where it is shown: Markdown (reports) and the terminal (`runs list|show|compare`); and numbers read
from users' text strictly, in ASCII digits only."""

from __future__ import annotations

import io
import re
import shutil
import sys
import textwrap

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 and C1 controls but tab and newline
_UNIT = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB|s|ms|%)(?!\w)")
_MARKDOWN = re.compile(r"([\\`*_{}\[\]()#+!|~])")


_ASCII_INT = re.compile(r"[-+]?[0-9]+")


def ascii_int(text: str) -> int:
    """An integer written in ASCII digits (an optional sign): Python's int() would also read "٣", "３"
    and "1_000"; ValueError otherwise. Named `int` for argparse's message ("invalid int value")."""
    if not _ASCII_INT.fullmatch(text.strip()):
        raise ValueError(f"not an integer in ASCII digits: {text!r}")
    return int(text)


def ascii_float(text: str) -> float:
    """A number written in ASCII (float()'s syntax otherwise: "nan" and "inf" stay for the caller's own
    range check to name); ValueError for "٣.5" or "1_0"."""
    if not text.isascii() or "_" in text:
        raise ValueError(f"not a number in ASCII: {text!r}")
    return float(text)


ascii_int.__name__, ascii_float.__name__ = "int", "float"


def printable(text: object) -> str:
    """No terminal control sequences: every control character but tab and newline becomes '?'."""
    return _CONTROL.sub("?", str(text))


ECHO = 120  # the most of one piece of user text an error message repeats
_LONG_WORD = re.compile(rf"\S{{{ECHO + 1},}}")
MAX_ERROR_LINES = 5  # a config with many problems: the first ones, and how many more


def escaped(text: object) -> str:
    """Control characters as escapes (ESC is "\\x1b"): user text reaches the terminal inert and readable."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), str(text)).replace("\n", "\\n")


def clip(text: object, limit: int = ECHO) -> str:
    """User text as an error repeats it: escaped, and cut at `limit` characters with "…"."""
    s = escaped(text)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _cut(m: re.Match) -> str:
    """A long run cut with "…", keeping the punctuation that ends it (the "':" after an echoed key)."""
    word = m.group()
    tail = re.search(r"""[:;,.'")\]]{0,3}$""", word).group()
    return word[: ECHO - 1] + "…" + tail


def error_lines(message: str) -> list[str]:
    """An error's lines as printed: control characters escaped, every run of more than ECHO characters
    without a space (an echoed key, value or path) cut with "…", and past MAX_ERROR_LINES lines, a count."""
    lines = [_LONG_WORD.sub(_cut, escaped(line)) for line in message.splitlines()]
    if len(lines) > MAX_ERROR_LINES:
        more = len(lines) - MAX_ERROR_LINES + 1
        lines = [*lines[: MAX_ERROR_LINES - 1], f"and {more:,} more problems of the same input"]
    return lines or [""]


def md(text: object) -> str:
    """A user string inside Markdown: no raw HTML, no markup, no control characters."""
    s = printable(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MARKDOWN.sub(r"\\\1", s).replace("\n", " ")


# ---- terminal tables ------------------------------------------------------------------------

WIDTH = 100  # columns of text written anywhere but a terminal (a pipe, a file, a test)


def is_terminal(output: str | None = None) -> bool:
    """Whether a command's text goes to a terminal: stdout is one and no --output file is given."""
    return not output and sys.stdout.isatty()


def columns(terminal: bool) -> int:
    return shutil.get_terminal_size((WIDTH, 24)).columns if terminal else WIDTH


def render(*items, terminal: bool = False) -> str:
    """Rich renderables (tables, Text) as text. On a terminal: its width, with colour; anywhere
    else: WIDTH columns and no ANSI code at all. Trailing spaces are stripped."""
    from rich.console import Console

    console = Console(
        file=io.StringIO(),
        width=columns(terminal),
        force_terminal=terminal,
        color_system="standard" if terminal else None,
        no_color=not terminal,
        markup=False,
        emoji=False,
        highlight=False,
    )
    with console.capture() as captured:
        for item in items:
            console.print(item)
    return "\n".join(line.rstrip() for line in captured.get().rstrip("\n").splitlines())


def table(*heads: str, **options):
    """A rich table in trainplan's style: a ruled header, no outer frame, columns two apart; a
    cell too wide wraps (never cut with an ellipsis). A column named 'name>' is right-aligned."""
    from rich.box import Box
    from rich.table import Table

    ruled = Box("    \n    \n ── \n    \n ── \n    \n    \n    \n")  # a rule under the header and between sections
    t = Table(box=ruled, show_edge=False, pad_edge=False, collapse_padding=True, header_style="bold", **options)
    for head in heads:
        t.add_column(head.rstrip(">"), justify="right" if head.endswith(">") else "left", overflow="fold")
    return t


def cell(value: object, style: str = ""):
    """A table cell from a user string: inert (no markup, no control characters)."""
    from rich.text import Text

    return Text(printable(value), style=style)


def wrap(text: str, *, indent: str = "", hang: str = "    ", width: int = WIDTH) -> str:
    """A paragraph wrapped to `width` columns, continuation lines hanging under `indent + hang`;
    a number and its unit stay on one line."""
    glued = _UNIT.sub("\\1\xa0\\2", text)
    lines = textwrap.fill(glued, width, initial_indent=indent, subsequent_indent=indent + hang, break_on_hyphens=False)
    return lines.replace("\xa0", " ")
