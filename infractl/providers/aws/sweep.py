"""What the account holds of a cluster by its tag (``CLUSTER_TAG``) or IAM path: the sweep
``teardown`` runs after ``terraform destroy`` (everything listed is a leak, named), the deletion
of what an interrupted ``up`` made before Terraform saved its state (``reap``), and the clusters
the account holds anything of (``gc --account``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from infractl.errors import InfraError
from infractl.providers.aws.spec import AwsSpec

__all__ = ["CLUSTER_TAG", "reap", "reap_orphan", "sweep", "tagged_clusters"]

#: The tag infra/aws puts on every taggable resource (its value: the cluster's name); the sweep's key.
CLUSTER_TAG = "infractl:cluster"


# long: one listing per kind of resource, in a row: splitting it would only scatter the list.
def sweep(cluster: str, region: str, *, endpoint_url: str | None = None) -> list[str]:
    """What the account still holds of the cluster in ``region``: by the cluster's tag, instances not
    terminated, volumes, network interfaces, NAT gateways not deleted, Elastic IPs, launch
    templates, key pairs, security groups, VPCs and placement groups; by their IAM path
    (``/infractl/<cluster>/``), roles and instance profiles. One ``"<kind> <id>"`` each. Run after
    ``terraform destroy``: anything listed is a leak (it costs money, or blocks creating the
    cluster again, and nothing manages it). Credentials come from the environment, as boto3 finds
    them; the endpoint too, unless given."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError
    from botocore.parsers import ResponseParserError

    ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint_url)
    iam = boto3.client("iam", region_name=region, endpoint_url=endpoint_url)
    tagging = boto3.client("resourcegroupstaggingapi", region_name=region, endpoint_url=endpoint_url)
    tagged = [{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}]

    # Each listing is filtered by the API and checked here again: an EC2-compatible API that ignores
    # a filter (moto does, for NAT gateways and IAM paths) must not make another cluster's resource a leak.
    def ours(item: Mapping[str, Any]) -> bool:
        tags = item.get("Tags", item.get("TagSet", []))
        return any(tag["Key"] == CLUSTER_TAG and tag["Value"] == cluster for tag in tags)

    def listed(operation: str, key: str, kind: str, field: str) -> list[str]:
        pages = ec2.get_paginator(operation).paginate(Filters=tagged)
        return [f"{kind} {item[field]}" for page in pages for item in page[key] if ours(item)]

    try:
        found = [
            f"instance {i['InstanceId']} ({i['State']['Name']})"
            for page in ec2.get_paginator("describe_instances").paginate(Filters=tagged)
            for reservation in page["Reservations"]
            for i in reservation["Instances"]
            if i["State"]["Name"] != "terminated" and ours(i)
        ]
        found += listed("describe_volumes", "Volumes", "volume", "VolumeId")
        found += listed("describe_network_interfaces", "NetworkInterfaces", "network-interface", "NetworkInterfaceId")
        found += [
            f"nat-gateway {g['NatGatewayId']} ({g['State']})"
            for page in ec2.get_paginator("describe_nat_gateways").paginate(Filter=tagged)
            for g in page["NatGateways"]
            if g["State"] not in ("deleted", "failed") and ours(g)
        ]
        found += [
            f"elastic-ip {a['AllocationId']}" for a in ec2.describe_addresses(Filters=tagged)["Addresses"] if ours(a)
        ]
        found += listed("describe_launch_templates", "LaunchTemplates", "launch-template", "LaunchTemplateId")
        found += [f"key-pair {k['KeyName']}" for k in ec2.describe_key_pairs(Filters=tagged)["KeyPairs"] if ours(k)]
        found += listed("describe_security_groups", "SecurityGroups", "security-group", "GroupId")
        found += listed("describe_vpcs", "Vpcs", "vpc", "VpcId")
        # EC2's DescribePlacementGroups is not in every EC2-compatible API (moto lacks it); the tagging
        # API lists tagged placement groups everywhere: arn:aws:ec2:REGION:ACCOUNT:placement-group/NAME.
        found += [
            f"placement-group {mapping['ResourceARN'].rsplit('/', 1)[-1]}"
            for page in tagging.get_paginator("get_resources").paginate(
                TagFilters=[{"Key": CLUSTER_TAG, "Values": [cluster]}], ResourceTypeFilters=["ec2:placement-group"]
            )
            for mapping in page["ResourceTagMappingList"]
        ]
        found += _iam_leaks(iam, cluster)
    except (BotoCoreError, ClientError, ResponseParserError) as exc:
        raise InfraError(f"the leak sweep of cluster {cluster!r} in {region} could not ask AWS: {exc}") from None
    return found


