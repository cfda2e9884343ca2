"""Reading a data source into documents: files through `datasets`, rows through their format.

A source is "default", a .txt file or a directory of .txt files (hand-read: text needs no
parser), a .jsonl / .json / .parquet / .csv file or a directory of one kind of them (read by
`datasets`), or a dataset id ("owner/name", "owner/name:split") already in the local Hugging Face
cache. Nothing is downloaded.

A row's format comes from its columns (or `data.format`); see `FORMAT_COLUMNS` and run/data.py.
A bad row is refused naming where it is: `file:line` for JSON lines and CSV (the header is line
1), `file row N` for a JSON array, parquet, or a cached dataset.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from trainplan.errors import ConfigError
from trainplan.files import nesting, refuse_special

SOURCE_FIX = 'give a .txt, .jsonl, .json, .parquet or .csv file, a directory of them, or "default"'
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# (format, the columns it needs), in the order `auto` tries them on each row
FORMAT_COLUMNS = (
    ("messages", ("messages",)),
    ("sharegpt", ("conversations",)),
    ("alpaca", ("instruction", "output")),
    ("prompt-completion", ("prompt", "completion")),
    ("text", ("text",)),
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# Stanford Alpaca's prompt, for tokenizers without a chat template (github.com/tatsu-lab/stanford_alpaca)
ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
_HF_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")


@dataclass(frozen=True)
class Document:
    """One unit of the split. A prompt/completion (or Alpaca) row carries both renderings: the
    plain `prompt` + `completion`, and `messages` for tokenizers with a chat template."""

    name: str
    text: str = ""
    prompt: str = ""
    completion: str = ""
    messages: tuple = ()


def read(source: str, fmt: str, field: str, cache_dir: str | None) -> list[Document]:
    """Every document of `source` (errors name `field`: data.source or data.eval_source)."""
    path = Path(source).expanduser()
    if source != "default":
        refuse_special(path, field, SOURCE_FIX)
    plain = path.is_file() and path.suffix not in DATA_SUFFIXES or path.is_dir() and not _data_files(path)
    if fmt not in ("auto", "text") and (plain or source == "default"):
        raise ConfigError(
            "data.format", f"{fmt} needs rows with columns, but {source!r} is plain text", "set data.format = auto"
        )
    if source == "default":
        import pydoc_data.topics as topics

        return [Document(name=k, text=v) for k, v in sorted(topics.topics.items())]
    if path.is_dir():
        return _read_dir(path, fmt, field, cache_dir)
    if path.is_file():
        if path.suffix in DATA_SUFFIXES:
            return _read_file(path, fmt, field, cache_dir)
        return [_plain(path, field, "give a .txt, .jsonl, .json, .parquet or .csv file")]
    if _HF_ID.match(source) and path.suffix not in (*DATA_SUFFIXES, ".txt"):
        return _read_cached_hub(source, fmt, field, cache_dir)
    raise ConfigError(
        field,
        f"no such file or directory {source!r}",
        'give a .txt, .jsonl, .json, .parquet or .csv file, a directory of them, a cached dataset id, or "default"',
    )


def _read_dir(path: Path, fmt: str, field: str, cache_dir: str | None) -> list[Document]:
    files = _data_files(path)
    if not files:
        return [_plain(p, field, "give a directory of UTF-8 .txt files") for p in sorted(path.glob("*.txt"))]
    kinds = {DATA_SUFFIXES[p.suffix] for p in files}
    if len(kinds) > 1 or any(p.suffix == ".txt" for p in path.iterdir()):
        raise ConfigError(
            field,
            f"{str(path)!r} mixes kinds of files ({', '.join(sorted({p.suffix for p in files}))})",
            "give one kind",
        )
    return [d for p in files for d in _read_file(p, fmt, field, cache_dir)]


def _data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)


def _require_text(path: Path, field: str, fix: str) -> None:
    with open(path, "rb") as f:  # the head only: a data file can be gigabytes
        head = f.read(65536)
    if b"\x00" in head:
        raise ConfigError(field, f"{str(path)!r} is binary, not text", fix)


CHECK_WHOLE_BYTES = 16 * 2**20  # a source this small is read as train reads it, every row checked, in seconds


def check(source: str, fmt: str, field: str) -> str | None:
    """train's checks of a data source, for a command that names it without training (advise --data --out):
    a local source up to CHECK_WHOLE_BYTES is read by the very reader train uses (every row, the same one-line
    errors, empty sources refused), into a cache that is thrown away. A larger one, or a dataset in the Hub
    cache, gets the cheap look of `sniff`; the line returned says plainly what was not checked (None: all was)."""
    import tempfile

    if source == "default":
        return None
    path = Path(source).expanduser()
    refuse_special(path, field, SOURCE_FIX)  # before anything stats or opens it
    if not path.exists():
        if _HF_ID.match(source):
            return f"{field}: {source} (a Hub dataset) was not read here; train checks its rows"
        raise ConfigError(field, f"no such file or directory {source!r}", "give a .txt/.jsonl file or a directory")
    files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
    size = sum(p.stat().st_size for p in files)
    if size > CHECK_WHOLE_BYTES:
        sniff(source, field)
        return (
            f"{field}: {source} holds {size / 2**20:,.0f} MiB; only each file's first 64 KiB was checked here "
            "(train checks every row)"
        )
    with tempfile.TemporaryDirectory(prefix="trainplan-check-") as tmp:
        docs = non_empty(read(source, fmt, field, tmp))
    if not docs:
        raise ConfigError(field, f"{source!r} holds no non-empty document", "point it at real text")
    return None


def non_empty(docs: list[Document]) -> list[Document]:
    """The documents with something to train on."""
    return [d for d in docs if d.text.strip() or d.completion.strip() or d.messages]


def sniff(source: str, field: str) -> None:
    """A cheap look at a local data source before a file names it (advise --out): each file's head
    is text and UTF-8, each file of a kind trainplan reads. The full checks run when train reads it."""
    import codecs

    path = Path(source).expanduser()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if p.suffix == ".parquet" or path.is_dir() and p.suffix not in (*DATA_SUFFIXES, ".txt"):
            continue
        _require_text(p, field, "give UTF-8 text, .jsonl, .json, .parquet or .csv data")
        with open(p, "rb") as f:
            head = f.read(65536)
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as e:
            raise ConfigError(field, f"{str(p)!r} is not UTF-8 text (byte {e.start})", "give UTF-8 text") from None


def packing(data_cfg) -> tuple[str, str]:
    return _packing(data_cfg.packing, data_cfg.format, data_cfg.source)


@functools.cache  # the advisor plans thousands of candidates on one data source
def _packing(setting: str, fmt: str, source: str) -> tuple[str, str]:
    """(data.packing as train will resolve it, why), read without loading the data: "auto" is
    "document" for rows with a prompt, a completion or a chat, "concat" for text (run/data.py
    packing_of decides on the documents themselves). A source the plan cannot read cheaply (a cached
    hub dataset) is planned as document packing: the larger bill, its mask included."""
    if setting != "auto":
        return setting, "data.packing"
    if fmt != "auto":
        return ("concat" if fmt == "text" else "document"), f"data.format = {fmt}"
    if source == "default":
        return "concat", "the default data is text"
    path = Path(source).expanduser()
    files = _data_files(path) if path.is_dir() else [path] if path.is_file() else []
    if path.is_file() and path.suffix not in DATA_SUFFIXES or path.is_dir() and not files:
        return "concat", f"{source} is text"
    columns = _first_columns(files[0]) if files else None
    if columns is None:
        return "document", f"{source} not read by the plan: planned as documents, the larger bill"
    fmt = next((f for f, needed in FORMAT_COLUMNS if set(needed) <= columns), "text")
    return ("concat" if fmt == "text" else "document"), f"{files[0].name}'s rows are {fmt}"


def _first_columns(path: Path) -> set[str] | None:
    """The first row's columns of a data file, read cheaply; None where that is not possible."""
    import json

    try:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                line = next((ln for ln in f if ln.strip()), "{}")
            row = json.loads(line)
        elif path.suffix == ".json" and path.stat().st_size <= 16 << 20:
            rows = json.loads(path.read_text(encoding="utf-8"))
            row = rows[0] if isinstance(rows, list) and rows else rows
        elif path.suffix == ".csv":
            with open(path, encoding="utf-8", newline="") as f:
                return set(next(csv.reader(f), []))
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return set(pq.read_schema(path).names)
        else:
            return None
    except (OSError, ValueError, UnicodeDecodeError, IndexError, KeyError, ImportError):
        return None
    return set(row) if isinstance(row, dict) else None


