"""Reading a RunConfig from TOML, flags and `--set key=value`, and writing one back: every problem
found before one is reported, each naming its field."""

from __future__ import annotations

import dataclasses
import errno
import math
import tomllib
from pathlib import Path
from typing import Any

from trainplan.config.schema import _ALONE, _SECTION_TYPES, _TOP_KEYS, RunConfig
from trainplan.errors import ConfigError, ConfigErrors, nearest
from trainplan.files import parse_nested, special

MAX_NUMBER = 1 << 53  # the largest number a setting may be (exact as a float; every real one is far below)


def _known_keys() -> list[str]:
    keys = [f"run.{k}" for k in _TOP_KEYS] + list(_TOP_KEYS)
    for sec, cls in _SECTION_TYPES.items():
        keys += [f"{sec}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if parts[0] == "run":
        parts = parts[1:]
    if len(parts) == 1 and parts[0] in _TOP_KEYS:
        tree[parts[0]] = value
        return
    if len(parts) != 2 or parts[0] not in _SECTION_TYPES:
        raise ConfigError(dotted, "unknown setting", nearest(dotted, _known_keys()))
    tree.setdefault(parts[0], {})[parts[1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'batch.seq_len=2048' -> ('batch.seq_len', 2048); the value is read as a TOML literal."""
    if "=" not in text:
        raise ConfigError("--set", f"{text!r} is not key=value", "write e.g. --set batch.seq_len=2048")
    key, raw = (s.strip() for s in text.split("=", 1))
    if "\n" in text or "\r" in text:  # TOML would read a second line as a second key
        field = "--set" if "\n" in key or "\r" in key else key
        raise ConfigError(
            field,
            f"the --set {text[:60]!r} holds a control character (a line break), which would set a second key",
            "give one key=value per --set, each on one line",
        )
    try:  # one line of TOML is one key: `v = ...` cannot set another
        value = parse_nested(tomllib.loads, f"v = {raw}", "--set", f"the value of {key[:60]!r}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as lora or H100-80GB
    return key, value


def from_dict(tree: dict) -> RunConfig:
    """Build and validate a RunConfig from a TOML-shaped dict; unknown keys are errors. Every
    problem is found before one is reported: one ConfigError, or ConfigErrors listing them all."""
    tree = dict(tree)
    run = tree.pop("run", {}) or {}
    if not isinstance(run, dict):
        raise ConfigError("run", f"must be a table of settings (got {run!r})", 'write e.g. [run] with mode = "lora"')
    top = {k: tree.pop(k) for k in _TOP_KEYS if k in tree}
    top.update({k: v for k, v in run.items()})
    problems: list[ConfigError] = []
    sections: dict[str, Any] = {}
    for name, body in tree.items():
        cls = _SECTION_TYPES.get(name)
        if cls is not None and not isinstance(body, dict):
            example = next(iter(_field_names(cls)), "...")
            problems.append(
                ConfigError(name, "is a section, not a setting", f"give its settings, e.g. {name}.{example} = ...")
            )
            continue
        if cls is None and (home := _section_of(name)):
            problems.append(
                ConfigError(name, f"belongs in the [{home}] section", f"write it as {home}.{name} (or under [{home}])")
            )
            continue
        if cls is None:
            problems.append(
                ConfigError(name, "unknown section or setting", nearest(name, list(_SECTION_TYPES) + list(_TOP_KEYS)))
            )
            continue
        section = _section(name, cls, body, problems)
        if section is not None:
            sections[name] = section
    for key in top:
        if key not in _TOP_KEYS:
            problems.append(ConfigError(f"run.{key}", "unknown setting", nearest(key, list(_TOP_KEYS))))
            continue
        try:
            check_type(f"run.{key}", "str", top[key])
            RunConfig(**{key: top[key]})
        except ConfigError as e:
            problems.append(e)
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    return RunConfig(**top, **sections)


def _section(name: str, cls: type, body: dict, problems: list[ConfigError]):
    """One section, built; or None with its problems appended: each setting is checked on its own
    (type, finiteness, its own range), so one bad value does not hide the next."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    bad = []
    for key, value in body.items():
        where = f"{name}.{key}"
        try:
            if key not in fields:
                raise ConfigError(where, "unknown setting", nearest(where, sorted(f"{name}.{a}" for a in fields)))
            if isinstance(value, float) and not math.isfinite(value):  # nan and inf pass every range check
                raise ConfigError(where, f"must be a finite number (got {value})", "give a finite value")
            if isinstance(value, int | float) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
                # past 2^53 an integer is no longer exact as a float, and every setting is far below it
                digits = len(str(int(abs(value))))
                raise ConfigError(where, f"is a {digits}-digit number, past any meaning", "give a value below 2^53")
            check_type(where, fields[key], value)
            _ALONE[0] = True
            try:
                cls(**{key: value})
            finally:
                _ALONE[0] = False
        except ConfigError as e:
            if e.field == where or key not in fields:
                problems.append(e)
                bad.append(key)
    if bad:
        return None
    try:  # what only the settings together can break
        return cls(**body)
    except ConfigError as e:
        problems.append(e)
    except TypeError as e:  # a wrong type the dataclass itself rejected
        problems.append(ConfigError(name, str(e), "check the section's value types"))
    return None


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def check_type(where: str, annotation: str, value: Any) -> None:
    """`value` has the field's declared type (annotations are strings here: "int", "float",
    "bool", "str", "list[str]", "int | None"). A string where a list is expected is refused rather
    than split into letters; an int is a valid float; no bool is an int."""
    kinds = [a.strip() for a in str(annotation).split("|")]
    if "None" in kinds and value is None:
        return
    for kind in kinds:
        if kind == "bool" and isinstance(value, bool):
            return
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
            return
        if kind == "str" and isinstance(value, str):
            return
        if kind == "list[str]" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return
    want = " or ".join(_TYPE_WORDS.get(k, "a list of strings" if k == "list[str]" else k) for k in kinds if k != "None")
    example = {"list[str]": '["q_proj", "v_proj"]', "bool": "true", "str": '"..."'}.get(kinds[0], "1")
    raise ConfigError(where, f"must be {want} (got {value!r})", f"write e.g. {where} = {example}")


def load(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), settings: dict[str, Any] | None = None
) -> RunConfig:
    """Read a TOML config (or start from defaults), apply typed `settings` (from CLI flags),
    then `key=value` overrides (--set), which win."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        try:
            tree = parse_nested(tomllib.loads, read_config_text(p), "config", repr(str(p))[:120])
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("config", f"{str(p)!r} is invalid TOML ({e})", "fix the syntax") from None
    for key, value in (settings or {}).items():
        _set_dotted(tree, key, value)
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    return from_dict(tree)


def _section_of(key: str) -> str | None:
    """The section a top-level key belongs in ('micro_batch_size' -> 'batch'), if exactly one has it."""
    homes = [s for s, cls in _SECTION_TYPES.items() if key in _field_names(cls)]
    return homes[0] if len(homes) == 1 else None


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def read_config_text(p: Path) -> str:
    """A TOML config's text, each way a path can fail named as itself: missing, a directory, a dangling
    symlink or a loop, unreadable, not UTF-8 (a UTF-8 byte-order mark is accepted, UTF-16 named)."""
    shown = repr(str(p))[:120]
    what = special(p)
    if what:  # a FIFO or a device is never opened: the read would wait, or never end
        raise ConfigError("config", f"{shown} {what}, not a file", "pass the path of a TOML file")
    if p.is_symlink() and not p.exists():
        try:
            p.stat()
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError("config", f"{shown} is a symlink loop", "pass the path of a TOML file") from None
        raise ConfigError("config", f"{shown} is a symlink to nothing", "pass the path of a TOML file") from None
    if p.is_dir():
        raise ConfigError("config", f"{shown} is a directory", "pass the path of a TOML file in it")
    if not p.exists():
        raise ConfigError("config", f"no such file {shown}", "pass the path of a TOML config")
    if not p.is_file():
        raise ConfigError("config", f"{shown} is not a regular file", "pass the path of a TOML file")
    try:
        data = p.read_bytes()[: MAX_CONFIG_BYTES + 1]
    except OSError as e:
        raise ConfigError("config", f"cannot read {shown} ({e.strerror})", "check its permissions") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{shown} is over {MAX_CONFIG_BYTES >> 20} MiB", "a config is a few KiB of TOML")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise ConfigError("config", f"{shown} is UTF-16 text", "save it as UTF-8")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark, as some editors write
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{shown} is not UTF-8 text (byte {e.start})", "save it as UTF-8") from None


MAX_CONFIG_BYTES = 4 << 20


def toml_literal(v: Any) -> str:
    """A value as a TOML literal (what `--set key=VALUE` and config files read)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_literal(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: RunConfig) -> str:
    """Write a RunConfig as TOML that `load` reads back to an equal object."""
    lit = toml_literal
    d = cfg.to_dict()
    lines = [f"{k} = {lit(d.pop(k))}" for k in _TOP_KEYS]
    for sec, body in d.items():
        lines += ["", f"[{sec}]"] + [f"{k} = {lit(v)}" for k, v in body.items() if v is not None]
    return "\n".join(lines) + "\n"
