"""The account's buckets a cluster uses: the Terraform state bucket (``aws.state_bucket``: where
a cluster's state and its lock live) and the store's bucket the cluster may create (emptied for a
purge, so destroy can delete it)."""

from __future__ import annotations

import getpass
import json
import socket

from infractl.errors import InfraError
from infractl.providers.aws.spec import AwsSpec

__all__ = ["empty_bucket", "has_state", "release_stale_lock", "s3_answers", "state_key"]


def has_state(settings: AwsSpec, cluster: str) -> bool:
    """Whether ``aws.state_bucket`` holds the cluster's Terraform state or its lock."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.client("s3", region_name=settings.region, endpoint_url=settings.endpoint_url)
    for key in (state_key(cluster), f"{state_key(cluster)}.tflock"):
        try:
            s3.head_object(Bucket=settings.state_bucket, Key=key)
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise InfraError(f"could not read {key} in the state bucket {settings.state_bucket}: {exc}") from None
        except BotoCoreError as exc:
            raise InfraError(f"could not read the state bucket {settings.state_bucket}: {exc}") from None
    return False


def state_key(cluster: str) -> str:
    """Where the cluster's Terraform state lives in ``aws.state_bucket`` (its lock file: ``<key>.tflock``)."""
    return f"infractl/{cluster}/terraform.tfstate"


def release_stale_lock(settings: AwsSpec, cluster: str) -> list[str]:
    """Delete the lock file of the cluster's Terraform state when this machine's user holds it:
    an infractl here was killed while Terraform held it (teardown holds the cluster's own lock, so
    no other infractl here is running). A lock of anyone else's is left for destroy to name."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.client("s3", region_name=settings.region, endpoint_url=settings.endpoint_url)
    key = f"{state_key(cluster)}.tflock"
    try:
        info = json.loads(s3.get_object(Bucket=settings.state_bucket, Key=key)["Body"].read())
    except (BotoCoreError, ClientError, ValueError):
        return []  # no lock (or none readable): destroy takes the lock itself, or says why not
    if info.get("Who") != f"{getpass.getuser()}@{socket.gethostname()}":
        return []
    s3.delete_object(Bucket=settings.state_bucket, Key=key)
    return [
        f"terraform: released the state lock {info.get('ID')} of a killed infractl on this machine "
        f"({info.get('Operation')}, {info.get('Created')})"
    ]


def s3_answers(operation: str, bucket: str, region: str, endpoint_url: str | None) -> bool:
    """Whether S3 answers ``operation`` on ``bucket`` without an error: ``head_bucket``, the bucket
    exists and these credentials may use it; ``get_bucket_lifecycle_configuration``, it has
    lifecycle rules."""
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client("s3", region_name=region, endpoint_url=endpoint_url)
    try:
        getattr(client, operation)(Bucket=bucket)
    except ClientError:
        return False
    return True


def empty_bucket(bucket: str, region: str, *, endpoint_url: str | None = None) -> int:
    """Delete every object version and delete marker of ``bucket`` (a versioned bucket keeps
    deleted objects as versions, and S3 deletes no bucket that holds any); return how many."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = boto3.client("s3", region_name=region, endpoint_url=endpoint_url)
    deleted = 0
    try:
        # The first page again until there is none: paging on while deleting what was listed would
        # walk markers whose entries are gone (an S3-compatible API may end the listing there).
        while True:
            try:
                page = s3.list_object_versions(Bucket=bucket)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                    break  # never made (an `up` stopped before), or deleted already
                raise
            # Delete markers before the versions they hide: an S3-compatible API (moto) fails to delete
            # a key's last entry when that entry is a delete marker.
            batches = [
                [{"Key": item["Key"], "VersionId": item["VersionId"]} for item in page.get(kind, [])]
                for kind in ("DeleteMarkers", "Versions")
            ]
            if not any(batches):
                break
            for entries in batches:
                if entries:  # a page holds 1000 entries at most, what DeleteObjects takes at a time
                    s3.delete_objects(Bucket=bucket, Delete={"Objects": entries, "Quiet": True})
                deleted += len(entries)
    except (BotoCoreError, ClientError) as exc:
        raise InfraError(
            f"could not empty bucket {bucket} for its deletion: {exc}; run teardown --purge again"
        ) from None
    return deleted
