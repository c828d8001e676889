"""The config driver: run ``playbooks/site.yml`` on a cluster's nodes with ansible-runner (and
``playbooks/access.yml``, the access role alone, when membership changes)."""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import infractl
from infractl import proc, templates
from infractl.config import RuntimeSpec
from infractl.errors import ConfigureError
from infractl.providers.engines import IMAGE_PYTHON, IMAGE_UID, ContainerEngine
from infractl.providers.nodecontrol import NodeControl
from infractl.statedir import write_private

__all__ = [
    "ANSIBLE_NODE",
    "AccessResult",
    "ConfigureResult",
    "apply_access",
    "configure",
    "container_vars",
    "inventory_of",
    "playbook_dir",
]

_PLAYBOOK = "site.yml"
_ACCESS_PLAYBOOK = "access.yml"
# Runs kept under <state_dir>/ansible/artifacts/ for `infractl logs` and post-mortems.
_KEEP_ARTIFACTS = 10
# The marker node name of ansible-playbook and what it starts on this machine (infractl.proc).
ANSIBLE_NODE = "ansible"
# A whole configure run (collective included) that takes longer than this is stuck.
_RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class ConfigureResult:
    """What a :func:`configure` run did."""

    changed: int
    """Changed tasks over all nodes; 0 when the nodes were already configured."""
    changed_tasks: list[str]
    """``<node>: <task>`` for each changed task, in the order they ran."""
    health: list[dict[str, Any]]
    """The health check's report from every node, in node order (see ``infractl.health``)."""


def playbook_dir() -> Path:
    """``playbooks/`` as infractl ships it."""
    return templates.folder("playbooks")


def configure(
    state_dir: Path,
    nodes: NodeControl,
    *,
    runtime: RuntimeSpec,
    rendezvous: tuple[str, int],
    nonce: str,
    access: dict[str, Any],
    image: str | None = None,
    registry_ca: Path | None = None,
    cancel: Callable[[], bool] | None = None,
) -> ConfigureResult:
    """Configure ``nodes`` (base, access, runtime, network roles), then gate on a cross-node
    health check. ``access``: the access role's variables (``infractl.access.node_vars``).
    ``image``: the trainer image each node pulls by digest and verifies (the container_runtime and
    trainer_image roles), from a registry whose CA is ``registry_ca`` when the cluster has its own.
    ``cancel``: polled while Ansible runs; True stops it (the caller's signal handling: without
    one, ansible-runner takes SIGINT and SIGTERM itself).

    The health check meets at ``rendezvous`` under a key made from ``nonce`` and a random suffix,
    so two runs never share keys in the long-lived rendezvous store.
    Raises :class:`ConfigureError` naming the node and role of the first failure.
    """
    host, port = rendezvous
    extravars = {
        "runtime_torch": runtime.torch,
        "runtime_image": runtime.image,
        "runtime_infractl_version": infractl.__version__,
        "health_rendezvous_host": host,
        "health_rendezvous_port": port,
        "health_key": f"{nonce}-{secrets.token_hex(4)}",
        "health_world_size": len(nodes.nodes),
        "trainer_image_ref": image,
        "trainer_image_python": IMAGE_PYTHON,
        "container_runtime_registry_ca": registry_ca.read_text() if registry_ca is not None else None,
        # host:port of the cluster's registry, for an engine that trusts it in a system-wide folder.
        "container_runtime_registry": image.split("/", 1)[0] if image and registry_ca else None,
        # The trainer's user: the image's, in its container (work/ is its), else root.
        "base_trainer_uid": IMAGE_UID if image else 0,
        # Every node's address and the rendezvous endpoint's: only root and the trainer reach their ports.
        "firewall_addresses": sorted({n.address for n in nodes.nodes.values()} | {host}) if nodes.guards_ports else [],
        "firewall_trusted_uids": [0, IMAGE_UID] if image else [0],
        **access,
    }
    runner, events = _run_playbook(state_dir, nodes, _PLAYBOOK, extravars, cancel=cancel)
    if runner.status != "successful":
        raise ConfigureError(_failure(runner, events))
    return ConfigureResult(
        changed=_changed(runner), changed_tasks=_changed_tasks(events), health=_health_reports(events, nodes)
    )


@dataclass(frozen=True)
class AccessResult:
    """What an :func:`apply_access` run did."""

    changed: int
    """Changed tasks over all nodes."""
    missing_users: dict[str, list[str]]
    """Node -> users it has no account for, of those the run was told to require. When this is
    not empty the run stopped in the role's preflight: no node was changed."""