def reap(cluster: str, region: str, *, endpoint_url: str | None = None, timeout: float = 900) -> list[str]:
    """Delete everything the account holds with the cluster's tag or under its IAM path: what an
    ``up`` killed during its apply made before Terraform saved its state (Terraform alone can no
    longer find it). In dependency order: instances, NAT gateways, Elastic IPs, network
    interfaces, volumes, launch templates, key pairs, the VPCs with what is in them, security
    groups, then the IAM roles, instance profiles and policies. One ``"<kind> <id>"`` per deletion."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint_url)
    iam = boto3.client("iam", region_name=region, endpoint_url=endpoint_url)
    try:
        deleted = _reap_ec2(ec2, cluster, time.monotonic() + timeout)
        deleted += _reap_iam(iam, cluster)
    except (BotoCoreError, ClientError) as exc:
        raise InfraError(
            f"could not delete what cluster {cluster!r} left in {region}: {exc}; run teardown again"
        ) from None
    return deleted


def _tagged(cluster: str) -> list[dict[str, Any]]:
    return [{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}]


def _wait(what: str, done: Callable[[], bool], deadline: float) -> None:
    while not done():
        if time.monotonic() > deadline:
            raise InfraError(f"{what} did not finish in time; run teardown again")
        time.sleep(5)


# long: one kind after another in the order AWS lets them go; splitting would only scatter the order.
def _reap_ec2(ec2: Any, cluster: str, deadline: float) -> list[str]:
    tagged, deleted = _tagged(cluster), []
    instances = [
        i["InstanceId"]
        for r in ec2.describe_instances(Filters=tagged)["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] != "terminated"
    ]
    if instances:
        ec2.terminate_instances(InstanceIds=instances)
        deleted += [f"instance {i}" for i in instances]

        def terminated() -> bool:
            listed = ec2.describe_instances(InstanceIds=instances)["Reservations"]
            return all(i["State"]["Name"] == "terminated" for r in listed for i in r["Instances"])

        _wait("terminating the instances", terminated, deadline)
    nats = [
        g["NatGatewayId"]
        for g in ec2.describe_nat_gateways(Filter=tagged)["NatGateways"]
        if g["State"] not in ("deleted", "failed")
    ]
    for nat in nats:
        ec2.delete_nat_gateway(NatGatewayId=nat)
        deleted.append(f"nat-gateway {nat}")
    if nats:
        _wait(
            "deleting the NAT gateways",
            lambda: all(
                g["State"] in ("deleted", "failed")
                for g in ec2.describe_nat_gateways(NatGatewayIds=nats)["NatGateways"]
            ),
            deadline,
        )
    for address in ec2.describe_addresses(Filters=tagged)["Addresses"]:
        ec2.release_address(AllocationId=address["AllocationId"])
        deleted.append(f"elastic-ip {address['AllocationId']}")
    for interface in ec2.describe_network_interfaces(Filters=tagged)["NetworkInterfaces"]:
        if interface["Status"] == "available":
            ec2.delete_network_interface(NetworkInterfaceId=interface["NetworkInterfaceId"])
            deleted.append(f"network-interface {interface['NetworkInterfaceId']}")
    for volume in ec2.describe_volumes(Filters=tagged)["Volumes"]:
        ec2.delete_volume(VolumeId=volume["VolumeId"])
        deleted.append(f"volume {volume['VolumeId']}")
    for template in ec2.describe_launch_templates(Filters=tagged)["LaunchTemplates"]:
        ec2.delete_launch_template(LaunchTemplateId=template["LaunchTemplateId"])
        deleted.append(f"launch-template {template['LaunchTemplateId']}")
    for key in ec2.describe_key_pairs(Filters=tagged)["KeyPairs"]:
        ec2.delete_key_pair(KeyName=key["KeyName"])
        deleted.append(f"key-pair {key['KeyName']}")
    groups = ec2.describe_security_groups(Filters=tagged)["SecurityGroups"]
    for group in groups:  # rules that name another group keep that group from going
        if group["IpPermissions"]:
            ec2.revoke_security_group_ingress(GroupId=group["GroupId"], IpPermissions=group["IpPermissions"])
        if group["IpPermissionsEgress"]:
            ec2.revoke_security_group_egress(GroupId=group["GroupId"], IpPermissions=group["IpPermissionsEgress"])
    for group in groups:
        ec2.delete_security_group(GroupId=group["GroupId"])
        deleted.append(f"security-group {group['GroupId']}")
    for vpc in ec2.describe_vpcs(Filters=tagged)["Vpcs"]:
        deleted += _reap_vpc(ec2, vpc["VpcId"])
    return deleted


def _reap_vpc(ec2: Any, vpc: str) -> list[str]:
    """A VPC and what is left in it: endpoints, internet gateways, subnets, route tables."""
    inside = [{"Name": "vpc-id", "Values": [vpc]}]
    endpoints = [e["VpcEndpointId"] for e in ec2.describe_vpc_endpoints(Filters=inside)["VpcEndpoints"]]
    if endpoints:
        ec2.delete_vpc_endpoints(VpcEndpointIds=endpoints)
    gateways = ec2.describe_internet_gateways(Filters=[{"Name": "attachment.vpc-id", "Values": [vpc]}])
    for gateway in gateways["InternetGateways"]:
        ec2.detach_internet_gateway(InternetGatewayId=gateway["InternetGatewayId"], VpcId=vpc)
        ec2.delete_internet_gateway(InternetGatewayId=gateway["InternetGatewayId"])
    for subnet in ec2.describe_subnets(Filters=inside)["Subnets"]:
        ec2.delete_subnet(SubnetId=subnet["SubnetId"])
    for table in ec2.describe_route_tables(Filters=inside)["RouteTables"]:
        if any(a.get("Main") for a in table["Associations"]):
            continue  # the VPC's own: it goes with the VPC
        for association in table["Associations"]:
            ec2.disassociate_route_table(AssociationId=association["RouteTableAssociationId"])
        ec2.delete_route_table(RouteTableId=table["RouteTableId"])
    for group in ec2.describe_security_groups(Filters=inside)["SecurityGroups"]:
        if group["GroupName"] != "default":
            ec2.delete_security_group(GroupId=group["GroupId"])
    ec2.delete_vpc(VpcId=vpc)
    return [f"vpc {vpc}"]


def _reap_iam(iam: Any, cluster: str) -> list[str]:
    """The roles, instance profiles and policies under the cluster's IAM path."""
    path, deleted = f"/infractl/{cluster}/", []
    for profile in iam.list_instance_profiles(PathPrefix=path)["InstanceProfiles"]:
        if profile["Path"] != path:
            continue
        for role in profile["Roles"]:
            iam.remove_role_from_instance_profile(
                InstanceProfileName=profile["InstanceProfileName"], RoleName=role["RoleName"]
            )
        iam.delete_instance_profile(InstanceProfileName=profile["InstanceProfileName"])
        deleted.append(f"instance-profile {profile['InstanceProfileName']}")
    for role in iam.list_roles(PathPrefix=path)["Roles"]:
        if role["Path"] != path:
            continue
        name = role["RoleName"]
        for attached in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]:
            iam.detach_role_policy(RoleName=name, PolicyArn=attached["PolicyArn"])
        for inline in iam.list_role_policies(RoleName=name)["PolicyNames"]:
            iam.delete_role_policy(RoleName=name, PolicyName=inline)
        iam.delete_role(RoleName=name)
        deleted.append(f"iam-role {name}")
    for policy in iam.list_policies(Scope="Local", PathPrefix=path)["Policies"]:
        if policy["Path"] != path:
            continue
        for version in iam.list_policy_versions(PolicyArn=policy["Arn"])["Versions"]:
            if not version["IsDefaultVersion"]:
                iam.delete_policy_version(PolicyArn=policy["Arn"], VersionId=version["VersionId"])
        iam.delete_policy(PolicyArn=policy["Arn"])
        deleted.append(f"iam-policy {policy['PolicyName']}")
    return deleted


