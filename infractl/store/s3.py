"""``s3://BUCKET[/PREFIX]``: an S3 bucket (AWS or any S3-compatible server) through boto3: the
Store operations on it, its access policies, preflights and safeguards, and its URI. How it talks
to S3 (retries, timeouts, transfers, clients, boto3's errors turned into the store's): ``_boto``."""

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
from infractl.store import _boto, _iam
from infractl.store._boto import (
    S3_CHECK_CONNECT_TIMEOUT_S,
    S3_CHECK_MAX_ATTEMPTS,
    S3_CHECK_READ_TIMEOUT_S,
    S3_CONNECT_TIMEOUT_S,
    S3_DELETE_BATCH,
    S3_INTERACTIVE_CONNECT_TIMEOUT_S,
    S3_INTERACTIVE_MAX_ATTEMPTS,
    S3_INTERACTIVE_READ_TIMEOUT_S,
    S3_LIST_PAGE_SIZE,
    S3_MAX_ATTEMPTS,
    S3_MAX_CONCURRENCY,
    S3_MIN_PART_SIZE,
    S3_MULTIPART_CHUNKSIZE,
    S3_MULTIPART_THRESHOLD,
    S3_READ_TIMEOUT_S,
)
from infractl.store.base import ObjectInfo, Store
from infractl.store.errors import StoreKeyError
from infractl.store.rights import RoleRights

__all__ = ["S3Store", "open_s3"]

# A concurrent conditional write on the same key may get 409 ConditionalRequestConflict: retry it.
_CONDITIONAL_CONFLICT_ATTEMPTS = 5

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A bucket's public access block: every setting must be on (``check_safeguards``).
_PUBLIC_ACCESS_BLOCK = ("BlockPublicAcls", "IgnorePublicAcls", "BlockPublicPolicy", "RestrictPublicBuckets")
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_S3_QUERY_KEYS = ("endpoint_url", "region")


class S3Store(Store):
    """An S3 bucket (or a prefix in one) used as the store, through boto3.

    ``endpoint_url`` points at an S3-compatible server (moto, MinIO, ...); it switches to
    path-style addressing, which those servers expect. Credentials come from boto3's standard
    chain only. The tuning knobs default to ``_boto``'s constants; tests lower them.
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
        return _boto.new_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region=self.region,
            max_attempts=max_attempts,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, self.max_concurrency * 2),
        )

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
        return _boto.transfer_config(
            threshold=self.multipart_threshold, chunksize=self.multipart_chunksize, concurrency=self.max_concurrency
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

    def _io(self, action: str, key: str | None) -> AbstractContextManager[None]:
        """boto3's errors turned into the store's (``_boto.translating``)."""
        return _boto.translating(self.uri, action, key, self._reason)

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
                    status, code = _boto.status(e), _boto.code(e)
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

        if _boto.is_missing(e):
            return True
        if _boto.status(e) != 403:
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
        return _boto.new_client(
            "iam",
            endpoint_url=self.endpoint_url,
            region=self.region,
            max_attempts=self.max_attempts,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
        )

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
                if _boto.code(e) != "NoSuchPublicAccessBlockConfiguration":
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
                    if _boto.code(e) != "NoSuchBucketPolicy":
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
        endpoint = self.endpoint_url or self._client_for("check" if checking else "data").meta.endpoint_url
        waited = min(S3_CHECK_READ_TIMEOUT_S, self.read_timeout) if checking else self.read_timeout
        return _boto.reason(e, endpoint=endpoint, read_timeout=waited, checking=checking)


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