def apply_access(state_dir: Path, nodes: NodeControl, access: dict[str, Any]) -> AccessResult:
    """Run the access role alone (``playbooks/access.yml``) with ``access``, its variables:
    groups, members and ACLs on every node. Raises :class:`ConfigureError` for any failure but
    missing accounts (reported in the result)."""
    runner, events = _run_playbook(state_dir, nodes, _ACCESS_PLAYBOOK, access)
    if runner.status != "successful":
        missing = {host: users for host, users in _facts(events, "access_missing_users").items() if users}
        if missing:
            return AccessResult(changed=0, missing_users=missing)
        raise ConfigureError(_failure(runner, events))
    return AccessResult(changed=_changed(runner), missing_users={})


def _run_playbook(
    state_dir: Path,
    nodes: NodeControl,
    playbook: str,
    extravars: dict[str, Any],
    *,
    cancel: Callable[[], bool] | None = None,
) -> tuple[Any, list[Any]]:
    """Run ``playbook`` on ``nodes``; return the runner and its events (the caller judges them)."""
    import ansible_runner

    if not nodes.nodes:
        raise ConfigureError("no nodes to configure: the cluster has no provisioned nodes")
    data_dir = state_dir.resolve() / "ansible"
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    inventory = data_dir / "inventory" / "hosts.json"
    inventory.parent.mkdir(mode=0o700, exist_ok=True)
    hosts = inventory_of(state_dir, nodes)
    _refuse_templates(hosts)
    inventory.write_text(json.dumps(hosts, indent=2) + "\n")
    # ansible-runner reads env/extravars itself (-e @file): a file, not a command line every user's
    # `ps` shows, and every string in it that could hold a template tagged !unsafe, so Ansible never
    # renders what infractl hands it as one (a user name or path holding "{{ ... }}" stays text).
    write_private(data_dir / "env" / "extravars", _unsafe_yaml(extravars))
    runner = ansible_runner.run(
        private_data_dir=str(data_dir),
        project_dir=str(playbook_dir()),
        playbook=playbook,
        inventory=str(inventory),
        envvars=_environment(state_dir, data_dir),
        # The health role runs one task on every node at once: it needs a fork per node.
        forks=max(len(nodes.nodes), 5),
        quiet=True,
        suppress_env_files=True,
        rotate_artifacts=_KEEP_ARTIFACTS,
        timeout=_RUN_TIMEOUT_S,
        cancel_callback=cancel,
    )
    if runner.status == "canceled":
        # ansible-runner took the Ctrl-C (it stopped ansible-playbook): the caller's to take too.
        raise KeyboardInterrupt
    return runner, list(runner.events)


class _Unsafe(str):
    """A string Ansible must not render as a template (YAML's ``!unsafe``)."""


def _unsafe_yaml(value: dict[str, Any]) -> str:
    """``value`` as YAML whose every string that could hold a template (a ``{``) is tagged
    ``!unsafe``. Only those: Ansible reads an ``!unsafe`` scalar by its looks, so a tagged
    ``'9.9'`` would come back a number."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Unsafe, lambda dumper, data: dumper.represent_scalar("!unsafe", str(data)))

    def tag(item: Any) -> Any:
        if isinstance(item, str):
            return _Unsafe(item) if "{" in item else item
        if isinstance(item, dict):
            return {key: tag(inner) for key, inner in item.items()}
        if isinstance(item, (list, tuple)):
            return [tag(inner) for inner in item]
        return item

    return str(yaml.dump(tag(value), Dumper=Dumper, sort_keys=True))


def _refuse_templates(value: Any) -> None:
    """The inventory is JSON, which cannot say ``!unsafe``: none of its strings may look like a
    template (every value in it is validated where it comes from; this is the last line)."""
    if isinstance(value, str) and ("{{" in value or "{%" in value or "{#" in value):
        raise ConfigureError(f"an inventory value looks like an Ansible template: {value!r}")
    for inner in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        _refuse_templates(inner)


def _changed(runner: Any) -> int:
    return sum((runner.stats or {}).get("changed", {}).values())


def _changed_tasks(events: Iterable[dict[str, Any]]) -> list[str]:
    found = []
    for event in events:
        data = event.get("event_data", {})
        if event.get("event") == "runner_on_ok" and (data.get("res") or {}).get("changed"):
            found.append(f"{data['host']}: {data['task']}")
    return found


def inventory_of(state_dir: Path, nodes: NodeControl) -> dict[str, Any]:
    """Every node with how Ansible reaches it and runs Python there (its provider says), and the
    node's facts the roles use; grouped where the provider groups nodes (``gpu``, ``cpu``)."""
    groups: dict[str, dict[str, Any]] = {}
    for name in nodes.nodes:
        if (group := nodes.host_group(name)) is not None:
            groups.setdefault(group, {"hosts": {}})["hosts"][name] = {}
    return {
        "all": {
            "children": groups,
            "hosts": {
                node.name: {
                    **nodes.ansible_host(node.name),
                    **container_vars(nodes.containers(node.name)),
                    "node_workdir": str(node.workdir),
                    "node_workdir_parents": _parents_in(state_dir, node.workdir),
                    "node_address": node.address,
                    "node_index": index,
                }
                for index, node in enumerate(nodes.nodes.values())
            },
        }
    }


