"""Access roles (infractl/access/): the role table, its IAM policies enforced by a real
IAM-checking S3 server, and `infractl access` on a real local cluster, enforced by the kernel
(POSIX ACLs and groups, checked as throwaway Unix users)."""

from __future__ import annotations

import contextlib
import fnmatch
import grp
import json
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from infractl import access, runstore
from infractl.errors import ConfigError
from infractl.handover import access_docs
from infractl.statedir import ClusterState
from infractl.store import Store, StoreError, StoreKeyError, UnknownUser, open_store

from conftest import Cli, S3AuthServer, module_cluster, one_line, s3_client

# -- the role table ---------------------------------------------------------------------------------


def test_every_store_prefix_has_a_writer_besides_infra_admin() -> None:
    """A new top-level prefix in runstore needs a decision here: which role writes it."""
    for prefix in runstore.PREFIXES:
        writers = [r.name for r in access.ROLES if any(p.split("/")[0] in (prefix, "*") for p in r.write)]
        assert set(writers) - {"infra-admin"}, prefix
    for role in access.ROLES:
        for pattern in (*role.read, *role.write, *role.delete):
            assert pattern == "*" or pattern.split("/")[0] in runstore.PREFIXES, (role.name, pattern)


def test_the_store_keys_infractl_writes_lie_under_the_prefixes() -> None:
    keys = [
        runstore.run_prefix("r"),
        runstore.checkpoint_prefix("r", 1),
        runstore.plan_measured_key("r"),
        runstore.bench_prefix("b"),
        runstore.drill_key("r", "d"),
        runstore.profile_trace_key("r", 1, 2, 0),
    ]
    assert {k.split("/")[0] for k in keys} <= set(runstore.PREFIXES)


def test_group_names_fit_in_32_characters_and_differ_per_state_directory(tmp_path: Path) -> None:
    long = "c" * 39 + "x"
    one, two = ClusterState(long, tmp_path / "a" / long), ClusterState(long, tmp_path / "b" / long)
    for role in access.ROLE_NAMES:
        assert len(access.group_name(one, role)) <= 32
        assert access.group_name(one, role) != access.group_name(two, role)
        assert access.policy_name(one, role) == f"infractl-{access.group_name(one, role)}"


def test_policies_are_scoped_to_the_bucket_and_prefix(tmp_path: Path) -> None:
    store = open_store("s3://team-bucket/ml/store?endpoint_url=http://127.0.0.1:9", field="store")
    policies = {r.role: store.access_policy(r) for r in access.rights(ClusterState("c", tmp_path))}
    for role, policy in policies.items():
        for statement in policy["Statement"]:
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            for resource in resources:
                if resource.startswith("arn:aws:s3:::"):
                    assert resource == "arn:aws:s3:::team-bucket" or resource.startswith(
                        "arn:aws:s3:::team-bucket/ml/store/"
                    ), (role, resource)
        listing = next(s for s in policy["Statement"] if s["Sid"] == "List")
        assert listing["Condition"] == {"StringLike": {"s3:prefix": ["ml/store/*"]}}
    actions = {role: {s["Sid"] for s in p["Statement"]} for role, p in policies.items()}
    assert actions == {
        "viewer": {"List", "Read"},
        "operator": {"List", "Read", "Write", "Delete", "NodesOnly"},
        "config-admin": {"List", "Read", "Write", "NodesOnly"},
        "infra-admin": {
            "List",
            "Read",
            "Write",
            "Delete",
            "NodesOnly",
            "ReadPolicies",
            "FindPolicies",
            "AttachPolicies",
        },
    }
    # Every role that writes is denied the checkpoints, explicitly (no other policy can allow it back).
    for role in ("operator", "config-admin", "infra-admin"):
        denied = next(s for s in policies[role]["Statement"] if s["Sid"] == "NodesOnly")
        assert denied["Effect"] == "Deny" and "s3:PutObject" in denied["Action"], role
        assert denied["Resource"] == ["arn:aws:s3:::team-bucket/ml/store/runs/*/ckpt/*"], role


