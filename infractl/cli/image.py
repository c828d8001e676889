"""``infractl image``: build the trainer image, pin it by digest, push it to a registry."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infractl import image
from infractl.cli._common import JsonOpt, output
from infractl.errors import UsageError

__all__ = ["register"]

image_app = typer.Typer(help="Build the trainer image and pin it by digest.", no_args_is_help=True)


@image_app.command()
def build(
    flavour: Annotated[
        str, typer.Option("--flavour", help=f"Which image: {' or '.join(image.FLAVOURS)} (gpu needs docker).")
    ] = "cpu",
    push: Annotated[
        str | None,
        typer.Option(
            "--push",
            help="Also copy it to this registry repository (HOST[:PORT]/REPO), by digest.",
            show_default=False,
        ),
    ] = None,
    cert_dir: Annotated[
        Path | None,
        typer.Option(
            "--cert-dir", help="Folder of CA certificates (*.crt) the registry is checked with.", show_default=False
        ),
    ] = None,
    lock: Annotated[
        Path | None,
        typer.Option(
            "--lock", help="Record the digest and inputs here. Default: images/<flavour>.lock.json.", show_default=False
        ),
    ] = None,
    json_mode: JsonOpt = False,
) -> None:
    """Build the trainer image (or find it in the cache when its inputs did not change), record
    images/<flavour>.lock.json, and print the reference to pin as runtime.image."""
    out = output(json_mode)
    if push is not None and ("@" in push or ":" in push.rpartition("/")[2] or "/" not in push):
        raise UsageError(
            f"{push!r} is not HOST[:PORT]/REPOSITORY (no tag, no digest: the image's own is used)", field="--push"
        )
    if cert_dir is not None and not cert_dir.is_dir():
        raise UsageError(f"{cert_dir} is not a folder", field="--cert-dir")
    if lock is not None and (lock.is_dir() or not lock.parent.is_dir()):
        raise UsageError(f"{lock} is not a file in an existing folder", field="--lock")
    built = image.build(flavour, progress=out.info, lock=lock or image.lock_path(flavour))
    result = {
        "flavour": built.flavour,
        "digest": built.digest,
        "reference": built.reference(),
        "size_bytes": built.size,
        "inputs_hash": built.inputs_hash,
        "cached": built.cached,
        "layout": str(built.layout),
        "lock": str(lock or image.lock_path(flavour)),
        "pushed": None,
    }
    if push is not None:
        result["pushed"] = (
            f"{push}@{image.push(built.layout, f'{push}@{built.digest}', cert_dir=cert_dir, progress=out.info)}"
        )
    out.result(result)
    out.success(f"image {built.digest} ({built.size / 2**30:.2f} GiB); pin it in cluster.yaml:")
    out.info(f"runtime: {{image: {built.reference()}}}")


def register(app: typer.Typer) -> None:
    app.add_typer(image_app, name="image")
