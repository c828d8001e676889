"""The one store API: checkpoints, metrics and run records go through ``Store``.

Two backends sit behind the same methods:

- ``file:///abs/path``: a directory (the local provider's default). Like a bucket, the directory
  must exist (`infractl up` creates the cluster's); the store never creates it, so a store whose
  directory vanished (an unmounted volume, say) fails every call with ``StoreUnavailable``
  instead of silently starting an empty store in its place.
- ``s3://BUCKET[/PREFIX][?endpoint_url=http://HOST:PORT&region=REGION]``: an S3 bucket (AWS or
  any S3-compatible server) through boto3. Keys live under PREFIX. Credentials come only from
  boto3's standard chain (env vars, profile, instance role), never from the URI.

Keys are ``/``-separated relative paths. Writes are atomic (a reader sees the whole object or
none) and ``put_if_absent`` is create-only, which is what the checkpoint commit marker relies on
(S3: ``put_object(IfNoneMatch='*')``). ``Store.check()`` is the preflight: it raises
``ConfigError`` with one line naming the config field when the store cannot be reached or written.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlparse

from infractl.errors import ConfigError

__all__ = [
    "SUPPORTED_SCHEMES",
    "FileStore",
    "ObjectInfo",
    "S3Store",
    "Store",
    "StoreUnavailable",
    "StoreKeyError",
    "open_store",
]

SUPPORTED_SCHEMES = ("file", "s3")

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

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_S3_QUERY_KEYS = ("endpoint_url", "region")


class StoreKeyError(KeyError):
    """The key does not exist in the store."""


class StoreUnavailable(OSError):
    """The store cannot be reached at all (not: a key is missing). Callers retry later."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


class Store(ABC):
    """Object-store semantics over any backend: whole-object puts and gets, prefix listing."""

    uri: str
    #: The config field the store came from, named in error messages (set by ``open_store``).
    field: str = "store"

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; return False if it already did."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def get_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursively), sorted by key."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; return how many were deleted."""

    @abstractmethod
    def check(self) -> None:
        """Verify the store is reachable and writable; raise ``ConfigError`` (one line naming
        ``self.field`` and the reason) if it is not. Leaves nothing behind."""


class FileStore(Store):
    """A directory used as an object store (the local provider's default)."""

    def __init__(self, root: Path, *, field: str = "store") -> None:
        self.root = root.resolve()
        self.uri = self.root.as_uri()
        self.field = field

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if path != self.root and self.root not in path.parents:
            raise ValueError(f"store key escapes the store root: {key!r}")
        return path

    def _root_exists(self) -> None:
        if not self.root.is_dir():
            raise StoreUnavailable(f"store directory {self.root} does not exist (removed or unmounted?)")

    def _parent_of(self, key: str) -> Path:
        """The key's path, its parent directories created below the root (never the root)."""
        final = self._path(key)
        self._root_exists()
        parent = self.root
        for part in final.parent.relative_to(self.root).parts:
            parent = parent / part
            try:
                parent.mkdir(exist_ok=True)
            except FileNotFoundError:  # the root vanished meanwhile
                raise StoreUnavailable(f"store directory {self.root} does not exist (removed or unmounted?)") from None
        return final

    def _write_tmp(self, key: str, data: bytes) -> tuple[Path, Path]:
        final = self._parent_of(key)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return Path(tmp), final

    def put_bytes(self, key: str, data: bytes) -> None:
        tmp, final = self._write_tmp(key, data)
        os.replace(tmp, final)

    def put_file(self, key: str, path: Path) -> None:
        final = self._parent_of(key)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".tmp-")
        os.close(fd)
        shutil.copyfile(path, tmp)
        os.replace(tmp, final)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        tmp, final = self._write_tmp(key, data)
        try:
            # link() fails if the target exists: an atomic create-only publish.
            os.link(tmp, final)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            self._root_exists()
            raise StoreKeyError(key) from None

    def get_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            self._root_exists()
            raise StoreKeyError(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)

    def exists(self, key: str) -> bool:
        if self._path(key).is_file():
            return True
        self._root_exists()
        return False

    def list(self, prefix: str) -> list[ObjectInfo]:
        self._root_exists()
        base = self._path(prefix) if prefix else self.root
        if base.is_file():
            return [ObjectInfo(prefix, base.stat().st_size)]
        if not base.is_dir():
            return []
        found = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                full = Path(dirpath) / name
                try:
                    size = full.stat().st_size
                except FileNotFoundError:
                    continue
                found.append(ObjectInfo(full.relative_to(self.root).as_posix(), size))
        return sorted(found, key=lambda o: o.key)

    def delete_prefix(self, prefix: str) -> int:
        self._root_exists()
        base = self._path(prefix)
        if base.is_file():
            base.unlink()
            return 1
        if not base.is_dir():
            return 0
        count = sum(len(files) for _d, _s, files in os.walk(base))
        shutil.rmtree(base, ignore_errors=True)
        return count

    def create_root(self) -> None:
        """Create the store's directory (`infractl up` does; nothing else creates it)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{self.field}: cannot create {self.uri}: {e.strerror or e}") from None

    def check(self) -> None:
        """Prove a file can be written in the root directory (which must exist)."""
        if not self.root.is_dir():
            raise ConfigError(f"{self.field}: store directory {self.root} does not exist")
        try:
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".tmp-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(self.root) else ""
            raise ConfigError(
                f"{self.field}: cannot write to {self.uri}: {e.strerror or e}{where}"
            ) from None


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

    def __getstate__(self) -> dict[str, Any]:
        # boto3 clients do not pickle (and must not cross a fork): rebuild them lazily.
        state = self.__dict__.copy()
        state["_clients"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _make_client(
        self, *, max_attempts: int, connect_timeout: float, read_timeout: float
    ) -> Any:
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
        return full[len(self.prefix) + 1:] if self.prefix else full

    # -- the Store API --------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._object_key(key), Body=data)

    def put_file(self, key: str, path: Path) -> None:
        # A managed transfer: multipart (parallel parts, each retried) above the threshold. S3
        # publishes an object only when its upload completes, so readers never see half of it.
        self.client.upload_file(
            str(path), self.bucket, self._object_key(key), Config=self._transfer_config()
        )

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create-only write: ``If-None-Match: *``; 412 means the key already existed.

        If the request that created the key is retried after a lost response, the retry sees 412
        too, so False means "the key exists now", not "someone else wrote it".
        """
        from botocore.exceptions import ClientError

        full = self._object_key(key)
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

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key))
        except ClientError as e:
            if _is_missing(e):
                raise StoreKeyError(key) from None
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
            self.client.download_file(self.bucket, full, tmp, Config=self._transfer_config())
            os.replace(tmp, path)  # readers of ``path`` see the old file or the whole new one
        except ClientError as e:
            if _is_missing(e):
                raise StoreKeyError(key) from None
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._object_key(key))
            return True
        except ClientError as e:
            if _is_missing(e):
                return False
            raise

    def _iter_objects(self, prefix: str) -> list[tuple[str, int]]:
        """(bucket key, size) of ``prefix`` itself and of everything under ``prefix/``."""
        base = self._key(prefix)
        is_root = base == self.prefix  # the whole store
        under = f"{base}/" if base else ""
        # S3 prefixes are plain string prefixes: "a/b" also matches "a/bc". Keep FileStore's
        # directory semantics: the key itself, or what lies under "a/b/".
        wide = not is_root and not prefix.endswith("/")
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=base if wide else under,
            PaginationConfig={"PageSize": self.page_size},
        )
        found = []
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
            batch = keys[i:i + self.delete_batch]
            response = self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise OSError(
                    f"{self.uri}: could not delete {len(errors)} of {len(batch)} objects "
                    f"(first: {first.get('Key')}: {first.get('Code')} {first.get('Message')})"
                )
            deleted += len(batch)
        return deleted

    def check(self) -> None:
        """List the prefix (reachable, bucket exists, credentials valid), then put and delete a
        probe object (writable). Uses a client with few retries and short timeouts."""
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
            raise ConfigError(f"{self.field}: cannot {step} {where}: {self._reason(e)}") from None

    def _reason(self, e: Exception) -> str:
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            ReadTimeoutError,
        )

        endpoint = self.endpoint_url or self._client_for("check").meta.endpoint_url
        if isinstance(e, ClientError):
            code, message = _code(e), e.response.get("Error", {}).get("Message", "")
            if code in ("NoSuchBucket", "404"):
                reason = "bucket does not exist"
            elif message and message != code:
                reason = f"{code} ({message.rstrip('.')})"
            else:
                reason = code or f"HTTP {_status(e)}"
        elif isinstance(e, ConnectTimeoutError):
            reason = f"timed out connecting to endpoint {endpoint}"
        elif isinstance(e, ReadTimeoutError):
            waited = min(S3_CHECK_READ_TIMEOUT_S, self.read_timeout)
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


def _status(e: Any) -> int | None:
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _is_missing(e: Any) -> bool:
    return _status(e) == 404 or _code(e) in ("404", "NoSuchKey", "NotFound")


def _s3_uri(bucket: str, prefix: str, endpoint_url: str | None, region: str | None) -> str:
    """The canonical s3:// URI: what ``open_store`` reopens to the same store. Never has secrets."""
    uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    query = [(k, v) for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v]
    if query:
        uri += "?" + "&".join(f"{k}={quote(v, safe=':/')}" for k, v in query)
    return uri


def _open_s3(uri: str, field: str) -> S3Store:
    parsed = urlparse(uri)
    if "@" in parsed.netloc:
        # Do not echo the URI: it holds what looks like a secret.
        raise ConfigError(
            f"{field}: credentials do not belong in an s3:// URI; use AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role"
        )
    bucket = parsed.netloc
    if not _BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"{field}: {uri!r} does not name a valid bucket (s3://BUCKET[/PREFIX]; 3-63 lowercase "
            "letters, digits, '.' or '-')"
        )
    options: dict[str, str] = {}
    for key, value in parse_qsl(parsed.query, keep_blank_values=True):
        if key not in _S3_QUERY_KEYS:
            allowed = ", ".join(_S3_QUERY_KEYS)
            raise ConfigError(f"{field}: unknown s3:// URI option {key!r} (allowed: {allowed})")
        if key in options:
            raise ConfigError(f"{field}: s3:// URI option {key!r} given twice")
        if not value:
            raise ConfigError(f"{field}: s3:// URI option {key!r} is empty")
        options[key] = value
    endpoint = options.get("endpoint_url")
    if endpoint is not None:
        ep = urlparse(endpoint)
        if ep.scheme not in ("http", "https") or not ep.hostname or ep.username or ep.password:
            raise ConfigError(
                f"{field}: endpoint_url must look like http(s)://HOST[:PORT], "
                f"got {ep.scheme}://{ep.hostname or ''}"
            )
    if ".." in parsed.path.split("/"):
        raise ConfigError(f"{field}: the prefix of {uri!r} must not contain '..'")
    region = options.get("region")
    return S3Store(bucket, parsed.path, endpoint_url=endpoint, region=region, field=field)


def open_store(uri: str, *, field: str = "store") -> Store:
    """Open the store named by ``uri``; ``field`` names the config field in error messages.

    Opening checks the URI's shape only; call ``check()`` to reach the store.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"{field}: file:// URIs must be absolute paths, got {uri!r}")
        return FileStore(Path(parsed.path), field=field)
    if parsed.scheme == "s3":
        return _open_s3(uri, field)
    allowed = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    raise ConfigError(f"{field}: unsupported store URI {uri!r} (use {allowed})")
