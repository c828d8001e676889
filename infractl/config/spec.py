"""What every config section shares: strict pydantic models, names, and one-line cross-field errors."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = ["NAME_PATTERN", "Name", "Spec", "field_error", "node_folder"]

NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="Lower-case letters, digits and '-', at most 40.")]


class Spec(BaseModel):
    """A config section: unknown fields are refused, and values are frozen once loaded."""

    # No NaN or infinity in a number, no control character in a string (names, paths, URIs,
    # versions: none of them has one, and a NUL byte would only fail later, deep in the OS).
    # A model's validator is built the first time it validates, not at import: every command
    # imports every model and validates few of them (``--help`` none).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, str_max_length=4096, defer_build=True)

    @field_validator("*", mode="after")
    @classmethod
    def _printable(cls, value: object) -> object:
        if isinstance(value, str) and not value.isprintable():
            raise ValueError("must not contain control characters (newlines, tabs, NUL, escape sequences)")
        return value


def field_error(field: str, message: str) -> ValidationError:
    """A cross-field error located at ``field``: a model validator's own errors have no location,
    and the loader reports ``<file>: <field>: <message>``."""
    return ValidationError.from_exception_data(
        "Spec",
        [InitErrorDetails(type=PydanticCustomError("value_error", message), loc=(field,), input=None)],
    )


# A folder on a node: root makes it and sets its owner and ACLs, and it reaches Ansible's variables
# and shell commands, so plain segments only (nothing a shell or Jinja reads), and never a
# top-level directory or / itself, which setfacl and chmod would then change.
_NODE_FOLDER = re.compile(r"^(/[A-Za-z0-9_][A-Za-z0-9._-]*){2,}$")


def node_folder(value: str, example: str) -> str:
    """``value`` if it is a folder infractl may make and remove on a node (``_NODE_FOLDER``);
    ``ValueError`` otherwise, with ``example`` of one."""
    if not _NODE_FOLDER.fullmatch(value):
        raise ValueError(
            f"{value!r} must be an absolute path at least two levels deep (e.g. {example}) whose segments are "
            "letters, digits, '.', '_' and '-', none starting with '.' or '-'"
        )
    return value
