"""The store's errors besides ``StoreError`` itself (infractl.errors): every backend raises only
this family, never its client library's own exceptions."""

from __future__ import annotations

from infractl.errors import StoreError

__all__ = ["StoreKeyError", "StoreUnavailable", "UnknownUser"]


class StoreUnavailable(StoreError, OSError):
    """The store cannot be reached at all (not: a key is missing). Callers retry later."""


class StoreKeyError(StoreError, KeyError):
    """The key does not exist in the store."""

    def __init__(self, uri: str, key: str) -> None:
        super().__init__(uri, f"no object {key!r}")
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.uri, self.key))


class UnknownUser(StoreError):
    """Access was granted to someone the store's identity service does not know (no IAM user)."""

    def __init__(self, uri: str, user: str) -> None:
        super().__init__(uri, f"no user named {user!r} (an IAM user must exist before it is granted a role)")
        self.user = user

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.uri, self.user))