# What changes an IAM policy document, or gives a principal a document of its own choosing.
POLICY_CHANGING = (
    "iam:CreatePolicy",
    "iam:CreatePolicyVersion",
    "iam:DeletePolicy",
    "iam:DeletePolicyVersion",
    "iam:SetDefaultPolicyVersion",
    "iam:PutUserPolicy",
    "iam:PutGroupPolicy",
    "iam:PutRolePolicy",
    "iam:DeleteUserPolicy",
    "iam:DeleteGroupPolicy",
    "iam:DeleteRolePolicy",
    "iam:AttachRolePolicy",
    "iam:AttachGroupPolicy",
    "iam:PutUserPermissionsBoundary",
    "iam:PutRolePermissionsBoundary",
    "iam:UpdateAssumeRolePolicy",
    "iam:CreateRole",
    "iam:PassRole",
)


def test_no_role_may_change_a_policy_document(tmp_path: Path) -> None:
    """infra-admin grants roles by attaching the roles' policies to users, nothing more: an
    action that changes a document (its own included) would make a member an account admin."""
    store = open_store("s3://team-bucket/ml/store?endpoint_url=http://127.0.0.1:9", field="store")
    state = ClusterState("c", tmp_path)
    policies = {r.role: store.access_policy(r) for r in access.rights(state)}
    ours = [f"arn:aws:iam::*:policy/infractl/{access.policy_name(state, role)}" for role in access.ROLE_NAMES]
    for role, policy in policies.items():
        for statement in policy["Statement"]:
            granted = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            if statement["Effect"] != "Allow":
                continue
            changing = [a for a in POLICY_CHANGING for g in granted if fnmatch.fnmatchcase(a.lower(), g.lower())]
            assert changing == [], (role, statement)
            if any(g.startswith("iam:Attach") or g.startswith("iam:Detach") for g in granted):
                assert statement["Condition"] == {"ArnLike": {"iam:PolicyARN": ours}}, (role, statement)
    granting = [r for r, p in policies.items() if any(s["Sid"] == "AttachPolicies" for s in p["Statement"])]
    assert granting == ["infra-admin"]


# -- the store side on S3: moto with IAM authorization on --------------------------------------------

SEEDED = {
    "runs/r/run.json": b"{}",
    "runs/r/metrics/00000001-1.jsonl": b'{"step": 1}\n',
    "runs/r/ckpt/step-00000001/COMMITTED": b"1",
    "datasets/d/manifest.json": b"{}",
    "configs/c.yaml": b"name: c\n",
    "bench/b/baseline.json": b"{}",
    "plan/r/measured.json": b"{}",
}


def _allowed(call: Any, **request: Any) -> bool:
    """Whether an S3 request went through: True, or False on AccessDenied (anything else fails)."""
    from botocore.exceptions import ClientError

    try:
        call(**request)
        return True
    except ClientError as e:
        assert e.response["Error"]["Code"] == "AccessDenied", e.response
        return False


@dataclass(frozen=True)
class IamStore:
    """A store on the IAM-checking server, one IAM user per role, and each user's S3 client."""

    server: S3AuthServer
    state: ClusterState
    store: Store
    prefix: str
    users: dict[str, str]  # role -> IAM user name
    keys: dict[str, dict[str, str]]  # role -> that user's credentials (boto3's keyword arguments)
    clients: dict[str, Any]  # role -> that user's S3 client

    def key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def members(self, *roles: str) -> dict[str, list[str]]:
        return {role: [self.users[role]] for role in roles}


def _admin_iam(server: S3AuthServer) -> Any:
    return _iam_as(server, aws_access_key_id=server.access_key_id, aws_secret_access_key=server.secret_access_key)


