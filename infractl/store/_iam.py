"""IAM for a store kept in S3: an access role's policy document, scoped to the store's bucket and
prefix, and the managed policies that carry the roles (one per role, attached to exactly the
role's members). Used by ``S3Store``; ``Store.access_policy`` writes the same documents for any
backend."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

from infractl.errors import StoreError
from infractl.store.errors import StoreUnavailable, UnknownUser
from infractl.store.rights import RoleRights

__all__ = ["PLACEHOLDER_BUCKET", "POLICY_PATH", "policy_document", "apply_policies", "remove_policies"]

#: The bucket named in the policies of a store that is not in S3 (the bundle still ships them).
PLACEHOLDER_BUCKET = "BUCKET"
#: Every policy infractl makes lives under this IAM path: one listing finds them all.
POLICY_PATH = "/infractl/"
# IAM keeps at most five versions of a managed policy; a sixth needs an old one deleted first.
_MAX_VERSIONS = 5

_READ = ["s3:GetObject"]
_WRITE = ["s3:AbortMultipartUpload", "s3:PutObject"]  # PutObject covers multipart uploads' parts
_DELETE = ["s3:DeleteObject"]
# What `access grant/revoke` reads of the roles' policies (their documents and who holds them) when
# a granting role's member runs it. Nothing that changes a document: a member who could write one
# could write their own as `Action: *`. Documents are made and changed with the credentials of the
# operator who runs infractl (``apply_policies``, ``remove_policies``), never through a role.
_READ_POLICIES = ["iam:GetPolicyVersion", "iam:ListEntitiesForPolicy"]


def _policy_arn(name: str) -> str:
    # Any account: the document does not depend on where it is applied.
    return f"arn:aws:iam::*:policy{POLICY_PATH}{name}"


def policy_document(bucket: str, prefix: str, rights: RoleRights) -> dict[str, Any]:
    """The IAM policy of ``rights`` in ``s3://bucket/prefix``: listing the prefix, and reading,
    writing and deleting the objects its key patterns name, never writing what ``nodes_only``
    names (an explicit deny, which no other policy of the user can override); with ``grants``,
    reading those policies and attaching them to users and detaching them. ``prefix`` is empty
    only for ``PLACEHOLDER_BUCKET``: a role's rights span no whole bucket."""
    if not prefix and bucket != PLACEHOLDER_BUCKET:
        raise ValueError(f"the policies of a store need a prefix in bucket {bucket} (s3://{bucket}/PREFIX)")
    under = f"{prefix}/" if prefix else ""

    def objects(patterns: Sequence[str]) -> list[str]:
        return [f"arn:aws:s3:::{bucket}/{under}{pattern}" for pattern in patterns]

    listing: dict[str, Any] = {"Sid": "List", "Effect": "Allow", "Action": "s3:ListBucket"}
    listing["Resource"] = f"arn:aws:s3:::{bucket}"
    if prefix:
        listing["Condition"] = {"StringLike": {"s3:prefix": [f"{under}*"]}}
    statements = [listing]
    for sid, actions, patterns in (
        ("Read", _READ, rights.read),
        ("Write", _WRITE, rights.write),
        ("Delete", _DELETE, rights.delete),
    ):
        if patterns:
            statements.append({"Sid": sid, "Effect": "Allow", "Action": actions, "Resource": objects(patterns)})
    if rights.write and rights.nodes_only:
        statements.append(
            {"Sid": "NodesOnly", "Effect": "Deny", "Action": _WRITE, "Resource": objects(rights.nodes_only)}
        )
    if rights.grants:
        arns = [_policy_arn(name) for name in rights.grants]
        statements += [
            {"Sid": "ReadPolicies", "Effect": "Allow", "Action": _READ_POLICIES, "Resource": arns},
            {"Sid": "FindPolicies", "Effect": "Allow", "Action": "iam:ListPolicies", "Resource": "*"},
            {
                "Sid": "AttachPolicies",
                "Effect": "Allow",
                "Action": ["iam:AttachUserPolicy", "iam:DetachUserPolicy"],
                "Resource": "arn:aws:iam::*:user/*",
                "Condition": {"ArnLike": {"iam:PolicyARN": arns}},
            },
        ]
    return {"Version": "2012-10-17", "Statement": statements}


# Said when IAM refuses to make or change a document: the granting role's members may not.
_OPERATOR_ONLY = "policies are made and changed with the credentials of the operator who runs infractl"


