"""Files that are never half-written: atomic replace, fsync, content hashes."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from trainplan.errors import ConfigError


def write_atomic(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, fsync, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (POSIX needs the directory fsynced too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def short_hash(obj: str | bytes, length: int = 16) -> str:
    """A stable short fingerprint of a string (a config, a model description)."""
    return hashlib.sha256(obj.encode() if isinstance(obj, str) else obj).hexdigest()[:length]


def require_writable(path: str | Path, field: str) -> None:
    """Refuse a directory this process cannot create or write, before any work starts, and
    without creating anything: a probe file in its nearest existing ancestor, removed at once."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(field, f"{str(path)!r} cannot be created: {str(probe)!r} is a file", "choose a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(
            field, f"{str(path)!r} is not writable ({e.strerror})", "choose a directory this user can write"
        ) from None