@contextlib.contextmanager
def _credentials(monkeypatch: pytest.MonkeyPatch, keys: dict[str, str]) -> Iterator[None]:
    """boto3's credential chain finds ``keys`` inside the block (the fixture's admin after it)."""
    with monkeypatch.context() as m:
        m.setenv("AWS_ACCESS_KEY_ID", keys["aws_access_key_id"])
        m.setenv("AWS_SECRET_ACCESS_KEY", keys["aws_secret_access_key"])
        yield


def _iam_as(server: S3AuthServer, **credentials: str) -> Any:
    import boto3
    from botocore.config import Config

    retries = Config(retries={"mode": "standard", "max_attempts": 2})
    return boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1", config=retries, **credentials)


@pytest.fixture
def iam_store(s3_auth_server: S3AuthServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[IamStore]:

    for name, value in s3_auth_server.env().items():
        monkeypatch.setenv(name, value)  # the store acts as the admin, as `infractl access` would
    iam = _admin_iam(s3_auth_server)
    tag = uuid.uuid4().hex[:8]
    state = ClusterState(f"iam-{tag}", tmp_path / f"iam-{tag}")
    prefix = f"store-{tag}"
    store = open_store(f"s3://{s3_auth_server.bucket}/{prefix}?endpoint_url={s3_auth_server.endpoint}")
    for key, data in SEEDED.items():
        store.put_bytes(key, data)
    users, keys, clients = {}, {}, {}
    for role in access.ROLE_NAMES:
        users[role] = f"{role}-{tag}"
        iam.create_user(UserName=users[role])
        key = iam.create_access_key(UserName=users[role])["AccessKey"]
        keys[role] = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
        clients[role] = s3_client(s3_auth_server.endpoint, **keys[role])
    yield IamStore(s3_auth_server, state, store, prefix, users, keys, clients)
    store.remove_access(access.rights(state))


def test_each_role_gets_exactly_its_rights_in_an_s3_store(iam_store: IamStore) -> None:
    s = iam_store
    s.store.apply_access(access.rights(s.state), s.members(*access.ROLE_NAMES))

    bucket = {"Bucket": s.server.bucket}
    readable_by_viewer = {"runs/r/run.json", "runs/r/metrics/00000001-1.jsonl"}
    writes = {"viewer": set(), "operator": {"runs", "plan", "bench"}, "config-admin": {"datasets", "configs"}}
    deletes = {"viewer": set(), "operator": {"runs"}, "config-admin": set()}
    for role, client in s.clients.items():
        assert _allowed(client.list_objects_v2, **bucket, Prefix=s.key("runs/")), role
        for key in SEEDED:
            may_read = role != "viewer" or key in readable_by_viewer
            assert _allowed(client.get_object, **bucket, Key=s.key(key)) == may_read, (role, key)
        for top in runstore.PREFIXES:
            probe = s.key(f"{top}/probe-{role}")
            may_write = role == "infra-admin" or top in writes[role]
            assert _allowed(client.put_object, **bucket, Key=probe, Body=b"x") == may_write, (role, top)
            # Only infra-admin deletes anywhere (the whole prefix); operators where the trainers do.
            may_delete = role == "infra-admin" or top in deletes[role]
            assert _allowed(client.delete_object, **bucket, Key=probe) == may_delete, (role, top)


def test_no_role_writes_a_checkpoint_in_an_s3_store(iam_store: IamStore) -> None:
    """Only the nodes write under runs/<run>/ckpt/: torch unpickles what the trainer resumes from.
    Not even infra-admin, whose other rights are the whole prefix; deleting stays where it was."""
    s = iam_store
    s.store.apply_access(access.rights(s.state), s.members(*access.ROLE_NAMES))

    bucket = {"Bucket": s.server.bucket}
    planted = ["runs/r/ckpt/step-00000001/.metadata", "runs/r/ckpt/step-99999999/COMMITTED", "runs/next/ckpt/x"]
    for role, client in s.clients.items():
        for key in planted:
            assert not _allowed(client.put_object, **bucket, Key=s.key(key), Body=b"x"), (role, key)
        source = {"Bucket": s.server.bucket, "Key": s.key("runs/r/run.json")}
        copy = {**bucket, "Key": s.key("runs/r/ckpt/step-00000001/copied"), "CopySource": source}
        assert not _allowed(client.copy_object, **copy), role
        # What a role writes beside the checkpoints it still writes (the run's own records).
        assert _allowed(client.put_object, **bucket, Key=s.key("runs/r/drills/d.json"), Body=b"{}") == (
            role in ("operator", "infra-admin")
        ), role
    committed = s.key("runs/r/ckpt/step-00000001/COMMITTED")
    assert not _allowed(s.clients["viewer"].delete_object, **bucket, Key=committed)
    assert _allowed(s.clients["operator"].delete_object, **bucket, Key=committed)  # train --new, retention


def test_a_granting_member_cannot_change_a_policy_document(
    iam_store: IamStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member of infra-admin, with their own credentials: no policy document of the account
    changes, their own role's included; granting (attaching the roles' policies as they are)
    still works, and a grant that would need a document changed says who must run it."""
    from botocore.exceptions import ClientError

    s = iam_store
    s.store.apply_access(access.rights(s.state), s.members("infra-admin"))
    admin, member = _admin_iam(s.server), _iam_as(s.server, **s.keys["infra-admin"])
    name = access.policy_name(s.state, "infra-admin")
    [policy] = [
        p for p in admin.list_policies(Scope="Local", PathPrefix="/infractl/")["Policies"] if p["PolicyName"] == name
    ]
    # moto authorizes an IAM call against Resource "*" (no ARN of a policy or user matches there): the
    # member also gets the role's own IAM statements on "*", so every call runs as on AWS.
    granted = admin.get_policy_version(PolicyArn=policy["Arn"], VersionId=policy["DefaultVersionId"])
    widened = [
        {"Effect": "Allow", "Action": statement["Action"], "Resource": "*"}
        for statement in granted["PolicyVersion"]["Document"]["Statement"]
        if "iam:" in json.dumps(statement["Action"])
    ]
    assert len(widened) == 3  # ReadPolicies, FindPolicies, AttachPolicies
    admin.put_user_policy(
        UserName=s.users["infra-admin"],
        PolicyName="as-on-aws",
        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": widened}),
    )

    everything = json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    )
    attempts = {
        "create a version of its own policy": lambda: member.create_policy_version(
            PolicyArn=policy["Arn"], PolicyDocument=everything, SetAsDefault=True
        ),
        "make an older version the default": lambda: member.set_default_policy_version(
            PolicyArn=policy["Arn"], VersionId="v1"
        ),
        "create a policy": lambda: member.create_policy(PolicyName=f"mine-{s.prefix}", PolicyDocument=everything),
        "write an inline policy": lambda: member.put_user_policy(
            UserName=s.users["infra-admin"], PolicyName="mine", PolicyDocument=everything
        ),
        "delete its own policy": lambda: member.delete_policy(PolicyArn=policy["Arn"]),
    }
    for what, attempt in attempts.items():
        with pytest.raises(ClientError) as refused:
            attempt()
        assert refused.value.response["Error"]["Code"] == "AccessDenied", what
    versions = admin.list_policy_versions(PolicyArn=policy["Arn"])["Versions"]
    assert [(v["VersionId"], v["IsDefaultVersion"]) for v in versions] == [("v1", True)]

    # `infractl access grant` run by the member: the store acts with their credentials.
    with _credentials(monkeypatch, s.keys["infra-admin"]):
        as_member = open_store(f"s3://{s.server.bucket}/{s.prefix}?endpoint_url={s.server.endpoint}")
        as_member.apply_access(access.rights(s.state), s.members("infra-admin", "viewer"))
        metrics = {"Bucket": s.server.bucket, "Key": s.key("runs/r/metrics/00000001-1.jsonl")}
        assert _allowed(s.clients["viewer"].get_object, **metrics)
        moved = open_store(f"s3://{s.server.bucket}/{s.prefix}-moved?endpoint_url={s.server.endpoint}")
        with pytest.raises(StoreError, match=r"IAM: cannot update policy .+: AccessDenied.*; policies are made"):
            moved.apply_access(access.rights(s.state), s.members("infra-admin", "viewer"))
    admin.delete_user_policy(UserName=s.users["infra-admin"], PolicyName="as-on-aws")


def test_a_key_a_role_cannot_read_is_missing_only_when_a_listing_says_so(
    iam_store: IamStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 answers 403 for a missing key where ListBucket needs the store's prefix (as the roles'
    and the nodes' does): the store lists the key itself to tell a missing key from a refused one."""
    s = iam_store
    s.store.apply_access(access.rights(s.state), s.members("viewer"))
    with _credentials(monkeypatch, s.keys["viewer"]):
        viewer = open_store(f"s3://{s.server.bucket}/{s.prefix}?endpoint_url={s.server.endpoint}")
        assert viewer.get_bytes("runs/r/run.json") == b"{}"  # its client holds the viewer's credentials now

    with pytest.raises(StoreKeyError):
        viewer.get_bytes("runs/r/ckpt/step-00000002/COMMITTED")  # 403 from S3: the viewer reads no checkpoint
    assert not viewer.exists("runs/r/ckpt/step-00000002/COMMITTED")
    with pytest.raises(StoreError, match="AccessDenied|403") as refused:
        viewer.get_bytes("runs/r/ckpt/step-00000001/COMMITTED")
    assert not isinstance(refused.value, StoreKeyError)
    with pytest.raises(StoreError, match="403"):
        viewer.exists("runs/r/ckpt/step-00000001/COMMITTED")
    assert viewer.get_bytes("runs/r/run.json") == b"{}"


def test_a_store_at_the_root_of_a_bucket_gets_no_access_roles(iam_store: IamStore, tmp_path: Path) -> None:
    whole = open_store(f"s3://{iam_store.server.bucket}?endpoint_url={iam_store.server.endpoint}", field="store")
    with pytest.raises(ConfigError, match=r"access roles need the store under a prefix of bucket") as refused:
        whole.apply_access(access.rights(iam_store.state), iam_store.members("viewer"))
    assert refused.value.field == "store"
    names = [p["PolicyName"] for p in _admin_iam(iam_store.server).list_policies(Scope="Local")["Policies"]]
    assert access.policy_name(iam_store.state, "viewer") not in names


def test_revoke_detaches_every_right_at_once(iam_store: IamStore) -> None:
    s = iam_store
    metrics = {"Bucket": s.server.bucket, "Key": s.key("runs/r/metrics/00000001-1.jsonl")}
    s.store.apply_access(access.rights(s.state), s.members("viewer", "operator"))
    assert _allowed(s.clients["viewer"].get_object, **metrics)

    s.store.apply_access(access.rights(s.state), s.members("operator"))

    assert not _allowed(s.clients["viewer"].get_object, **metrics)
    assert not _allowed(s.clients["viewer"].list_objects_v2, Bucket=s.server.bucket, Prefix=s.key(""))
    assert _allowed(s.clients["operator"].get_object, **metrics)

    s.store.remove_access(access.rights(s.state))  # teardown's path: every policy detached and gone
    assert not _allowed(s.clients["operator"].get_object, **metrics)


def test_a_policy_keeps_at_most_five_versions(iam_store: IamStore) -> None:

    s = iam_store
    iam = _admin_iam(s.server)
    for n in range(7):  # a store under another prefix: a new document for the same policies
        moved = open_store(f"s3://{s.server.bucket}/{s.prefix}-{n}?endpoint_url={s.server.endpoint}")
        moved.apply_access(access.rights(s.state), s.members("viewer"))
    name = access.policy_name(s.state, "viewer")
    pages = iam.get_paginator("list_policies").paginate(Scope="Local", PathPrefix="/infractl/")
    [policy] = [p for page in pages for p in page["Policies"] if p["PolicyName"] == name]
    versions = iam.list_policy_versions(PolicyArn=policy["Arn"])["Versions"]
    assert len(versions) == 5
    default = iam.get_policy_version(PolicyArn=policy["Arn"], VersionId=policy["DefaultVersionId"])
    assert f"{s.prefix}-6/" in json.dumps(default["PolicyVersion"]["Document"])


def test_an_unknown_iam_user_is_named(iam_store: IamStore) -> None:
    with pytest.raises(UnknownUser) as err:
        iam_store.store.apply_access(access.rights(iam_store.state), {"viewer": ["nobody-here"]})
    assert err.value.user == "nobody-here"
    assert "no user named 'nobody-here'" in str(err.value)


# -- `infractl access` on a real local cluster ---------------------------------------------------------


@dataclass(frozen=True)
class Team:
    """A cluster that is up, and two throwaway Unix users that hold no role yet."""

    cli: Cli
    viewer: str
    operator: str

    @property
    def state(self) -> ClusterState:
        return ClusterState("local", self.cli.home / "local")

    @property
    def node(self) -> Path:
        return self.state.dir / "nodes" / "node-0"

    @property
    def store(self) -> Path:
        return self.state.dir / "store"

    def group(self, role: str) -> str:
        return access.group_name(self.state, role)


def _as(user: str, *argv: str) -> bool:
    """Whether ``argv`` succeeds run as ``user`` (the kernel checks the ACLs and groups)."""
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, timeout=30).returncode == 0


