"""What no bundle may hold: secrets. Readers of a bundle are not trusted (DESIGN.md, Roles and
trust), so every config the bundle copies is written with its secrets replaced by ``(redacted)``,
and a bundle in which a private key, or a token of the operator's environment, is still found is
not written at all.

A value is a secret when its name says so (``_SECRET_NAME``: a private key, a token, a password,
a secret access key, credentials), when it holds a private key (``PRIVATE KEY``, the line every
PEM and OpenSSH private key starts with), when it is a Terraform module variable declared
``sensitive``, or a Terraform output Terraform marks sensitive. The secrets themselves stay where
they are needed: in the cluster's state on the operator's machine (files of mode 0600).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from infractl.errors import InfractlError

__all__ = ["REDACTED", "outputs", "redact", "refuse_secrets", "root_module"]

#: What a secret is written as.
REDACTED = "(redacted)"
# A mapping key whose value is a secret, alone or as the last word of a name: host_key's
# ``private``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``ansible_become_password``. Names that
# only mention one (``ssh_private_key_file``: a path; ``tokens_per_s``) are not secrets.
_SECRET_NAME = re.compile(
    r"(?i)(?:^|[_.-])(?:private(?:_key)?|secret(?:_access)?(?:_key)?|api_key|(?:access_|session_|auth_)?token"
    r"|password|passwd|passphrase|credentials?)$"
)
_PRIVATE_KEY = "PRIVATE KEY"


def redact(value: Any, *, sensitive: Collection[str] = ()) -> Any:
    """``value`` (JSON-like) with every secret in it written as ``REDACTED``: the value of each key
    named like a secret (at any depth) or named in ``sensitive`` (keys of ``value`` itself), and
    every string that holds a private key."""
    if isinstance(value, Mapping):
        return {
            key: REDACTED if key in sensitive or _SECRET_NAME.search(str(key)) else redact(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact(item) for item in value]
    if isinstance(value, str) and _PRIVATE_KEY in value:
        return REDACTED
    return value


def root_module(document: Mapping[str, Any], module_dir: Path) -> dict[str, Any]:
    """The Terraform root module ``document`` (``main.tf.json``: each module block holds every
    variable's value) redacted: besides ``redact``'s secrets, every variable that the called
    module in ``module_dir`` declares ``sensitive``."""
    sensitive = _sensitive_variables(module_dir)
    redacted: dict[str, Any] = redact({key: item for key, item in document.items() if key != "module"})
    if "module" in document:
        redacted["module"] = {
            name: redact(block, sensitive=sensitive) for name, block in dict(document["module"]).items()
        }
    return redacted


def outputs(state_outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The values of a Terraform state's ``outputs``, redacted, and the outputs Terraform marks
    ``sensitive`` written as ``REDACTED`` whole."""
    return {
        name: REDACTED if output.get("sensitive") else redact(output.get("value"))
        for name, output in state_outputs.items()
    }


def refuse_secrets(files: Mapping[str, bytes], environ: Mapping[str, str]) -> None:
    """The last check before anything is written: ``InfractlError`` naming the first file of a
    bundle (relative path -> bytes) that holds a private key, or the value of a variable of the
    operator's environment ``environ`` named like a secret (``HF_TOKEN``: named, never shown)."""
    secrets = {name: value.encode() for name, value in environ.items() if _SECRET_NAME.search(name) and len(value) >= 8}
    for relative, content in sorted(files.items()):
        found = ["a private key"] if _PRIVATE_KEY.encode() in content else []
        found += [f"the value of ${name}" for name, value in sorted(secrets.items()) if value in content]
        if found:
            raise InfractlError(
                f"the bundle's {relative} holds {' and '.join(found)}, which a bundle must never hold; no bundle "
                "was written (report this: its redaction missed it)"
            )


def _sensitive_variables(module_dir: Path) -> set[str]:
    """The variables the Terraform module in ``module_dir`` declares ``sensitive = true`` (in its
    ``.tf`` and ``.tf.json`` files); none where there is no module."""
    declared: list[dict[str, Any]] = []
    for path in sorted(module_dir.glob("*.tf")) if module_dir.is_dir() else []:
        declared += _hcl(path).get("variable", [])
    for path in sorted(module_dir.glob("*.tf.json")) if module_dir.is_dir() else []:
        variables = json.loads(path.read_text()).get("variable", {})
        declared += variables if isinstance(variables, list) else [variables]
    return {name for block in declared for name, body in block.items() if body.get("sensitive") in (True, "true")}


def _hcl(path: Path) -> dict[str, Any]:
    # Imported here: only a bundle reads a module's declarations.
    import hcl2
    from hcl2.utils import SerializationOptions

    options = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    with path.open() as f:
        try:
            parsed: dict[str, Any] = hcl2.load(f, serialization_options=options)
        except Exception as exc:  # the parser raises lark's errors, which name the line and column
            raise InfractlError(f"cannot parse {path}: {exc}") from exc
    return parsed
