"""Text that came from users (paths, model names, data sources, error messages) made safe for
where it is shown: Markdown (reports) and the terminal (`runs list|show|compare`)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 and C1 controls but tab and newline
_MARKDOWN = re.compile(r"([\\`*_{}\[\]()#+!|~])")


def printable(text: object) -> str:
    """No terminal control sequences: every control character but tab and newline becomes '?'."""
    return _CONTROL.sub("?", str(text))


def md(text: object) -> str:
    """A user string inside Markdown: no raw HTML, no markup, no control characters."""
    s = printable(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MARKDOWN.sub(r"\\\1", s).replace("\n", " ")
