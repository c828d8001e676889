"""``s3://BUCKET[/PREFIX]``: an S3 bucket (AWS or any S3-compatible server) through boto3."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlparse

import psutil

from infractl.errors import ConfigError, StoreError, UsageError
from infractl.store import _iam
from infractl.store.base import ObjectInfo, Store
from infractl.store.errors import StoreKeyError, StoreUnavailable
from infractl.store.rights import RoleRights

__all__ = ["S3Store", "open_s3"]

_MIB = 1024 * 1024

# --- S3 tuning -------------------------------------------------------------------------------
# Data path (checkpoint uploads, metrics, run records). Checkpoints upload in the background while
# training goes on, so riding out a short store outage or throttling beats failing the save:
# "standard" retry mode backs off exponentially with jitter (capped at 20 s a wait), so 8
# attempts wait out roughly a minute. The timeouts turn a stuck connection into an error (which is
# then retried) instead of a hang: 5 s to connect is ages on a healthy network; 60 s without a
# byte on an open socket means the server is not coming back for this request.
S3_MAX_ATTEMPTS = 8
S3_CONNECT_TIMEOUT_S = 5.0
S3_READ_TIMEOUT_S = 60.0
# check() is a preflight a person is waiting on, before anything changes: fail within seconds.
S3_CHECK_MAX_ATTEMPTS = 2
S3_CHECK_CONNECT_TIMEOUT_S = 3.0
S3_CHECK_READ_TIMEOUT_S = 10.0
# The CLI's reads and writes (status, metrics, run records): a person is waiting too, so a store
# that does not answer is reported within seconds, not after a minute of backing off.
S3_INTERACTIVE_MAX_ATTEMPTS = 2
S3_INTERACTIVE_CONNECT_TIMEOUT_S = 3.0
S3_INTERACTIVE_READ_TIMEOUT_S = 5.0
# Managed transfers: objects above the threshold go multipart, in parallel parts. S3 needs parts
# of at least 5 MiB and allows at most 10,000 of them: 16 MiB parts reach 160 GiB per object,
# far above a checkpoint shard, while keeping the memory in flight small (concurrency x chunk).
S3_MULTIPART_THRESHOLD = 64 * _MIB
S3_MULTIPART_CHUNKSIZE = 16 * _MIB
S3_MIN_PART_SIZE = 5 * _MIB
S3_MAX_CONCURRENCY = 4
# ListObjectsV2 returns at most 1000 keys a page; DeleteObjects takes at most 1000 keys a call.
S3_LIST_PAGE_SIZE = 1000
S3_DELETE_BATCH = 1000
# A concurrent conditional write on the same key may get 409 ConditionalRequestConflict: retry it.
_CONDITIONAL_CONFLICT_ATTEMPTS = 5
# Error codes that mean "try again later", as 5xx statuses do: the store is unavailable for now.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
    }
)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A bucket's public access block: every setting must be on (``check_safeguards``).
_PUBLIC_ACCESS_BLOCK = ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets")
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_S3_QUERY_KEYS = ("endpoint_url", "region")


class S3Store(Store):
    """An S3 bucket (or a prefix in one) used as the store, through boto3.

    ``endpoint_url`` points at an S3-compatible server (moto, MinIO, ...); it switches to
    path-style addressing, which those servers expect. Credentials come from boto3's standard
    chain only. The tuning knobs default to the module constants; tests lower them.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        field: str = "store",
        max_attempts: int = S3_MAX_ATTEMPTS,
        connect_timeout: float = S3_CONNECT_TIMEOUT_S,
        read_timeout: float = S3_READ_TIMEOUT_S,
        multipart_threshold: int = S3_MULTIPART_THRESHOLD,
        multipart_chunksize: int = S3_MULTIPART_CHUNKSIZE,
        max_concurrency: int = S3_MAX_CONCURRENCY,
        page_size: int = S3_LIST_PAGE_SIZE,
        delete_batch: int = S3_DELETE_BATCH,
    ) -> None:
        if multipart_chunksize < S3_MIN_PART_SIZE:
            raise ValueError(f"multipart_chunksize must be at least {S3_MIN_PART_SIZE} bytes")
        if not 1 <= page_size <= 1000 or not 1 <= delete_batch <= 1000:
            raise ValueError("page_size and delete_batch must be between 1 and 1000")
        self.bucket = bucket
        self.prefix = "/".join(p for p in prefix.split("/") if p)
        self.endpoint_url = endpoint_url.rstrip("/") if endpoint_url else None
        self.region = region
        self.field = field
        self.max_attempts = max_attempts
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.max_concurrency = max_concurrency
        self.page_size = page_size
        self.delete_batch = delete_batch
        self.uri = _s3_uri(bucket, self.prefix, self.endpoint_url, region)
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    # -- plumbing -----------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r})"

    def location(self, key: str) -> str:
        # The object's s3:// URL (what `aws s3 cp` takes); the endpoint is in ``uri``.
        return f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}{key}"

    def __getstate__(self) -> dict[str, Any]:
        # boto3 clients do not pickle (and must not cross a fork): rebuild them lazily.
        state = self.__dict__.copy()
        state["_clients"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _make_client(self, *, max_attempts: int, connect_timeout: float, read_timeout: float) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, self.max_concurrency * 2),
            s3={"addressing_style": "path"} if self.endpoint_url else None,
        )
        # A session per store: boto3's default session is not thread-safe to create clients from.
        session = boto3.session.Session(region_name=self.region)
        return session.client("s3", endpoint_url=self.endpoint_url, config=config)

    def _client_for(self, kind: str) -> Any:
        with self._lock:
            client = self._clients.get(kind)
            if client is None:
                if kind == "check":
                    client = self._make_client(
                        max_attempts=min(S3_CHECK_MAX_ATTEMPTS, self.max_attempts),
                        connect_timeout=min(S3_CHECK_CONNECT_TIMEOUT_S, self.connect_timeout),
                        read_timeout=min(S3_CHECK_READ_TIMEOUT_S, self.read_timeout),
                    )
                else:
                    client = self._make_client(
                        max_attempts=self.max_attempts,
                        connect_timeout=self.connect_timeout,
                        read_timeout=self.read_timeout,
                    )
                self._clients[kind] = client
            return client

    @property
    def client(self) -> Any:
        """The boto3 S3 client of the data path (created on first use)."""
        return self._client_for("data")

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.multipart_chunksize,
            max_concurrency=self.max_concurrency,
            use_threads=True,
        )

    def _key(self, key: str) -> str:
        """The bucket key of store key ``key`` (empty parts and ``.`` dropped, ``..`` refused)."""
        parts = [p for p in key.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"store key escapes the store root: {key!r}")
        if not parts and key.strip("/."):
            raise ValueError(f"invalid store key: {key!r}")
        return "/".join([self.prefix, *parts] if self.prefix else parts)

    def _object_key(self, key: str) -> str:
        full = self._key(key)
        if not full or full == self.prefix:
            raise ValueError(f"invalid store key: {key!r}")
        return full

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    @contextlib.contextmanager
    def _io(self, action: str, key: str | None) -> Iterator[None]:
        """Turn boto3's errors into the store's: ``StoreUnavailable`` when the endpoint cannot be
        reached or answers "later" (5xx, throttling, after the client's own retries), else
        ``StoreError`` (access denied, no such bucket). One line naming the store and the cause."""
        from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except StoreError:
            raise
        except ClientError as e:
            raise self._translate(e, action, key) from e
        except (S3UploadFailedError, S3TransferFailedError) as e:
            # The managed transfer wraps the client's error; classify that one when it is there.
            inner = e.__context__
            if isinstance(inner, ClientError):
                raise self._translate(inner, action, key) from e
            raise StoreUnavailable(self.uri, f"{_doing(action, key)}: {' '.join(str(e).split())}") from e
        except BotoCoreError as e:
            raise StoreUnavailable(self.uri, f"{_doing(action, key)}: {self._reason(e)}") from e

    def _translate(self, e: Any, action: str, key: str | None) -> StoreError:
        cause = f"{_doing(action, key)}: {self._reason(e)}"
        status = _status(e)
        if (status is not None and status >= 500) or _code(e) in _TRANSIENT_CODES:
            return StoreUnavailable(self.uri, cause)
        return StoreError(self.uri, cause)

    # -- the Store API --------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._io("write", key):
            self.client.put_object(Bucket=self.bucket, Key=self._object_key(key), Body=data)

    def put_file(self, key: str, path: Path) -> None:
        # A managed transfer: multipart (parallel parts, each retried) above the threshold. S3
        # publishes an object only when its upload completes, so readers never see half of it.
        with self._io("write", key):
            self.client.upload_file(str(path), self.bucket, self._object_key(key), Config=self._transfer_config())

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create-only write: ``If-None-Match: *``; 412 means the key already existed.

        If the request that created the key is retried after a lost response, the retry sees 412
        too, so False means "the key exists now", not "someone else wrote it".
        """
        from botocore.exceptions import ClientError

        full = self._object_key(key)
        with self._io("write", key):
            for attempt in range(_CONDITIONAL_CONFLICT_ATTEMPTS):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
                    return True
                except ClientError as e:
                    status, code = _status(e), _code(e)
                    if status == 412 or code == "PreconditionFailed":
                        return False
                    # 409: a concurrent conditional write to this key is in flight; S3 says retry.
                    conflict = status == 409 or code == "ConditionalRequestConflict"
                    if conflict and attempt + 1 < _CONDITIONAL_CONFLICT_ATTEMPTS:
                        time.sleep(0.1 * 2**attempt)
                        continue
                    raise
        raise AssertionError("unreachable")

    def copy(self, key: str, to: str) -> None:
        # A managed copy: server-side, multipart above the threshold (a single CopyObject stops at 5 GB).
        from botocore.exceptions import ClientError

        source = {"Bucket": self.bucket, "Key": self._object_key(key)}
        with self._io("copy", key):
            try:
                self.client.copy(source, self.bucket, self._object_key(to), Config=self._transfer_config())
            except ClientError as e:
                if self._missing(e, source["Key"]):
                    raise StoreKeyError(self.uri, key) from None
                raise

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        full = self._object_key(key)
        with self._io("read", key):
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=full)
            except ClientError as e:
                if self._missing(e, full):
                    raise StoreKeyError(self.uri, key) from None
                raise
            with response["Body"] as body:
                return body.read()  # type: ignore[no-any-return]

    def get_file(self, key: str, path: Path) -> None:
        from botocore.exceptions import ClientError

        full = self._object_key(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
        os.close(fd)
        try:
            with self._io("read", key):
                try:
                    self.client.download_file(self.bucket, full, tmp, Config=self._transfer_config())
                except ClientError as e:
                    if self._missing(e, full):
                        raise StoreKeyError(self.uri, key) from None
                    raise
            os.replace(tmp, path)  # readers of ``path`` see the old file or the whole new one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        full = self._object_key(key)
        with self._io("look up", key):
            try:
                self.client.head_object(Bucket=self.bucket, Key=full)
                return True
            except ClientError as e:
                if self._missing(e, full):
                    return False
                raise

    def _missing(self, e: Any, full: str) -> bool:
        """Whether a read of bucket key ``full`` failed because there is no such object: a 404,
        or a 403 where a listing of the key finds nothing. S3 answers a missing key with 404 only
        to a caller whose ListBucket covers its own check, which names no prefix; the roles' and
        the nodes' ListBucket requires the store's prefix (no listing of the whole bucket), so
        they get 403. Listing the key itself lies under the prefix and tells the two apart."""
        from botocore.exceptions import BotoCoreError, ClientError

        if _is_missing(e):
            return True
        if _status(e) != 403:
            return False
        try:
            listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=full, MaxKeys=1)
        except (BotoCoreError, ClientError):
            return False  # the read's own refusal is the answer
        # ``full`` sorts first among the keys it prefixes: the listing's one key is it, if it exists.
        return not any(o["Key"] == full for o in listed.get("Contents", []))

    def _iter_objects(self, prefix: str) -> list[tuple[str, int]]:
        """(bucket key, size) of ``prefix`` itself and of everything under ``prefix/``."""
        base = self._key(prefix)
        is_root = base == self.prefix  # the whole store
        under = f"{base}/" if base else ""
        # S3 prefixes are plain string prefixes: "a/b" also matches "a/bc". Keep FileStore's
        # directory semantics: the key itself, or what lies under "a/b/".
        wide = not is_root and not prefix.endswith("/")
        found = []
        with self._io("list", prefix):
            paginator = self.client.get_paginator("list_objects_v2")
            pages = paginator.paginate(
                Bucket=self.bucket,
                Prefix=base if wide else under,
                PaginationConfig={"PageSize": self.page_size},
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    full = obj["Key"]
                    if full.startswith(under) or (wide and full == base):
                        found.append((full, int(obj["Size"])))
        return found

    def list(self, prefix: str) -> list[ObjectInfo]:
        found = [ObjectInfo(self._relative(k), size) for k, size in self._iter_objects(prefix)]
        return sorted(found, key=lambda o: o.key)

    def delete_prefix(self, prefix: str) -> int:
        keys = [full for full, _size in self._iter_objects(prefix)]
        deleted = 0
        for i in range(0, len(keys), self.delete_batch):
            batch = keys[i : i + self.delete_batch]
            with self._io("delete", prefix):
                response = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise StoreError(
                    self.uri,
                    f"could not delete {len(errors)} of {len(batch)} objects under {prefix!r} "
                    f"(first: {first.get('Key')}: {first.get('Code')} {first.get('Message')})",
                )
            deleted += len(batch)
        return deleted

    def ping(self) -> None:
        under = f"{self.prefix}/" if self.prefix else ""
        with self._io("reach the store", None):
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=under, MaxKeys=1)

    def ensure(self) -> None:
        """A bucket is provisioned with the cluster's infrastructure, never created here."""
        self.check()

    # -- access: one IAM managed policy per role (store/_iam.py) --------------------------------

    def _iam_client(self) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            retries={"mode": "standard", "max_attempts": self.max_attempts},
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
        )
        # An S3-compatible server that speaks IAM (moto) serves it on the store's endpoint; on
        # AWS (no endpoint_url) IAM has its own global endpoint, which boto3 knows.
        session = boto3.session.Session(region_name=self.region)
        return session.client("iam", endpoint_url=self.endpoint_url, config=config)

    def access_policy(self, rights: RoleRights) -> dict[str, Any]:
        """``ConfigError`` for a store at the root of its bucket: a role's rights would span it."""
        if not self.prefix:
            raise ConfigError(
                f"access roles need the store under a prefix of bucket {self.bucket} (s3://{self.bucket}/PREFIX): "
                "their rights are scoped to it, never to a whole bucket",
                field=self.field,
            )
        return _iam.policy_document(self.bucket, self.prefix, rights)

    def apply_access(self, roles: Sequence[RoleRights], members: Mapping[str, Sequence[str]]) -> None:
        """Policy ``rights.policy`` per role holds its document and is attached to exactly the
        role's members (IAM users of the same names)."""
        wanted = [(r.policy, self.access_policy(r), members.get(r.role, ())) for r in roles]
        _iam.apply_policies(self._iam_client(), self.uri, wanted)

    def remove_access(self, roles: Sequence[RoleRights]) -> None:
        _iam.remove_policies(self._iam_client(), self.uri, [r.policy for r in roles])

    def admit_trainer(self, uid: int, *, admitted: bool = True) -> None:
        """Nothing: the nodes reach the bucket with credentials of their own (an instance role,
        the operator's keys where the nodes have none), whatever user their trainer runs as."""

    def outage(self) -> AbstractContextManager[dict[str, Any]]:
        """An S3 endpoint served on this machine (moto, MinIO, ...) is paused (SIGSTOP) and
        resumed: requests hang until the client's timeouts, as with a network partition."""
        server = self._local_endpoint_server()

        @contextlib.contextmanager
        def paused() -> Iterator[dict[str, Any]]:
            server.suspend()
            try:
                yield {"how": "endpoint server stopped (SIGSTOP)", "pid": server.pid}
            finally:
                server.resume()

        return paused()

    def _local_endpoint_server(self) -> psutil.Process:
        endpoint = urlparse(self.endpoint_url or "")
        if endpoint.hostname not in _LOOPBACK or endpoint.port is None:
            raise UsageError(
                f"store-outage: the store {self.uri} is not served on this machine; the drill can take "
                "down a file:// store or an S3 endpoint on loopback (for AWS S3, block the endpoint on "
                "the nodes instead)"
            )
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == endpoint.port and conn.pid:
                return psutil.Process(conn.pid)
        raise UsageError(f"store-outage: no process listens on {endpoint.hostname}:{endpoint.port}")

    def check(self, *, create_ok: bool = False) -> None:
        """List the prefix (reachable, bucket exists, credentials valid), then put and delete a
        probe object (writable). Uses a client with few retries and short timeouts. A bucket is
        never created here, so ``create_ok`` changes nothing."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self._client_for("check")
        where = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        probe = self._key(f".infractl-probe-{uuid.uuid4().hex}")
        step = "reach"
        try:
            # A GET rather than head_bucket: HEAD error responses carry no body, so a bad key or
            # a denied policy would only say "403"; a list names the reason.
            under = f"{self.prefix}/" if self.prefix else ""
            client.list_objects_v2(Bucket=self.bucket, Prefix=under, MaxKeys=1)
            step = "write to"
            client.put_object(Bucket=self.bucket, Key=probe, Body=b"")
            client.delete_object(Bucket=self.bucket, Key=probe)
        except (ClientError, BotoCoreError) as e:
            raise ConfigError(f"cannot {step} {where}: {self._reason(e, checking=True)}", field=self.field) from None

    def check_safeguards(self, *, tls: bool) -> None:
        """A bucket a cluster keeps its store in but does not create: its public access blocked
        (all four settings of the bucket's own block), versioning on (a deleted or overwritten
        checkpoint stays recoverable) and, with ``tls``, a bucket policy that refuses requests
        without TLS. ``ConfigError`` naming ``self.field``: one line saying what to set."""
        from botocore.exceptions import BotoCoreError, ClientError

        client, bucket = self._client_for("check"), self.bucket
        unset: list[str] = []
        try:
            try:
                block = client.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
            except ClientError as e:
                if _code(e) != "NoSuchPublicAccessBlockConfiguration":
                    raise
                block = {}
            if not all(block.get(setting) for setting in _PUBLIC_ACCESS_BLOCK):
                settings = ",".join(f"{setting}=true" for setting in _PUBLIC_ACCESS_BLOCK)
                unset.append(
                    f"its public access block (aws s3api put-public-access-block --bucket {bucket} "
                    f"--public-access-block-configuration {settings})"
                )
            if client.get_bucket_versioning(Bucket=bucket).get("Status") != "Enabled":
                unset.append(
                    f"versioning (aws s3api put-bucket-versioning --bucket {bucket} "
                    "--versioning-configuration Status=Enabled)"
                )
            if tls:
                try:
                    policy = json.loads(client.get_bucket_policy(Bucket=bucket)["Policy"])
                except ClientError as e:
                    if _code(e) != "NoSuchBucketPolicy":
                        raise
                    policy = {}
                if not _refuses_plain_http(policy, bucket):
                    unset.append(
                        "a bucket policy statement that denies s3:* on the bucket and its objects to every "
                        'principal under the condition {"Bool": {"aws:SecureTransport": "false"}} '
                        "(infra/aws/store.tf's DenyInsecureTransport)"
                    )
        except (ClientError, BotoCoreError) as e:
            raise ConfigError(
                f"cannot read the settings of bucket {bucket}: {self._reason(e, checking=True)}", field=self.field
            ) from None
        if unset:
            raise ConfigError(
                f"bucket {bucket} is not safe for a cluster's store (the cluster does not create it): set "
                + "; ".join(unset),
                field=self.field,
            )

    def _reason(self, e: Exception, *, checking: bool = False) -> str:
        """Why a call failed, in one line (``checking``: the preflight client's timeouts applied)."""
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            ReadTimeoutError,
        )

        endpoint = self.endpoint_url or self._client_for("check" if checking else "data").meta.endpoint_url
        if isinstance(e, ClientError):
            code, message = _code(e), e.response.get("Error", {}).get("Message", "")
            if code == "NoSuchBucket" or (checking and code == "404"):
                reason = "bucket does not exist"
            elif message and message != code:
                reason = f"{code} ({message.rstrip('.')})"
            else:
                reason = code or f"HTTP {_status(e)}"
        elif isinstance(e, ConnectTimeoutError):
            reason = f"timed out connecting to endpoint {endpoint}"
        elif isinstance(e, ReadTimeoutError):
            waited = min(S3_CHECK_READ_TIMEOUT_S, self.read_timeout) if checking else self.read_timeout
            reason = f"endpoint {endpoint} did not answer within {waited:g} s"
        elif isinstance(e, EndpointConnectionError):
            reason = f"could not connect to endpoint {endpoint}"
        elif isinstance(e, NoCredentialsError):
            reason = (
                "no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or run with an instance role)"
            )
        else:
            reason = str(e)
        return " ".join(reason.split())  # one line


