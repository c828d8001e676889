"""Property-based tests over the whole CLI: generated config files and command lines.

Documents are generated from the JSON Schemas in schemas/ (hypothesis-jsonschema) and then
mutated: wrong types, out-of-range and huge numbers, unknown and misspelled keys, deep nesting,
unicode and control characters, NUL bytes, invalid UTF-8, markup-like text and alias bombs.
Command lines are built from every command's options, with mutated values, missing and extra
arguments. A share of the examples runs against a real cluster whose store is unreachable.

For every example:
- the exit code is 0 or 2 (1 only against the unreachable store),
- no traceback, and at most three non-empty lines on stderr,
- with ``--json``, stdout is empty or one JSON document,
- when refused (2), or failed on the unreachable store (1), the state directory is byte-identical.

Examples run the CLI in this process (``infractl.cli.main``, as the console script does) so a
budget of hundreds fits in CI; ``pytest --hypothesis-profile=long tests/test_properties.py`` runs
thousands (profiles in conftest.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from infractl.config import MAX_CONFIG_BYTES, NAME_PATTERN
from infractl.drill import KINDS
from infractl.output import printable

from conftest import OUTAGE_RUN, REPO, Outage, Outcome, run_cli, store_down_cluster

pytestmark = pytest.mark.xdist_group("properties")

RUN_SCHEMA = json.loads((REPO / "schemas" / "run.schema.json").read_text())
CLUSTER_SCHEMA = json.loads((REPO / "schemas" / "cluster.schema.json").read_text())


# --- running the CLI and checking the contract --------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple[str, int, str]]:
    """Every path under ``root``: kind, mode and content hash (not times: a refusal may read)."""
    found: dict[str, tuple[str, int, str]] = {}
    if not root.exists():
        return found
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if path.is_symlink():
            found[str(path.relative_to(root))] = ("link", info.st_mode, os.readlink(path))
        elif path.is_dir():
            found[str(path.relative_to(root))] = ("dir", info.st_mode, "")
        else:
            found[str(path.relative_to(root))] = ("file", info.st_mode, hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def check(args: list[str], outcome: Outcome, *, allowed: set[int], before: dict[str, Any], home: Path) -> None:
    event(f"{args[0] if args else '(none)'} exit {outcome.code}")
    detail = (
        f"infractl {args!r}\nexit {outcome.code}\nstdout:\n{outcome.stdout[-3000:]}\nstderr:\n{outcome.stderr[-3000:]}"
    )
    assert "Traceback" not in outcome.stderr, detail
    assert outcome.code in allowed, detail
    assert len([line for line in outcome.stderr.splitlines() if line.strip()]) <= 3, detail
    if json_requested(args) and outcome.stdout.strip():
        result = json.loads(outcome.stdout)  # one document, or this raises
        if outcome.code != 0:
            # The human line says exactly what the JSON says: nothing of the message was taken
            # for markup, an emoji code or a terminal escape.
            message = result["error"]["message"]
            assert result["error"]["exit_code"] == outcome.code, detail
            assert outcome.stderr.strip().splitlines()[-1] == f"error: {printable(message)}", detail
    if outcome.code in (1, 2):  # refused, or failed on the unreachable store: nothing changed
        assert snapshot(home) == before, detail


# Options that take a value: the word after one is its value, even if it reads "--json".
VALUE_OPTIONS = {
    "--device",
    "--gpus-per-node",
    "--max-nodes",
    "--cluster",
    "-c",
    "--node",
    "-n",
    "--run",
    "-r",
    "--tail",
    "--out",
    "-o",
    "--val-fraction",
    "--include",
    "--timeout",
    "--repeat",
    "--seconds",
    "--log-format",
    "--nodes",
    "--steps",
    "--step",
    "--format",
    "--prompt",
    "-p",
    "--tokens",
    "--temperature",
    "-t",
    "--seed",
}


def json_requested(args: list[str]) -> bool:
    """Whether the command line asks for ``--json`` (as a flag, not as another option's value)."""
    skip = False
    for word in args:
        if word == "--":
            return False
        if skip:
            skip = False
        elif word == "--json":
            return True
        else:
            skip = word in VALUE_OPTIONS
    return False


@contextlib.contextmanager
def held_locks(home: Path, names: set[str]) -> Iterator[None]:
    """Hold the lock of each named cluster, as a running `infractl up` would: any command that
    gets as far as changing one of them is refused (LockedError) instead of provisioning."""
    fds = []
    try:
        for name in sorted(names):
            (home / name).mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(home / name / "lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fds.append(fd)
        yield
    finally:
        for fd in fds:
            os.close(fd)


# --- generated values ------------------------------------------------------------------------------

MARKUP_LIKE = ["[red]x[/red]", "[/PREFIX]", "s3://BUCKET[/PREFIX]", ":smile:", "[bold]", "[", "]", "\\[x]"]
CONTROL = ["\x1b[31m", "\r\n", "\t", "\x07", "\x7f", "\u2028", "\x9b", "a\x00b"]
UNICODE = ["é", "💥", "\u202e", "ｎｏｄｅ", "名前", "\ufeff"]
HUGE_NUMBERS = [10**30, -(10**30), 2**63, 2**64, -1, 0, 10**9 + 1]
FLOATS_TEXT = ["nan", "inf", "-inf", "1e999", "-0", "0.0", "1e-400"]

text_values = st.one_of(
    st.sampled_from(MARKUP_LIKE + CONTROL + UNICODE + FLOATS_TEXT + ["", "-", "--", "../../etc", "a" * 3000]),
    st.sampled_from([str(n) for n in HUGE_NUMBERS]),
    st.text(max_size=20),
)
# argv cannot carry a NUL byte: the OS ends the argument there.
arg_text = text_values.map(lambda s: s.replace("\x00", ""))


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


config_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HUGE_NUMBERS),
    st.floats(),
    text_values,
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
    st.integers(min_value=30, max_value=80).map(nested),
)


