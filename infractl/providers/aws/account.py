"""What the AWS account must offer before ``up`` changes anything (``check_account``): each
missing thing in one line naming the field of cluster.yaml that points there."""

from __future__ import annotations

from typing import Any

from infractl.config import ClusterSpec
from infractl.errors import ConfigError, UsageError
from infractl.providers.aws.spec import AwsSpec, instance_types, tls
from infractl.store import open_store

__all__ = ["check_account"]

#: EC2's vCPU quotas by instance family class: (on-demand quota code, spot quota code, what AWS calls it).
_QUOTAS = {
    "p": ("L-417A185B", "L-7212CCBC", "P instances"),
    "g": ("L-DB2E81BA", "L-3819A6DF", "G and VT instances"),
    "standard": ("L-1216C47A", "L-34B43A08", "Standard (A, C, D, H, I, M, R, T, Z) instances"),
}


def check_account(spec: ClusterSpec) -> None:
    """What the account must offer before anything is created, each missing thing in one line
    naming it: credentials (STS), the state bucket, the store's bucket where the cluster does not
    create it (``Store.check_safeguards``: public access blocked, versioned, TLS only), every
    instance type offered in the zone, and the vCPU quota of each instance family where the
    Service Quotas API answers (a private or emulated AWS may not). Raises ``UsageError`` or
    ``ConfigError``."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    aws = spec.settings(AwsSpec)
    assert aws is not None
    session = boto3.session.Session(region_name=aws.region)

    def client(service: str) -> Any:
        return session.client(service, endpoint_url=aws.endpoint_url)

    def code(exc: ClientError) -> str:
        return str(exc.response.get("Error", {}).get("Code", ""))

    try:
        account = client("sts").get_caller_identity()["Account"]
    except NoCredentialsError:
        raise UsageError(
            "provider aws: no AWS credentials (set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)",
            field="provider",
        ) from None
    except (BotoCoreError, ClientError) as exc:
        raise UsageError(f"provider aws: the credentials were refused by STS ({exc})", field="provider") from None
    try:
        client("s3").head_bucket(Bucket=aws.state_bucket)
    except ClientError as exc:
        why = "does not exist" if code(exc) in ("404", "NoSuchBucket") else f"cannot be reached ({code(exc)})"
        raise ConfigError(
            f"the state bucket {aws.state_bucket} {why} for account {account}: create it once for every cluster "
            "(versioned, encrypted), or name an existing one",
            field="aws.state_bucket",
        ) from None
    if not aws.create_bucket:
        open_store(spec.store or "", field="store").check_safeguards(tls=tls(aws))
    groups = aws.node_groups.values()
    types = sorted({g.instance_type for g in groups} | {aws.controller_instance_type})
    if aws.availability_zone is not None:
        offered = client("ec2").describe_instance_type_offerings(
            LocationType="availability-zone",
            Filters=[
                {"Name": "location", "Values": [aws.availability_zone]},
                {"Name": "instance-type", "Values": types},
            ],
        )["InstanceTypeOfferings"]
        missing = sorted(set(types) - {o["InstanceType"] for o in offered})
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} not offered in {aws.availability_zone}: choose another availability zone "
                "(aws ec2 describe-instance-type-offerings --location-type availability-zone)",
                field="aws.availability_zone",
            )
    _check_quotas(aws, client("service-quotas"))


def _check_quotas(aws: AwsSpec, quotas: Any) -> None:
    """The node groups' vCPUs against each family's EC2 quota (the account's limit, not what is
    free of it); silent where the Service Quotas API does not answer."""
    from botocore.exceptions import BotoCoreError, ClientError

    table = instance_types()
    needed: dict[tuple[str, bool], int] = {}
    for group in aws.node_groups.values():
        family = group.instance_type[0] if group.instance_type[0] in ("p", "g") else "standard"
        key = (family, group.spot)
        needed[key] = needed.get(key, 0) + table[group.instance_type]["vcpus"] * group.nodes
    for (family, spot), vcpus in sorted(needed.items()):
        on_demand_code, spot_code, what = _QUOTAS[family]
        try:
            quota = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=spot_code if spot else on_demand_code)
        except (BotoCoreError, ClientError):
            return  # no answer: AWS itself refuses an instance over quota at apply, with its message
        limit = float(quota["Quota"]["Value"])
        if vcpus > limit:
            market = "spot" if spot else "on-demand"
            raise ConfigError(
                f"the node groups need {vcpus} {market} vCPUs of {what}, and the account's quota is {limit:g}: "
                "request an increase (Service Quotas, EC2) or use fewer nodes",
                field="aws.node_groups",
            )
