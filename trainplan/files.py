"""Files that are never half-written: atomic replace, fsync, content hashes."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from trainplan.errors import ConfigError


def write_atomic(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, fsync, then rename: never a half-written file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as e:  # named as the path the caller gave, not the temporary sibling
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide reports from the user's group
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """A directory written in full or not at all: the caller fills the temporary directory this
    yields, beside `out`; its files are fsynced and it is renamed into place only if the block
    finishes. An existing `out` is moved aside first (a crash leaves one of the two), then removed."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    except OSError as e:  # named as the path the caller gave, not the temporary sibling
        raise OSError(e.errno, e.strerror, str(out)) from None
    try:
        mask = _umask()
        tmp.chmod(0o777 & ~mask)  # mkdtemp's 0700 would hide the directory from the user's group
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                f.chmod(0o666 & ~mask)  # some writers (safetensors) leave 0600
                fsync_file(f)
        try:
            fsync_dir(tmp)
            old = None
            if out.exists():
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                os.replace(out, old)
            os.replace(tmp, out)
            fsync_dir(out.parent)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(out)) from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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


def sha256_file(path: Path, *, again: bool = True) -> str:
    """The file's SHA-256. again=False: the sum this process last computed for it, where the file
    system says the file is the one it read then (device, inode, size, mtime and ctime unchanged: any
    write moves ctime, which no user call can set back), so a checkpoint's parts are read once per
    process, not at every later look (keep_last's pruning, the space estimate). A new process reads
    every file it checks."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if not again and key in _SUMS:
        return _SUMS[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if len(_SUMS) >= 4096:  # a long run's pruned checkpoints: their entries are never asked for again
        _SUMS.clear()
    _SUMS[key] = h.hexdigest()
    return _SUMS[key]


_SUMS: dict[tuple[int, ...], str] = {}


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


class DirLock:
    """One live writer per directory: `<dir>/.trainplan.lock` holds the writer's pid, host and
    start time, created exclusively. A lock whose process is gone (same host, pid not alive, or
    an unreadable lock file) is stale and taken over; a live one refuses the second run, naming it."""

    NAME = ".trainplan.lock"

    def __init__(self, directory: str | Path, field: str) -> None:
        self.path = Path(directory) / self.NAME
        self.field = field
        self.held = False

    def acquire(self) -> DirLock:
        import json
        import socket
        import time

        missing, d = [], self.path.parent.absolute()
        while not d.exists() and d != d.parent:
            missing.append(d)
            d = d.parent
        self.created = missing  # removed again on release if the run left them empty
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None or (holder["host"] == me["host"] and not pid_alive(holder["pid"])):
                    self.path.unlink(missing_ok=True)  # stale: its run is gone
                    continue
                raise ConfigError(
                    self.field,
                    f"{str(self.path.parent)!r} is in use by another run (pid {holder['pid']} on {holder['host']}, "
                    f"started {holder.get('started', '?')})",
                    f"wait for it to finish or give this run its own --output-dir; if that run is gone, "
                    f"remove {str(self.path)!r}",
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise ConfigError(self.field, f"cannot take the lock {str(self.path)!r}", "retry, or remove the lock file")

    def _holder(self) -> dict | None:
        import json

        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder.get("pid"), int) and isinstance(holder.get("host"), str) else None
        except (OSError, ValueError, AttributeError):
            return None

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
            for d in getattr(self, "created", []):  # innermost first; a directory the run wrote to stays
                try:
                    d.rmdir()
                except OSError:
                    break


def pid_alive(pid: int) -> bool:
    """Whether a process of this host is running (a signal-0 probe)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


MAX_NESTING = 64  # no file trainplan reads nests deeper: a chat row is 3, a config 3, a record 6