def _doing(action: str, key: str | None) -> str:
    return f"cannot {action} {key!r}" if key is not None else f"cannot {action}"


def _status(e: Any) -> int | None:
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _refuses_plain_http(policy: Mapping[str, Any], bucket: str) -> bool:
    """Whether a bucket policy denies every S3 action on the bucket and its objects to everyone
    when a request comes without TLS."""

    def listed(value: Any) -> list[Any]:
        return value if isinstance(value, list) else [value]

    statements = listed(policy.get("Statement", []))
    for statement in statements:
        if not isinstance(statement, dict) or statement.get("Effect") != "Deny":
            continue
        if statement.get("Principal") not in ("*", {"AWS": "*"}):
            continue
        if not {"s3:*", "*"} & set(listed(statement.get("Action"))):
            continue
        condition = statement.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport")
        if "false" not in [str(value).lower() for value in listed(condition)]:
            continue
        resources = [str(r) for r in listed(statement.get("Resource"))]
        if "*" in resources or (
            any(r.endswith(f":s3:::{bucket}") for r in resources)
            and any(r.endswith(f":s3:::{bucket}/*") for r in resources)
        ):
            return True
    return False


def _is_missing(e: Any) -> bool:
    return _status(e) == 404 or _code(e) in ("404", "NoSuchKey", "NotFound")