def _utf8(path: Path, field: str) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(field, f"{str(path)!r} is not UTF-8 text (byte {e.start})", "give UTF-8 text") from None


def _plain(path: Path, field: str, fix: str) -> Document:
    """A plain-text document: text, not binary, and UTF-8 (never decoded with replacement characters)."""
    _require_text(path, field, fix)
    return Document(name=path.name, text=_utf8(path, field))


def _read_file(path: Path, fmt: str, field: str, cache_dir: str | None) -> list[Document]:
    kind = DATA_SUFFIXES[path.suffix]
    lines = None
    if kind != "parquet":
        _require_text(path, field, f"give a UTF-8 {path.suffix} file")
        text = _utf8(path, field)
        if not text.strip():
            return []
        if path.suffix == ".jsonl":  # rows are the non-blank lines, as `datasets` reads them
            lines = [n for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if kind == "json":  # checked in Python first: pyarrow's reader crashes the process on some shapes
            check_json_rows(path, text, field)
    import datasets

    reader = {
        "json": datasets.Dataset.from_json,
        "parquet": datasets.Dataset.from_parquet,
        "csv": datasets.Dataset.from_csv,
    }
    extra = {}
    if kind == "csv":  # a cell is text whatever it looks like: "5" stays the string "5"
        header = next(csv.reader(text.splitlines()[:1]), [])
        extra["features"] = datasets.Features({name: datasets.Value("string") for name in header})
    try:
        with quiet():
            table = reader[kind](str(path), cache_dir=cache_dir, **extra)
    except Exception as e:  # datasets wraps pyarrow's parse errors in assorted exceptions
        if path.suffix == ".jsonl":
            _raise_bad_json_line(path, field)
        cause = str(e.__cause__ or e).splitlines()[0] if str(e.__cause__ or e) else type(e).__name__
        raise ConfigError(
            field, f"{path.name}: cannot be read as {path.suffix[1:]} ({cause})", "fix the file"
        ) from None

    def where(i: int) -> str:
        if lines is not None and len(lines) == len(table):
            return f"{path.name}:{lines[i]}"
        if kind == "csv":
            return f"{path.name}:{i + 2}"
        return f"{path.name} row {i + 1}"

    return _documents(table, fmt, field, where, path.name)


MAX_JSON_DEPTH = 32  # a row's nesting: {"messages": [{"content": ...}]} is 3
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def check_json_rows(path: Path, text: str, field: str) -> None:
    """Every row of a .json / .jsonl data file is a JSON object nested at most MAX_JSON_DEPTH deep,
    before `datasets` (pyarrow) sees it: JSON `null` rows and deeply nested objects end the process
    with a segmentation fault there. A .json file is one array of objects, one object, or JSON lines."""
    import json

    def parse(chunk: str, where: str):
        try:
            return json.loads(chunk)
        except RecursionError:
            raise ConfigError(
                field, f"{where}: nested too deeply", f"rows nest at most {MAX_JSON_DEPTH} levels"
            ) from None

    rows: list[tuple[str, object]] = []
    whole = None
    if path.suffix == ".json":
        try:
            whole = parse(text, path.name)
        except json.JSONDecodeError:
            whole = None  # JSON lines in a .json file: read line by line below
    if whole is not None:
        items = whole if isinstance(whole, list) else [whole]
        rows = [(f"{path.name} row {i + 1}", row) for i, row in enumerate(items)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"{path.name}:{n}", parse(line, f"{path.name}:{n}")))
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        field, f"{path.name}:{n}: invalid JSON ({e.msg})", "each line must be one JSON object"
                    ) from None
    for where, row in rows:
        if not isinstance(row, dict):
            shown = "null" if row is None else f"a JSON {_JSON_TYPES.get(type(row), type(row).__name__)}"
            raise ConfigError(field, f"{where}: is not a JSON object ({shown})", 'write {"text": ...} per row')
        if nesting(row, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ConfigError(field, f"{where}: nested too deeply", f"rows nest at most {MAX_JSON_DEPTH} levels")


def _raise_bad_json_line(path: Path, field: str) -> None:
    """Name the first line of a JSON-lines file that is not a JSON object (only after `datasets`
    failed to read it: its own message counts rows within a block, not lines of the file)."""
    import json

    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(
                field, f"{path.name}:{n}: invalid JSON ({e.msg})", "each line must be one JSON object"
            ) from None
        if not isinstance(row, dict):
            raise ConfigError(field, f"{path.name}:{n}: is not a JSON object", 'write {"text": ...} per line')


def _read_cached_hub(source: str, fmt: str, field: str, cache_dir: str | None) -> list[Document]:
    """A dataset already in the local Hugging Face hub cache (as `hf download --repo-type dataset`
    leaves it), read offline: no request leaves the machine."""
    import datasets
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, split = source.partition(":")
    try:
        snapshot = snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ConfigError(
            field,
            f"{source!r} is neither a file nor a dataset in the local Hugging Face cache ({HF_HUB_CACHE})",
            f"download it first (`hf download {repo} --repo-type dataset`) or give a local file",
        ) from None
    try:
        with quiet():
            splits = datasets.load_dataset(snapshot, cache_dir=cache_dir)
    except Exception as e:  # the snapshot's files, in whatever shape they came
        raise ConfigError(field, f"{source!r}: cannot be read ({e})".splitlines()[0], "fix or re-download it") from None
    split = split or ("train" if "train" in splits else next(iter(splits)) if len(splits) == 1 else "")
    if split not in splits:
        raise ConfigError(
            field, f"{source!r} has splits {sorted(splits)}", f"name one, e.g. {repo}:{next(iter(sorted(splits)))}"
        )
    table = splits[split]
    return _documents(table, fmt, field, lambda i: f"{repo}:{split} row {i + 1}", f"{repo}:{split}")


@contextlib.contextmanager
def quiet():
    """`datasets` reports progress bars and logs its own errors; ours are the ConfigErrors."""
    import datasets

    bars = datasets.utils.are_progress_bars_disabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.enable_progress_bars()


def _documents(table, fmt: str, field: str, where, label: str) -> list[Document]:
    columns = set(table.column_names)
    if fmt == "auto":
        candidates = [f for f, needed in FORMAT_COLUMNS if set(needed) <= columns]
        if not candidates:
            raise ConfigError(
                field,
                f"{label} has columns {sorted(columns)}",
                'give "text", "prompt"+"completion", "instruction"+"output" (alpaca), "conversations" (sharegpt) '
                'or "messages" columns, or set data.format',
            )
    else:
        candidates = [fmt]
    needs = dict(FORMAT_COLUMNS)
    docs = []
    for i, row in enumerate(table):
        present = {k for k, v in row.items() if v is not None}
        chosen = next((f for f in candidates if set(needs[f]) <= present), candidates[0])
        docs.append(_document(chosen, row, where(i), field))
    return docs


def _document(fmt: str, row: dict, where: str, field: str) -> Document:
    def string(key: str, *, optional: bool = False) -> str:
        value = row.get(key)
        if value is None:
            if optional:
                return ""
            raise ConfigError(
                field, f'{where}: missing "{key}" ({fmt})', f'give every row a "{key}", or set data.format'
            )
        if not isinstance(value, str):
            raise ConfigError(
                field, f'{where}: "{key}" must be a string (got {type(value).__name__})', f'write "{key}" as text'
            )
        return value

    if fmt == "text":
        return Document(name=where, text=string("text"))
    if fmt == "prompt-completion":
        prompt, completion = string("prompt"), string("completion")
        return Document(name=where, prompt=prompt, completion=completion, messages=_turns(prompt, completion))
    if fmt == "alpaca":
        instruction, extra, output = string("instruction"), string("input", optional=True), string("output")
        plain = (ALPACA_INPUT if extra else ALPACA_NO_INPUT).format(instruction=instruction, input=extra)
        user = f"{instruction}\n\n{extra}" if extra else instruction
        return Document(name=where, prompt=plain, completion=output, messages=_turns(user, output))
    if fmt == "sharegpt":
        return Document(name=where, messages=_sharegpt(row.get("conversations"), where, field))
    return Document(name=where, messages=_messages(row.get("messages"), where, field))


def _turns(user: str, assistant: str) -> tuple:
    return ({"role": "user", "content": user}, {"role": "assistant", "content": assistant})


def _messages(value, where: str, field: str) -> tuple:
    """A chat: a list of {"role": str, "content": str}, as chat templates expect."""
    if isinstance(value, list):  # a column of structs fills keys other rows have with None
        value = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value]
    if (
        not isinstance(value, list)
        or not value
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    ):
        raise ConfigError(
            field,
            f'{where}: messages must be a non-empty list of {{"role": ..., "content": ...}} objects',
            'write e.g. "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]',
        )
    return tuple(value)


def _sharegpt(value, where: str, field: str) -> tuple:
    """ShareGPT's `conversations` ({"from": human | gpt | system, "value": str}) as chat messages."""
    fix = 'write e.g. "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]'
    if not isinstance(value, list) or not value:
        raise ConfigError(field, f'{where}: "conversations" must be a non-empty list of turns (sharegpt)', fix)
    out = []
    for turn in value:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ConfigError(field, f'{where}: a turn must be {{"from": ..., "value": "text"}} (sharegpt)', fix)
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise ConfigError(
                field,
                f"{where}: unknown speaker {turn.get('from')!r} (sharegpt)",
                f"use one of {', '.join(SHAREGPT_ROLES)}",
            )
        out.append({"role": role, "content": turn["value"]})
    return tuple(out)