@contextlib.contextmanager
def _calling(uri: str, what: str, *, denied: str = "") -> Iterator[None]:
    """IAM's errors as the store's: one line naming the store, what was being done and why
    (``denied``: what to add when IAM refused it)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as e:
        error = e.response.get("Error", {})
        code, message = str(error.get("Code", "")), str(error.get("Message", "")).rstrip(".")
        reason = f"{code} ({message})" if message and message != code else code
        hint = f"; {denied}" if denied and code == "AccessDenied" else ""
        raise StoreError(uri, f"IAM: cannot {what}: {' '.join(reason.split())}{hint}") from e
    except BotoCoreError as e:
        raise StoreUnavailable(uri, f"IAM: cannot {what}: {' '.join(str(e).split())}") from e


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _existing(iam: Any, uri: str) -> dict[str, dict[str, Any]]:
    """infractl's managed policies in the account, by name."""
    found: dict[str, dict[str, Any]] = {}
    with _calling(uri, f"list the policies under {POLICY_PATH}"):
        for page in iam.get_paginator("list_policies").paginate(Scope="Local", PathPrefix=POLICY_PATH):
            found |= {p["PolicyName"]: p for p in page["Policies"]}
    return found


def _attached_users(iam: Any, uri: str, arn: str) -> set[str]:
    users: set[str] = set()
    with _calling(uri, f"list the users of {arn}"):
        for page in iam.get_paginator("list_entities_for_policy").paginate(PolicyArn=arn, EntityFilter="User"):
            users |= {u["UserName"] for u in page["PolicyUsers"]}
    return users


def _ensure_policy(iam: Any, uri: str, name: str, document: dict[str, Any], existing: dict[str, Any] | None) -> str:
    """Create policy ``name`` with ``document``, or make ``document`` its default version (the
    oldest other version goes when IAM's five are used up); return its ARN. Only reads when the
    policy holds ``document`` already, which is all a granting role's member may do."""
    text = json.dumps(document, sort_keys=True)
    if existing is None:
        with _calling(uri, f"create policy {name}", denied=_OPERATOR_ONLY):
            created = iam.create_policy(
                PolicyName=name,
                Path=POLICY_PATH,
                PolicyDocument=text,
                Description="infractl access role (infractl access grant/revoke keeps it)",
            )
        return str(created["Policy"]["Arn"])
    arn = str(existing["Arn"])
    with _calling(uri, f"read policy {name}"):
        current = iam.get_policy_version(PolicyArn=arn, VersionId=existing["DefaultVersionId"])
    if current["PolicyVersion"]["Document"] == document:
        return arn
    with _calling(uri, f"update policy {name}", denied=_OPERATOR_ONLY):
        versions = iam.list_policy_versions(PolicyArn=arn)["Versions"]
        if len(versions) >= _MAX_VERSIONS:
            oldest = min((v for v in versions if not v["IsDefaultVersion"]), key=lambda v: v["CreateDate"])
            iam.delete_policy_version(PolicyArn=arn, VersionId=oldest["VersionId"])
        iam.create_policy_version(PolicyArn=arn, PolicyDocument=text, SetAsDefault=True)
    return arn


def apply_policies(iam: Any, uri: str, roles: Sequence[tuple[str, dict[str, Any], Sequence[str]]]) -> None:
    """For each (policy name, document, members): the policy holds the document and is attached
    to exactly those IAM users (``UnknownUser`` for one that does not exist). Making or changing
    a document takes the operator's credentials; a granting role's member may only attach and
    detach policies that hold their documents already."""
    from botocore.exceptions import ClientError

    existing = _existing(iam, uri)
    for name, document, members in roles:
        arn = _ensure_policy(iam, uri, name, document, existing.get(name))
        attached = _attached_users(iam, uri, arn)
        for user in sorted(set(members) - attached):
            with _calling(uri, f"attach {name} to user {user}"):
                try:
                    iam.attach_user_policy(UserName=user, PolicyArn=arn)
                except ClientError as e:
                    if _code(e) == "NoSuchEntity":
                        raise UnknownUser(uri, user) from None
                    raise
        for user in sorted(attached - set(members)):
            _detach(iam, uri, name, arn, user)


def _detach(iam: Any, uri: str, name: str, arn: str, user: str) -> None:
    from botocore.exceptions import ClientError

    with _calling(uri, f"detach {name} from user {user}"):
        try:
            iam.detach_user_policy(UserName=user, PolicyArn=arn)
        except ClientError as e:
            if _code(e) != "NoSuchEntity":  # the user (or the attachment) is gone already
                raise


def remove_policies(iam: Any, uri: str, names: Sequence[str]) -> None:
    """Detach the policies ``names`` from every user and delete them (those that exist)."""
    existing = _existing(iam, uri)
    for name in names:
        if name not in existing:
            continue
        arn = str(existing[name]["Arn"])
        for user in sorted(_attached_users(iam, uri, arn)):
            _detach(iam, uri, name, arn, user)
        with _calling(uri, f"delete policy {name}"):
            for version in iam.list_policy_versions(PolicyArn=arn)["Versions"]:
                if not version["IsDefaultVersion"]:
                    iam.delete_policy_version(PolicyArn=arn, VersionId=version["VersionId"])
            iam.delete_policy(PolicyArn=arn)