def misspell(key: str, data: st.DataObject) -> str:
    if len(key) > 1 and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(key) - 1))
        return key[:i] + key[i + 1 :]
    return key + data.draw(st.sampled_from(["s", "_", "X", "é"]))


def mutate(doc: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """Apply one to three mutations at random places in ``doc`` (a copy)."""
    doc = json.loads(json.dumps(doc))
    for _ in range(data.draw(st.integers(1, 3))):
        target = doc
        while data.draw(st.booleans()):  # walk into a nested mapping now and then
            inner = [k for k, v in target.items() if isinstance(v, dict)]
            if not inner:
                break
            target = target[data.draw(st.sampled_from(sorted(inner)))]
        keys = sorted(target)
        op = data.draw(st.sampled_from(["replace", "unknown", "misspell", "delete"] if keys else ["unknown"]))
        if op == "replace":
            target[data.draw(st.sampled_from(keys))] = data.draw(config_values)
        elif op == "unknown":
            target[data.draw(text_values)] = data.draw(config_values)
        elif op == "misspell":
            key = data.draw(st.sampled_from(keys))
            target[misspell(key, data)] = target.pop(key)
        else:
            del target[data.draw(st.sampled_from(keys))]
    return doc


ALIAS_BOMB = (
    "\n".join(
        ["lol0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
        + [f"lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 7)]
    )
    + "\n"
)


def document(schema: dict[str, Any], data: st.DataObject) -> bytes:
    """A config file: a schema-valid document, usually mutated, sometimes broken as text."""
    doc = data.draw(from_schema(schema))
    if data.draw(st.integers(0, 9)) > 1:
        doc = mutate(doc, data)
    text = yaml.safe_dump(doc, allow_unicode=data.draw(st.booleans())).encode()
    how = data.draw(st.sampled_from(["as-is"] * 6 + ["nul", "latin1", "tab", "alias-bomb", "unclosed", "huge"]))
    if how == "nul":
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + b"\x00" + text[at:]
    elif how == "latin1":
        text += b"# caf\xe9\n"
    elif how == "tab":
        text = text.replace(b"\n", b"\n\t", 1)
    elif how == "alias-bomb":
        text += ALIAS_BOMB.encode()
    elif how == "unclosed":
        text += b"extra: [1, {a: \n"
    elif how == "huge":
        text += b"#" + b"x" * MAX_CONFIG_BYTES + b"\n"
    return text


# --- generated command lines ---------------------------------------------------------------

FLAG = None  # an option that takes no value


def ints() -> st.SearchStrategy[str]:
    return st.one_of(st.integers(-5, 10**6).map(str), arg_text)


def floats() -> st.SearchStrategy[str]:
    return st.one_of(st.floats(allow_nan=True).map(repr), arg_text)


names = st.one_of(st.sampled_from(["node-0", "node-1", "node-7", "tiny", "local", "outage-file"]), arg_text)
log_formats = st.one_of(st.sampled_from(["console", "json"]), arg_text)


def drill_options(kind: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "--run": names,
        "--cluster": None,
        "--timeout": floats(),
        "--repeat": ints(),
        "--wait": FLAG,
        "--no-wait": FLAG,
        "--json": FLAG,
    }
    if KINDS[kind].targets_node:
        options["--node"] = names
    else:
        options["--seconds"] = floats()
    return options


# command words -> (positional value strategies, option -> value strategy or FLAG); "--cluster"
# values and RUN.yaml files are drawn per share (see ``command_line``).
COMMANDS: dict[tuple[str, ...], tuple[list[Any], dict[str, Any]]] = {
    ("up",): ([], {"--cluster": None, "--json": FLAG}),
    ("teardown",): ([], {"--cluster": None, "--yes": FLAG, "--purge": FLAG, "--json": FLAG}),
    ("status",): ([], {"--cluster": None, "--json": FLAG}),
    ("logs",): ([], {"--cluster": None, "--node": names, "--run": names, "--tail": ints()}),
    ("metrics",): ([names], {"--cluster": None, "--json": FLAG}),
    ("train",): (
        ["RUN_FILE"],
        {
            "--cluster": None,
            "--new": FLAG,
            "--detach": FLAG,
            "--yes": FLAG,
            "--json": FLAG,
            "--log-format": log_formats,
        },
    ),
    ("rejoin",): ([names], {"--run": names, "--cluster": None, "--json": FLAG, "--log-format": log_formats}),
    ("data", "prepare"): (
        [st.one_of(st.sampled_from(["corpus.txt", "nowhere", "."]), arg_text)],
        {
            "--out": st.one_of(st.just("ds"), arg_text),
            "--val-fraction": floats(),
            "--include": arg_text,
            "--json": FLAG,
        },
    ),
    ("schema",): ([], {"--out": st.one_of(st.just("schemas-out"), arg_text)}),
    ("reference",): ([], {"--out": st.one_of(st.just("reference-out.md"), arg_text)}),
    ("plan",): (
        ["RUN_FILE"],
        {
            "--device": st.one_of(st.sampled_from(["cpu", "h100-80gb", "b200"]), arg_text),
            "--gpus-per-node": ints(),
            "--max-nodes": ints(),
            "--explain": FLAG,
            "--json": FLAG,
        },
    ),
    ("bench",): (
        ["RUN_FILE"],
        {
            "--nodes": st.one_of(st.sampled_from(["1", "1,2", "2,1", "1,3", "0", "1,1", "1,,2", "x"]), arg_text),
            "--cluster": None,
            "--steps": ints(),
            "--strong": FLAG,
            "--json": FLAG,
        },
    ),
    ("profile",): (
        [names],
        {
            "--steps": st.one_of(st.sampled_from(["3:5", "5:3", "0:1", "1:100", "7", "40:45"]), arg_text),
            "--cluster": None,
            "--timeout": floats(),
            "--json": FLAG,
        },
    ),
    ("export",): (
        [names],
        {
            "--out": st.one_of(st.sampled_from(["model.safetensors", "corpus.txt", "nowhere/m.pt"]), arg_text),
            "--step": ints(),
            "--format": st.one_of(st.sampled_from(["safetensors", "torch"]), arg_text),
            "--force": FLAG,
            "--cluster": None,
            "--json": FLAG,
        },
    ),
    ("sample",): (
        [names],
        {
            "--prompt": arg_text,
            "--tokens": ints(),
            "--temperature": floats(),
            "--seed": ints(),
            "--step": ints(),
            "--cluster": None,
            "--json": FLAG,
        },
    ),
    ("bundle",): (
        [],
        {
            "--run": names,
            "--out": st.one_of(st.just("handover-out"), arg_text),
            "--cluster": None,
            "--json": FLAG,
        },
    ),
    **{("drill", kind): ([], drill_options(kind)) for kind in KINDS},
}


@dataclass(frozen=True)
class Share:
    """Where a command line runs: its state root, which clusters its -c may name, which
    commands it may run (never one that would provision or destroy the shared cluster)."""

    home: Path
    clusters: list[str]
    commands: list[tuple[str, ...]]
    allowed: set[int]


def command_line(share: Share, data: st.DataObject, scratch: Path) -> list[str]:
    words = data.draw(st.sampled_from(share.commands))
    positionals, options = COMMANDS[words]
    args = list(words)
    for value in positionals:
        if data.draw(st.integers(0, 9)) == 0:
            continue  # a missing argument
        if value == "RUN_FILE":
            run = scratch / "run.yaml"
            # A generated file, or the real tiny run (valid: it gets as far as the store).
            run.write_bytes(document(RUN_SCHEMA, data) if data.draw(st.booleans()) else OUTAGE_RUN.encode())
            args.append(data.draw(st.sampled_from([str(run), "missing.yaml"])))
        else:
            args.append(data.draw(value))
    for option in data.draw(st.lists(st.sampled_from(sorted(options)), max_size=4, unique=True)):
        args.append(option)
        if option == "--cluster":
            args.append(data.draw(st.one_of(st.sampled_from(share.clusters), arg_text)))
        elif options[option] is not FLAG:
            if data.draw(st.integers(0, 19)):  # else: the option's value is missing
                args.append(data.draw(options[option]))
    mutation = data.draw(
        st.sampled_from(["none"] * 6 + ["drop", "duplicate", "unknown-option", "json", "unknown-command"])
    )
    if mutation == "drop" and len(args) > 1:
        del args[data.draw(st.integers(0, len(args) - 1))]
    elif mutation == "duplicate":
        args.append(data.draw(st.sampled_from(args)))
    elif mutation == "unknown-option":
        args.insert(
            data.draw(st.integers(1, len(args))), data.draw(st.sampled_from(["--frobnicate", "-z", "--json=1"]))
        )
    elif mutation == "json":
        args.append("--json")
    elif mutation == "unknown-command":
        args[0] = data.draw(arg_text)
    return args


# --- the shares -------------------------------------------------------------------------------------

SAFE_EVERYWHERE = [w for w in COMMANDS if w != ("teardown",)]


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    with store_down_cluster(tmp_path_factory.mktemp("properties-outage"), "file") as down:
        yield down


@contextlib.contextmanager
def scratch_dir(parent: Path) -> Iterator[Path]:
    """A fresh working directory per example, with one small text file to prepare data from."""
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        path = Path(tmp)
        (path / "corpus.txt").write_text("hello world\n" * 20)
        yield path


def run_and_check(share: Share, args: list[str], scratch: Path) -> None:
    # `up` with a valid file gets as far as the lock, which the test holds, as a concurrent
    # `infractl up` would: refused, never provisioned.
    lock = {"local"} if args[:1] == ["up"] else set()
    if args[:1] == ["up"] and "--cluster" in args[:-1]:
        lock.add(_cluster_name(args[args.index("--cluster") + 1]))
    with held_locks(share.home, lock):
        before = snapshot(share.home)
        outcome = run_cli(args, home=share.home, cwd=scratch)
    check(args, outcome, allowed=share.allowed, before=before, home=share.home)


@given(data=st.data())
def test_generated_run_files_are_refused_in_one_line(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    base = tmp_path_factory.getbasetemp()
    share = Share(base / "nothing-up" / ".infractl", ["local"], [("train",)], {2})
    with scratch_dir(base) as scratch:
        run = scratch / "run.yaml"
        run.write_bytes(document(RUN_SCHEMA, data))
        args = [
            "train",
            str(run),
            *data.draw(st.lists(st.sampled_from(["--json", "--new", "--yes", "--detach"]), max_size=2, unique=True)),
        ]
        run_and_check(share, args, scratch)


def _cluster_name(option: str) -> str:
    """The cluster ``-c OPTION`` would create (to hold its lock), when it can be told."""
    try:
        doc = yaml.safe_load(Path(option).read_bytes())
    except Exception:
        return "local"
    name = doc.get("name", "local") if isinstance(doc, dict) else "local"
    return name if isinstance(name, str) and re.fullmatch(NAME_PATTERN, name) else "local"


@given(data=st.data())
def test_generated_cluster_files_are_refused_in_one_line(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    base = tmp_path_factory.getbasetemp()
    share = Share(base / "nothing-up" / ".infractl", ["local"], [("up",)], {0, 2})  # 0: `status`
    with scratch_dir(base) as scratch:
        cluster = scratch / "cluster.yaml"
        cluster.write_bytes(document(CLUSTER_SCHEMA, data))
        command = data.draw(st.sampled_from([["up"], ["status"], ["teardown", "--yes"], ["logs"], ["metrics", "tiny"]]))
        args = [*command, "--cluster", str(cluster), *data.draw(st.lists(st.just("--json"), max_size=1))]
        run_and_check(share, args, scratch)


@given(data=st.data())
def test_generated_command_lines_with_nothing_up(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    base = tmp_path_factory.getbasetemp()
    share = Share(base / "nothing-up" / ".infractl", ["local", "c1"], list(COMMANDS), {0, 2})
    with scratch_dir(base) as scratch:
        run_and_check(share, command_line(share, data, scratch), scratch)


@pytest.mark.cluster
@given(data=st.data())
def test_generated_command_lines_against_an_unreachable_store(
    outage: Outage, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    share = Share(outage.cli.home, [outage.cluster, "local"], SAFE_EVERYWHERE, {0, 1, 2})
    with scratch_dir(tmp_path_factory.getbasetemp()) as scratch:
        args = command_line(share, data, scratch)
        # Mostly aimed at the cluster whose store is down (else most lines stop at "not up").
        if "--cluster" not in args and data.draw(st.integers(0, 3)):
            args += ["--cluster", outage.cluster]
        run_and_check(share, args, scratch)