def container_vars(engine: ContainerEngine) -> dict[str, Any]:
    """The node's container engine as the roles take it: its command, its own store, and the
    command line before the image that runs a container as the node's processes run."""
    home = str(engine.home) if engine.home is not None else None
    return {
        "container_runtime_cli": list(engine.argv),
        "container_runtime_home": home,
        "container_runtime_runroot": str(engine.runroot) if engine.runroot is not None else None,
        "container_runtime_certs_dir": str(engine.certs_dir) if engine.certs_dir is not None else None,
        "container_runtime_run": engine.run_prefix(),
    }


def _parents_in(state_dir: Path, workdir: Path) -> list[str]:
    """The work dir's parents from the cluster's state dir down: the local provider keeps its
    nodes in the state dir, which the access roles' members must pass through to reach them
    (empty for a work dir elsewhere)."""
    state = state_dir.resolve()
    return [str(p) for p in reversed(workdir.resolve().parents) if p == state or state in p.parents]


def _environment(state_dir: Path, data_dir: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {
        # The cluster's marker (infractl.proc): ansible-runner starts ansible-playbook in a session of
        # its own, which outlives an infractl that was killed; teardown finds and stops it by this.
        proc.CLUSTER_ENV: str(state_dir),
        proc.NODE_ENV: ANSIBLE_NODE,
        # ansible-runner looks for ansible-playbook on PATH; it lives next to this Python.
        "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "")]),
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(data_dir / "tmp"),
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        # SSH nodes pin their host keys (see SshLogin.options); nodes that are this machine have none.
        "ANSIBLE_HOST_KEY_CHECKING": "True",
    }


def _facts(events: Iterable[dict[str, Any]], name: str) -> dict[str, Any]:
    """Host -> the value of fact ``name`` its tasks set (the last one), for hosts that set it."""
    found: dict[str, Any] = {}
    for event in events:
        if event.get("event") != "runner_on_ok":
            continue
        data = event.get("event_data", {})
        value = (data.get("res") or {}).get("ansible_facts", {}).get(name)
        if value is not None:
            found[data["host"]] = value
    return found


def _health_reports(events: Iterable[dict[str, Any]], nodes: NodeControl) -> list[dict[str, Any]]:
    reports: dict[str, dict[str, Any]] = _facts(events, "health_report")
    missing = [name for name in nodes.nodes if name not in reports]
    if missing:
        names = ", ".join(missing)
        raise ConfigureError(f"{names}: health: no health report (was the health role skipped?)")
    return [reports[name] for name in nodes.nodes]


def _failure(runner: Any, events: list[dict[str, Any]]) -> str:
    """The first failing task as one line: ``<node>: <role>: <message>``."""
    failures = []
    for event in events:
        if event.get("event") not in ("runner_on_failed", "runner_on_unreachable"):
            continue
        data = event.get("event_data", {})
        if data.get("ignore_errors"):
            continue
        failures.append(data)
    if not failures:
        if runner.rc == 127:
            return f"ansible-playbook not found on PATH (looked next to {sys.executable} first)"
        if runner.status == "timeout":
            return f"configure did not finish within {_RUN_TIMEOUT_S}s"
        return f"ansible-playbook {runner.status} (rc {runner.rc}): {_last_error_line(runner)}"
    first = failures[0]
    host = first.get("host", "?")
    role = first.get("role") or first.get("task", "?")
    message = _task_message(first.get("res") or {})
    # Roles name the node in their messages for readers of the raw log; say it once here.
    message = message.removeprefix(f"{host}: ")
    others = sorted({f.get("host", "?") for f in failures[1:]} - {host})
    also = f" ({', '.join(others)} failed too)" if others else ""
    return f"{host}: {role}: {message}{also}"


def _task_message(res: dict[str, Any]) -> str:
    msg = str(res.get("msg") or "").strip()
    stderr = [line.strip() for line in res.get("stderr_lines") or [] if line.strip()]
    if msg in ("", "non-zero return code") and stderr:
        # A command that failed says why on its last stderr line.
        return str(stderr[-1])
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    return " ".join(lines[:3]) or "failed (no message)"


def _last_error_line(runner: Any) -> str:
    try:
        text = runner.stdout.read()
    except (OSError, AttributeError):
        return "no output"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("ERROR!", "[ERROR]"))]
    return str((errors or lines or ["no output"])[-1])