def _s3_uri(bucket: str, prefix: str, endpoint_url: str | None, region: str | None) -> str:
    """The canonical s3:// URI: what ``open_store`` reopens to the same store. Never has secrets."""
    uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    query = [(k, v) for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v]
    if query:
        uri += "?" + "&".join(f"{k}={quote(v, safe=':/')}" for k, v in query)
    return uri


def open_s3(uri: str, *, field: str, interactive: bool = False) -> S3Store:
    """The S3Store of an ``s3://`` URI (``ConfigError`` naming ``field`` for a malformed one);
    ``interactive``: few retries and short timeouts, for a person waiting on the answer."""
    parsed = urlparse(uri)
    if "@" in parsed.netloc:
        # Do not echo the URI: it holds what looks like a secret.
        raise ConfigError(
            "credentials do not belong in an s3:// URI; use AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role",
            field=field,
        )
    bucket = parsed.netloc
    if not _BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"{uri!r} does not name a valid bucket (s3://BUCKET[/PREFIX]; 3-63 lowercase letters, digits, '.' or '-')",
            field=field,
        )
    options: dict[str, str] = {}
    for key, value in parse_qsl(parsed.query, keep_blank_values=True):
        if key not in _S3_QUERY_KEYS:
            allowed = ", ".join(_S3_QUERY_KEYS)
            raise ConfigError(f"unknown s3:// URI option {key!r} (allowed: {allowed})", field=field)
        if key in options:
            raise ConfigError(f"s3:// URI option {key!r} given twice", field=field)
        if not value:
            raise ConfigError(f"s3:// URI option {key!r} is empty", field=field)
        options[key] = value
    endpoint = options.get("endpoint_url")
    if endpoint is not None:
        try:
            ep = urlparse(endpoint)
            port_ok = ep.port is None or ep.port > 0
        except ValueError:  # not a number or out of range; an unbalanced "[" in the host
            ep, port_ok = urlparse(""), False
        if ep.scheme not in ("http", "https") or not ep.hostname or ep.username or ep.password or not port_ok:
            raise ConfigError(
                f"endpoint_url must look like http(s)://HOST[:PORT], got {ep.scheme}://{ep.hostname or ''}",
                field=field,
            )
    if ".." in parsed.path.split("/"):
        raise ConfigError(f"the prefix of {uri!r} must not contain '..'", field=field)
    patience: dict[str, Any] = {}
    if interactive:
        patience = {
            "max_attempts": S3_INTERACTIVE_MAX_ATTEMPTS,
            "connect_timeout": S3_INTERACTIVE_CONNECT_TIMEOUT_S,
            "read_timeout": S3_INTERACTIVE_READ_TIMEOUT_S,
        }
    return S3Store(bucket, parsed.path, endpoint_url=endpoint, region=options.get("region"), field=field, **patience)
