"""The one store API: checkpoints, metrics and run records go through ``Store``.

Two backends sit behind the same methods:

- ``file:///abs/path`` (``file.py``): a directory (the local provider's default). Like a bucket,
  the directory must exist (`infractl up` creates the cluster's); the store never creates it, so a
  store whose directory vanished (an unmounted volume, say) fails every call with
  ``StoreUnavailable`` instead of silently starting an empty store in its place.
- ``s3://BUCKET[/PREFIX][?endpoint_url=http://HOST:PORT&region=REGION]`` (``s3.py``): an S3 bucket
  (AWS or any S3-compatible server) through boto3. Keys live under PREFIX. Credentials come only
  from boto3's standard chain (env vars, profile, instance role), never from the URI.

Keys are ``/``-separated relative paths. Writes are atomic (a reader sees the whole object or
none) and ``put_if_absent`` is create-only, which is what the checkpoint commit marker relies on
(S3: ``put_object(IfNoneMatch='*')``).

Errors (``errors.py``): every call raises only the ``StoreError`` family, never a backend's own
exceptions (OSError, botocore): ``StoreUnavailable`` when the store cannot be reached (callers
retry later), ``StoreKeyError`` for a missing key, ``StoreError`` for anything else (access
denied, say). Each is one line, ``store <uri>: <cause>``, which the CLI prints as it is.
``Store.check()`` is the preflight of ``infractl up``: it raises ``ConfigError`` naming the config
field when the store cannot be reached or written.

Access roles (``infractl access``, infractl/access/) reach the store through
``Store.apply_access`` and ``Store.remove_access``: a ``file://`` store sets POSIX ACLs for the
roles' Unix groups (``_acl.py``), an ``s3://`` store keeps one IAM managed policy per role
attached to the role's members (``_iam.py``, which also writes every role's policy document). What
a role may do is a ``RoleRights`` (``rights.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from infractl.errors import ConfigError, StoreError
from infractl.store.base import ObjectInfo, Store
from infractl.store.errors import StoreKeyError, StoreUnavailable, UnknownUser
from infractl.store.file import FileStore
from infractl.store.rights import RoleRights
from infractl.store.s3 import S3Store, open_s3

if TYPE_CHECKING:
    from infractl.statedir import ClusterState

__all__ = [
    "SUPPORTED_SCHEMES",
    "FileStore",
    "ObjectInfo",
    "RoleRights",
    "S3Store",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "StoreKeyError",
    "UnknownUser",
    "for_cluster",
    "open_store",
]

SUPPORTED_SCHEMES = ("file", "s3")


def open_store(uri: str, *, field: str = "store", interactive: bool = False) -> Store:
    """Open the store named by ``uri``; ``field`` names the config field in error messages.

    ``interactive``: a person is waiting (the CLI), so a store that does not answer fails within
    seconds instead of being retried for a minute as the trainers' background saves are.
    Opening checks the URI's shape only; call ``check()`` to reach the store.
    """
    try:
        parsed = urlparse(uri)
    except ValueError as exc:  # an unbalanced "[" in the host part, say
        raise ConfigError(f"{uri!r} is not a URI ({exc})", field=field) from None
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file:// URIs must be absolute paths, got {uri!r}", field=field)
        return FileStore(Path(parsed.path), field=field)
    if parsed.scheme == "s3":
        return open_s3(uri, field=field, interactive=interactive)
    allowed = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    raise ConfigError(f"unsupported store URI {uri!r} (use {allowed})", field=field)


def for_cluster(state: ClusterState) -> Store:
    """The object store of a cluster that is up, for the control plane: a person is waiting, so
    an unreachable store fails within seconds (``StoreUnavailable``)."""
    return open_store(state.record().store, field="cluster.store", interactive=True)