def _members(group: str) -> list[str]:
    return sorted(grp.getgrnam(group).gr_mem)


@contextlib.contextmanager
def _throwaway_users(*roles: str) -> Iterator[list[str]]:
    names = [f"ix{uuid.uuid4().hex[:8]}{role[:2]}" for role in roles]
    try:
        for name in names:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        yield names
    finally:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True, check=False)


def test_no_role_writes_a_checkpoint_in_a_file_store() -> None:
    """The store's ACLs as the kernel enforces them, for the roles that write under runs/: no role
    group writes a checkpoint the trainer made (after the grant: default ACLs), plants one for a
    run to come, or swaps a run's ckpt/ or the whole runs/ for its own."""
    root = Path(tempfile.mkdtemp(prefix="infractl-acl-"))
    root.chmod(0o711)  # others pass through to the store, as on a real machine
    state = ClusterState(f"acl-{uuid.uuid4().hex[:6]}", root / "state")
    writers = ("operator", "infra-admin")
    try:
        groups = [access.group_name(state, role) for role in access.ROLE_NAMES]
        with _throwaway_groups(*groups), _throwaway_users(*writers) as users:
            for user, role in zip(users, writers, strict=True):
                subprocess.run(["usermod", "-a", "-G", access.group_name(state, role), user], check=True)
            (root / "store").mkdir()
            store = open_store((root / "store").as_uri())
            store.apply_access(access.rights(state), {})
            # What the nodes write later, as root: the trainer's checkpoint and the run's records.
            store.put_bytes("runs/r/ckpt/step-00000001/.metadata", b"pickled")
            store.put_bytes("runs/r/run.json", b"{}")
            runs = root / "store" / "runs"
            step = runs / "r" / "ckpt" / "step-00000001"
            for user in users:
                assert _as(user, "cat", str(step / ".metadata")), user
                for argv in (
                    ["sh", "-c", f"echo evil > {step / '.metadata'}"],
                    ["touch", str(step / "planted")],
                    ["mkdir", str(runs / "r" / "ckpt" / "step-99999999")],
                    ["mv", str(runs / "r" / "ckpt"), str(runs / "r" / "aside")],
                    ["mkdir", str(runs / "next")],
                    ["mv", str(runs), str(root / "store" / "aside")],
                ):
                    assert not _as(user, *argv), (user, argv)
            assert (step / ".metadata").read_bytes() == b"pickled"
            assert sorted(p.name for p in runs.iterdir()) == ["r"]
            # Their other writes stay: an operator's measurements, an infra-admin's datasets.
            assert _as(users[0], "touch", str(root / "store" / "plan" / "probe"))
            assert _as(users[1], "touch", str(root / "store" / "datasets" / "probe"))
    finally:
        shutil.rmtree(root)