def _iam_leaks(iam: Any, cluster: str) -> list[str]:
    """The cluster's IAM roles and instance profiles, by their path (IAM has no tag filter)."""
    path = f"/infractl/{cluster}/"
    found = [
        f"iam-role {role['RoleName']}"
        for page in iam.get_paginator("list_roles").paginate(PathPrefix=path)
        for role in page["Roles"]
        if role["Path"] == path
    ]
    found += [
        f"instance-profile {profile['InstanceProfileName']}"
        for page in iam.get_paginator("list_instance_profiles").paginate(PathPrefix=path)
        for profile in page["InstanceProfiles"]
        if profile["Path"] == path
    ]
    return found


def tagged_clusters(settings: AwsSpec) -> set[str]:
    """The clusters the account holds anything of in the region: the values of ``CLUSTER_TAG`` on
    its resources, and the cluster names in the IAM paths (``/infractl/<cluster>/``) of its roles."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    tagging = boto3.client("resourcegroupstaggingapi", region_name=settings.region, endpoint_url=settings.endpoint_url)
    iam = boto3.client("iam", region_name=settings.region, endpoint_url=settings.endpoint_url)
    try:
        names = {
            tag["Value"]
            for page in tagging.get_paginator("get_resources").paginate(TagFilters=[{"Key": CLUSTER_TAG}])
            for mapping in page["ResourceTagMappingList"]
            for tag in mapping["Tags"]
            if tag["Key"] == CLUSTER_TAG
        }
        for page in iam.get_paginator("list_roles").paginate(PathPrefix="/infractl/"):
            names |= {role["Path"].split("/")[2] for role in page["Roles"] if role["Path"].count("/") == 3}
    except (BotoCoreError, ClientError) as exc:
        raise InfraError(f"could not list the clusters tagged {CLUSTER_TAG} in {settings.region}: {exc}") from None
    return names


def reap_orphan(cluster: str, settings: AwsSpec) -> None:
    reap(cluster, settings.region, endpoint_url=settings.endpoint_url)
