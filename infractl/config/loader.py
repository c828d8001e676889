"""The guarded config loader: a YAML file is size-, depth- and expansion-checked before it is
parsed, then validated into a pydantic model; every refusal is one ``ConfigError`` naming the file
and the field path. ``cluster.yaml`` and ``run.yaml`` (``cluster.py``, ``run.py``) load through it."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from infractl.errors import ConfigError

if TYPE_CHECKING:  # PyYAML is imported where a file is parsed: every CLI command imports this module
    import yaml

__all__ = [
    "CONFIG_DIR",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
    "load",
    "read_text",
    "rewrite",
    "validate",
]

#: Config files are small; anything larger is refused before it is parsed (parsing a 50 MB YAML
#: file takes half a minute). Nesting and the node count after alias expansion are bounded too:
#: a deep `[[[[...` exhausts the parser's recursion, and a few lines of nested aliases (the
#: "billion laughs") expand into more values than validation could ever walk.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_NODES = 100_000
#: The key of a validation context that holds the folder of the config file being validated.
CONFIG_DIR = "config_dir"
# Longest key shown in a field path of an error message.
_MAX_KEY_SHOWN = 64

_M = TypeVar("_M", bound=BaseModel)


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        key = part if len(part) <= _MAX_KEY_SHOWN else part[:_MAX_KEY_SHOWN] + "…"
        out += f".{key}" if out else key
    return out or "(top level)"


def _loader() -> Any:
    """libyaml's loader when PyYAML has it (about 20x faster), else the pure-Python one: same documents."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_text(path: Path, what: str) -> str:
    """The file's text, refused early when it is missing, special, too big or not UTF-8."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.strerror})", file=str(path)) from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ConfigError(f"{what} file expected, this is {kind}", file=str(path))
    if info.st_size > MAX_CONFIG_BYTES:
        raise _too_big(path, info.st_size)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # the file may have grown since stat()
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.strerror})", file=str(path)) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise _too_big(path, len(data))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (invalid byte at offset {exc.start})", file=str(path)) from None


def _too_big(path: Path, size: int) -> ConfigError:
    return ConfigError(f"{size:,} bytes; a config file may have at most {MAX_CONFIG_BYTES:,} (1 MiB)", file=str(path))


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return ConfigError(f"{where}not valid YAML ({' '.join(str(problem).split())})", file=str(path))


def _check_shape(text: str, path: Path) -> None:
    """Refuse nesting deeper than MAX_CONFIG_DEPTH and more than MAX_CONFIG_NODES values once
    aliases are expanded, from the parser's event stream (iterative: nothing is built yet)."""
    import yaml

    frames: list[tuple[str | None, int]] = []  # (anchor, values so far) per open collection
    sizes: dict[str, int] = {}  # anchor -> values it expands to
    total = 0
    try:
        for event in yaml.parse(text, Loader=_loader()):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                if len(frames) >= MAX_CONFIG_DEPTH:
                    line = event.start_mark.line + 1 if event.start_mark else "?"
                    raise ConfigError(f"line {line}: nested deeper than {MAX_CONFIG_DEPTH} levels", file=str(path))
                frames.append((event.anchor, 1))
                continue
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, count = frames.pop()
                if anchor is not None:
                    sizes[anchor] = count
                added = count
            elif isinstance(event, yaml.ScalarEvent):
                added = 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                added = sizes.get(event.anchor or "", 1)
            else:
                continue
            if frames:
                anchor, count = frames[-1]
                frames[-1] = (anchor, count + added)
            total = max(total, added, sum(count for _anchor, count in frames))
            if total > MAX_CONFIG_NODES:
                raise ConfigError(
                    f"expands to more than {MAX_CONFIG_NODES:,} values (aliases included)", file=str(path)
                )
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None


def load(path: Path, model: type[_M], what: str) -> _M:
    """The config file at ``path`` as ``model``: refused, with one ``ConfigError`` naming the file and
    the field, when it is too big, nested too deep, not YAML or not valid; ``what`` names the kind of file."""
    import yaml

    text = read_text(path, what)
    _check_shape(text, path)
    try:
        raw = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("expected a mapping of fields at the top level", file=str(path))
    return validate(model, raw, path)


def validate(model: type[_M], raw: object, source: Path) -> _M:
    """``raw`` (a mapping, or JSON text) as ``model``; the first error as one ``ConfigError`` naming
    ``source`` and the field path. A validator finds the folder of ``source`` in its context
    (``CONFIG_DIR``): a file a config names by a relative path is relative to the config."""
    context = {CONFIG_DIR: source.parent.absolute()}
    try:
        if isinstance(raw, str):
            return model.model_validate_json(raw, context=context)
        return model.model_validate(raw, context=context)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = _field_path(tuple(err["loc"]))
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise ConfigError(f"{msg}{more}", file=str(source), field=field) from None


_TOP_LEVEL_KEY = re.compile(r"^(?P<key>[A-Za-z_][\w-]*)\s*:")


def rewrite(path: Path, model: type[_M], what: str, changes: dict[str, Any]) -> _M:
    """Set top-level fields of the config file at ``path`` to ``changes`` and return it as
    ``model``. Only their lines change: each field's line (and the indented lines of its block)
    is replaced, a field the file lacks is appended, comments and the other fields stay as they
    are. Nothing is written unless the result loads (``ConfigError`` naming the file otherwise);
    the file is replaced atomically, keeping its mode."""
    import yaml

    text = read_text(path, what)
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    for key, value in changes.items():
        # One line in flow style: a one-item list's text, less its brackets.
        written = f"{key}: {yaml.safe_dump([value], default_flow_style=True, width=1 << 16).strip()[1:-1]}\n"
        starts = [i for i, line in enumerate(lines) if (m := _TOP_LEVEL_KEY.match(line)) and m["key"] == key]
        if not starts:
            lines.append(written)
            continue
        start = starts[0]
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][0].isspace()):
            end += 1
        lines[start:end] = [written]
    new = "".join(lines)
    _check_shape(new, path)
    try:
        raw = yaml.load(new, Loader=_loader())
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    if not isinstance(raw, dict) or any(raw.get(k) != v for k, v in changes.items()):
        raise ConfigError("cannot set its fields in place: write it as one field per line", file=str(path))
    result = validate(model, raw, path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new)
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return result