@contextlib.contextmanager
def _throwaway_groups(*names: str) -> Iterator[None]:
    try:
        for name in names:
            subprocess.run(["groupadd", name], check=True)
        yield
    finally:
        for name in names:
            subprocess.run(["groupdel", name], capture_output=True, check=False)


@pytest.fixture(scope="module")
def team(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    # Other users must reach the nodes' directories, as on a real machine: pytest's temporary
    # directories are private to root (and pytest makes them so again whenever a session starts).
    cwd = Path(tempfile.mkdtemp(prefix="infractl-access-"))
    cwd.chmod(0o711)
    try:
        with module_cluster(tmp_path_factory, "access", cwd=cwd) as cli:
            with _throwaway_users("viewer", "operator") as (viewer, operator):
                yield Team(cli, viewer, operator)
            groups = [access.group_name(ClusterState("local", cli.home / "local"), r) for r in access.ROLE_NAMES]
        # module_cluster's teardown removed the groups (its proof raises otherwise): check it did.
        assert [g for g in groups if g in {e.gr_name for e in grp.getgrall()}] == []
    finally:
        shutil.rmtree(cwd)


@pytest.mark.cluster
@pytest.mark.xdist_group("access")
def test_grant_is_enforced_on_the_nodes_and_in_the_store(team: Team) -> None:
    team.cli("access", "grant", team.viewer, "viewer")
    team.cli("access", "grant", team.operator, "operator")

    assert _members(team.group("viewer")) == [team.viewer]
    assert _members(team.group("operator")) == [team.operator]
    acl = subprocess.run(["getfacl", "-cpE", str(team.node / "logs")], capture_output=True, text=True).stdout
    assert f"group:{team.group('viewer')}:r-x" in acl.splitlines()
    assert f"default:group:{team.group('operator')}:r-x" in acl.splitlines()
    # A log file written after the grant, as a node's agent writes it, inherits the default ACL.
    log = team.node / "logs" / "probe.log"
    with log.open("a") as f:
        f.write("written by the node\n")
    # Every role reads the logs; none writes anything on a node, nor reads what root or the
    # trainer keep there (tests/test_security.py attacks it on a netns cluster).
    for user in (team.viewer, team.operator):
        assert _as(user, "cat", str(log))
        assert not _as(user, "test", "-w", str(team.node / "logs"))
        assert not _as(user, "test", "-w", str(team.node))
        assert not _as(user, "ls", str(team.node / "private"))
        assert not _as(user, "ls", str(team.node / "work"))
    # The file store: the same groups' ACLs on its directories.
    store = open_store(team.store.as_uri())
    runstore.write_metrics(store, "r", [{"step": 1, "loss": 1.0}])
    [metrics] = (team.store / "runs" / "r" / "metrics").iterdir()
    assert _as(team.viewer, "cat", str(metrics))
    assert not _as(team.viewer, "test", "-w", str(team.store / "runs" / "r"))
    assert not _as(team.viewer, "ls", str(team.store / "configs"))
    assert not _as(team.operator, "test", "-w", str(team.store / "datasets"))
    # runs/ holds the checkpoints, which only the nodes write: read-only for every role on POSIX.
    assert not _as(team.operator, "test", "-w", str(team.store / "runs" / "r"))
    assert _as(team.operator, "test", "-w", str(team.store / "plan"))

    listed = json.loads(team.cli("access", "list", "--json").stdout)
    assert {role: r["members"] for role, r in listed["roles"].items()} == {
        "viewer": [team.viewer],
        "operator": [team.operator],
        "config-admin": [],
        "infra-admin": [],
    }


@pytest.mark.cluster
@pytest.mark.xdist_group("access")
def test_the_bundle_describes_the_roles_and_their_members(team: Team) -> None:
    files = access_docs.bundle_files(team.state)

    assert files == access_docs.bundle_files(team.state)
    assert sorted(files) == sorted(
        [f"access/{role}.iam.json" for role in access.ROLE_NAMES] + ["access/README.md", "access/members.json"]
    )
    members = json.loads(files["access/members.json"])
    assert members["roles"]["viewer"]["group"] == team.group("viewer")
    assert members["roles"]["viewer"]["members"] == access.load_members(team.state)["viewer"]
    viewer = json.loads(files["access/viewer.iam.json"])  # a file:// store: written for a bucket named BUCKET
    assert {
        "Sid": "Read",
        "Effect": "Allow",
        "Action": ["s3:GetObject"],
        "Resource": [
            "arn:aws:s3:::BUCKET/runs/*/run.json",
            "arn:aws:s3:::BUCKET/runs/*/metrics/*",
            "arn:aws:s3:::BUCKET/runs/*/tensorboard/*",
            "arn:aws:s3:::BUCKET/runs/*/drills/*",
            "arn:aws:s3:::BUCKET/runs/*/chaos/*",
        ],
    } in viewer["Statement"]
    readme = files["access/README.md"].decode()
    for role in access.ROLE_NAMES:
        assert f"| {role} | `{team.group(role)}` |" in readme


@pytest.mark.cluster
@pytest.mark.xdist_group("access")
def test_bad_input_is_refused_and_changes_nothing(team: Team) -> None:
    record = team.state.dir / "access.json"
    before = record.read_bytes() if record.exists() else None
    members = {r: _members(team.group(r)) for r in access.ROLE_NAMES}

    cases = [
        (("grant", team.viewer, "wizard"), "ROLE: unknown role 'wizard' (roles: viewer, operator, config-admin"),
        (("grant", "Not A Name", "viewer"), "USER: 'Not A Name' is not a user name"),
        (("revoke", team.operator, "config-admin"), f"USER: {team.operator!r} is not a member of role 'config-admin'"),
    ]
    for args, message in cases:
        result = team.cli("access", *args, expect=2)
        assert message in one_line(result.stderr), result.stderr
    # No account on the nodes: the access role's preflight stops every node before any change.
    nobody = f"nobody{uuid.uuid4().hex[:6]}"
    missing = team.cli("access", "grant", nobody, "viewer", "--json", expect=2)
    assert json.loads(missing.stdout)["error"]["field"] == "USER"
    assert f"USER: no user {nobody!r} on node-" in one_line(missing.stderr)

    assert (record.read_bytes() if record.exists() else None) == before
    assert {r: _members(team.group(r)) for r in access.ROLE_NAMES} == members


@pytest.mark.cluster
@pytest.mark.xdist_group("access")
def test_revoke_takes_every_right_back(team: Team) -> None:
    team.cli("access", "grant", team.viewer, "viewer")  # held already if the tests above ran: applied again
    log = team.node / "logs" / "revoke.log"
    log.write_text("a log line\n")
    assert _as(team.viewer, "cat", str(log))

    team.cli("access", "revoke", team.viewer, "viewer")

    assert team.viewer not in _members(team.group("viewer"))
    assert not _as(team.viewer, "cat", str(log))
    assert not _as(team.viewer, "ls", str(team.store / "runs"))
    listed = json.loads(team.cli("access", "list", "--json").stdout)
    assert listed["roles"]["viewer"]["members"] == []


def test_access_needs_a_cluster_that_is_up(cli: Cli) -> None:
    result = cli("access", "list", expect=2)
    assert "cluster 'local' is not up" in one_line(result.stderr)
    assert not cli.home.exists()