def special(path: str | Path) -> str | None:
    """What a path is when it is neither a regular file, a directory nor missing, as words that follow its
    name: 'is a FIFO (a named pipe)', 'is a character device', 'is a symlink loop'. Read by stat alone,
    never opened: a reader that opened a FIFO would wait for a writer, and one that read /dev/zero would
    never finish. None for a file, a directory or nothing there (each reader names those itself)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return "is a symlink loop" if e.errno == errno.ELOOP else None
    except ValueError:  # a NUL in the path: no file can have that name
        return None
    for test, what in (
        (stat.S_ISFIFO, "is a FIFO (a named pipe)"),
        (stat.S_ISCHR, "is a character device"),
        (stat.S_ISBLK, "is a block device"),
        (stat.S_ISSOCK, "is a socket"),
    ):
        if test(mode):
            return what
    return None


def refuse_special(path: str | Path, field: str, fix: str) -> None:
    """A ConfigError naming `field`, the path and what it is, where `special` finds it is no file to read."""
    what = special(path)
    if what:
        raise ConfigError(field, f"{str(path)!r} {what}, not a file trainplan can read", fix)


def parse_nested(parse, text: str, field: str, what: str):
    """parse(text), with nesting bounded: a document nested past MAX_NESTING levels is bad input named
    by its field and file, not a RecursionError in the parser or in whatever walks the result."""
    try:
        value = parse(text)
    except RecursionError:
        value = None
        depth = MAX_NESTING + 1
    else:
        depth = nesting(value)
    if depth > MAX_NESTING:
        raise ConfigError(field, f"{what} is nested too deeply", f"a valid file nests at most {MAX_NESTING} levels")
    return value


MAX_JSON_BYTES = 64 * 2**20  # a record, a checkpoint's state or manifest, a config.json: kilobytes


def read_text(path: Path, field: str, *, max_bytes: int = MAX_JSON_BYTES) -> str:
    """A small text file from outside (prompts, a record): size bounded, not binary, UTF-8; a bad
    file is a ConfigError naming `field` and the file."""
    refuse_special(path, field, "give a regular file")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ConfigError(field, f"{str(path)!r} is {size:,} bytes, past {max_bytes:,}", "give a smaller file")
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(field, f"cannot read {str(path)!r} ({e.strerror})", "give a readable file") from None
    if b"\x00" in data:
        raise ConfigError(field, f"{str(path)!r} is binary, not text", "give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            field, f"{str(path)!r} is not UTF-8 text (byte {e.start})", "give a UTF-8 text file"
        ) from None


def read_json(path: Path, field: str, *, max_bytes: int = MAX_JSON_BYTES):
    """The JSON document in a file trainplan reads back (a run's record, a checkpoint's state): size and
    nesting bounded before and while parsing, UTF-8 only. A bad file is a ConfigError naming `field`
    and the file; the caller checks the shape it needs."""
    text = read_text(path, field, max_bytes=max_bytes)
    try:
        return parse_nested(json.loads, text, field, repr(str(path)))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(
            field, f"{str(path)!r} is not valid JSON ({str(e)[:80]})", "give the file trainplan wrote"
        ) from None


# bytes per element of every dtype the safetensors format names
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2}
SAFETENSORS_DTYPES |= {"BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit


def safetensors_header(path: Path) -> tuple[dict, int, int]:
    """The tensors a .safetensors file declares, checked before anything trusts them: (entries,
    data_start, file size). Format: an 8-byte little-endian header length, a JSON object of
    {name: {dtype, shape, data_offsets}} (and "__metadata__"), then the data. Each entry has a known
    dtype, a shape of counts, and offsets inside the data that its shape fills exactly. A ValueError
    says what is wrong."""
    what = special(path)
    if what:
        raise ValueError(f"it {what}, not a file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ValueError(f"its header length ({n}) does not fit the file ({size} bytes)")
        try:
            header = parse_nested(json.loads, f.read(n).decode("utf-8"), path.name, "its header")
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"its header is not readable JSON ({str(e).split(';')[0][:80]})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - n
    for name, t in entries.items():
        label = repr(str(name)[:60])
        if not isinstance(t, dict) or t.get("dtype") not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {label} has no known dtype")
        shape, offsets = t.get("shape"), t.get("data_offsets")
        counts = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        spans = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        if not (counts and spans and 0 <= offsets[0] <= offsets[1] <= data):
            raise ValueError(f"tensor {label} has a bad shape or data offsets")
        if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_DTYPES[t["dtype"]]:
            raise ValueError(f"tensor {label} holds {offsets[1] - offsets[0]} bytes for its shape {shape}")
    return entries, 8 + n, size


def nesting(value, limit: int = MAX_NESTING) -> int:
    """How deep a parsed JSON or TOML value nests (dicts and lists), without recursion; stops counting
    past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list | tuple):
            deepest = max(deepest, d)
            if d > limit:
                return d
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest
