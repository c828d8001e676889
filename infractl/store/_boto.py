"""How the S3 store (``s3.py``) talks to S3 through boto3: its tuning (retries with backoff,
timeouts, multipart transfers, page sizes), its clients, and boto3's errors turned into the
store's, one line each. ``S3Store`` holds the bucket and the Store operations on it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from infractl.errors import StoreError
from infractl.store.errors import StoreUnavailable

__all__ = [
    "S3_CHECK_CONNECT_TIMEOUT_S",
    "S3_CHECK_MAX_ATTEMPTS",
    "S3_CHECK_READ_TIMEOUT_S",
    "S3_CONNECT_TIMEOUT_S",
    "S3_DELETE_BATCH",
    "S3_INTERACTIVE_CONNECT_TIMEOUT_S",
    "S3_INTERACTIVE_MAX_ATTEMPTS",
    "S3_INTERACTIVE_READ_TIMEOUT_S",
    "S3_LIST_PAGE_SIZE",
    "S3_MAX_ATTEMPTS",
    "S3_MAX_CONCURRENCY",
    "S3_MIN_PART_SIZE",
    "S3_MULTIPART_CHUNKSIZE",
    "S3_MULTIPART_THRESHOLD",
    "S3_READ_TIMEOUT_S",
    "code",
    "doing",
    "is_missing",
    "new_client",
    "reason",
    "status",
    "transfer_config",
    "translating",
]

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
# Error codes that mean "try again later", as 5xx statuses do: the store is unavailable for now.
TRANSIENT_CODES = frozenset(
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


def new_client(
    service: str,
    *,
    endpoint_url: str | None,
    region: str | None,
    max_attempts: int,
    connect_timeout: float,
    read_timeout: float,
    max_pool_connections: int | None = None,
) -> Any:
    """A boto3 client of ``service`` ("s3", "iam") with "standard" retries (exponential backoff
    with jitter) and these timeouts. With ``endpoint_url`` (an S3-compatible server: moto,
    MinIO, ...) S3 is addressed path-style, which those servers expect; an S3-compatible server
    that speaks IAM (moto) serves it on the same endpoint, while on AWS (no ``endpoint_url``) IAM
    has its own global endpoint, which boto3 knows."""
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = {}
    if max_pool_connections is not None:
        options["max_pool_connections"] = max_pool_connections
    if service == "s3" and endpoint_url:
        options["s3"] = {"addressing_style": "path"}
    config = Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        **options,
    )
    # A session per client: boto3's default session is not thread-safe to create clients from.
    session = boto3.session.Session(region_name=region)
    return session.client(service, endpoint_url=endpoint_url, config=config)


def transfer_config(*, threshold: int, chunksize: int, concurrency: int) -> Any:
    """boto3's managed transfers: multipart above ``threshold``, in parallel parts."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=threshold, multipart_chunksize=chunksize, max_concurrency=concurrency, use_threads=True
    )


@contextlib.contextmanager
def translating(uri: str, action: str, key: str | None, why: Callable[[Exception], str]) -> Iterator[None]:
    """Turn boto3's errors into the store's: ``StoreUnavailable`` when the endpoint cannot be
    reached or answers "later" (5xx, throttling, after the client's own retries), else
    ``StoreError`` (access denied, no such bucket). One line naming the store ``uri``, what was
    being done and the cause (``why``: see ``reason``)."""
    from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except StoreError:
        raise
    except ClientError as e:
        raise _translate(uri, e, f"{doing(action, key)}: {why(e)}") from e
    except (S3UploadFailedError, S3TransferFailedError) as e:
        # The managed transfer wraps the client's error; classify that one when it is there.
        inner = e.__context__
        if isinstance(inner, ClientError):
            raise _translate(uri, inner, f"{doing(action, key)}: {why(inner)}") from e
        raise StoreUnavailable(uri, f"{doing(action, key)}: {' '.join(str(e).split())}") from e
    except BotoCoreError as e:
        raise StoreUnavailable(uri, f"{doing(action, key)}: {why(e)}") from e


def _translate(uri: str, e: Any, cause: str) -> StoreError:
    if (status(e) or 0) >= 500 or code(e) in TRANSIENT_CODES:
        return StoreUnavailable(uri, cause)
    return StoreError(uri, cause)


def reason(e: Exception, *, endpoint: str, read_timeout: float, checking: bool = False) -> str:
    """Why a call to ``endpoint`` failed, in one line (``checking``: a preflight's, where a 404
    means the bucket is missing; ``read_timeout``: the seconds the client waited for an answer)."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(e, ClientError):
        error, message = code(e), e.response.get("Error", {}).get("Message", "")
        if error == "NoSuchBucket" or (checking and error == "404"):
            why = "bucket does not exist"
        elif message and message != error:
            why = f"{error} ({message.rstrip('.')})"
        else:
            why = error or f"HTTP {status(e)}"
    elif isinstance(e, ConnectTimeoutError):
        why = f"timed out connecting to endpoint {endpoint}"
    elif isinstance(e, ReadTimeoutError):
        why = f"endpoint {endpoint} did not answer within {read_timeout:g} s"
    elif isinstance(e, EndpointConnectionError):
        why = f"could not connect to endpoint {endpoint}"
    elif isinstance(e, NoCredentialsError):
        why = (
            "no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run with an instance role)"
        )
    else:
        why = str(e)
    return " ".join(why.split())  # one line


def doing(action: str, key: str | None) -> str:
    return f"cannot {action} {key!r}" if key is not None else f"cannot {action}"


def status(e: Any) -> int | None:
    """The HTTP status of boto3's ``ClientError`` ``e``."""
    found = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(found) if found is not None else None


def code(e: Any) -> str:
    """The S3 error code of boto3's ``ClientError`` ``e``."""
    return str(e.response.get("Error", {}).get("Code", ""))


def is_missing(e: Any) -> bool:
    """Whether ``e`` says there is no such object (as a caller allowed to list the key hears it)."""
    return status(e) == 404 or code(e) in ("404", "NoSuchKey", "NotFound")
