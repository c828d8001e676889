"""Versioned byte-level datasets: ``infractl data prepare`` writes them, the trainer reads them.

A prepared dataset is a directory::

    manifest.json        format, tokenizer, version, split rule, and every shard with size and sha256
    train-00000.bin ...  uint8 tokens (byte-level: a token is a byte), documents joined by a newline
    val-00000.bin ...

The version is a content hash over the shards and the split rule: the same input gives the same
version on any machine, and a run refuses to continue on a dataset whose version changed.
Documents are assigned to a split by a hash of their relative path, so adding a file never moves
another file between splits. The built-in ``stdlib`` source (the Python standard library's .py
files) is built in memory the same way, so both sources read alike.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infractl.config import DataSpec
from infractl.errors import ConfigError

if TYPE_CHECKING:  # numpy is imported where tokens are loaded: every CLI command imports this module
    import numpy as np

__all__ = [
    "FORMAT",
    "SPLITS",
    "Dataset",
    "prepare",
    "open_dataset",
    "dataset_version",
    "version_mismatch",
    "stdlib_files",
    "split_of",
]

FORMAT = "infractl-bytes-v1"
SPLITS = ("train", "val")
_MANIFEST = "manifest.json"
_SEPARATOR = b"\n"
# Third-party packages differ between machines; the stdlib corpus must not.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Dataset:
    """Token arrays per split and the version that names their content."""

    version: str
    splits: dict[str, np.ndarray]
    description: str

    def tokens(self, split: str) -> np.ndarray:
        return self.splits[split]


def split_of(relative_path: str, val_fraction: float) -> str:
    """``val`` for a stable ``val_fraction`` of documents (by path hash), else ``train``."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:8], "big") / 2**64
    return "val" if bucket < val_fraction else "train"


def _walk(root: Path, include: str) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            # Only regular files: reading a FIFO or a device would block or never end.
            if fnmatch.fnmatch(name, include) and path.is_file():
                yield path


def stdlib_files() -> Iterator[tuple[str, Path]]:
    """(relative path, path) of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _walk(root, "*.py"):
        yield path.relative_to(root).as_posix(), path


def _documents(sources: Iterable[Path], include: str) -> Iterator[tuple[str, Path]]:
    for source in sources:
        try:
            kind = "file" if source.is_file() else "dir" if source.is_dir() else "other" if source.exists() else None
        except OSError as exc:  # a name the OS refuses (too long, say)
            raise ConfigError(f"cannot use {source}: {exc.strerror or exc}", field="SRC") from None
        if kind == "file":
            yield source.name, source
        elif kind == "dir":
            for path in _walk(source, include):
                yield f"{source.name}/{path.relative_to(source).as_posix()}", path
        else:
            what = "not a regular file or directory" if kind == "other" else "no such file or directory"
            raise ConfigError(f"{what}: {source}", field="SRC")


def _split_bytes(docs: Iterable[tuple[str, Path]], val_fraction: float, max_bytes: int | None) -> dict[str, bytearray]:
    out = {split: bytearray() for split in SPLITS}
    total = 0
    for relative, path in docs:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", field="SRC") from None
        if max_bytes is not None:
            data = data[: max_bytes - total]
        buf = out[split_of(relative, val_fraction)]
        if buf:
            buf += _SEPARATOR
        buf += data
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return out


def _version(split_digests: dict[str, list[str]], val_fraction: float) -> str:
    canonical = json.dumps(
        {"format": FORMAT, "tokenizer": "bytes", "val_fraction": val_fraction, "splits": split_digests},
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def prepare(
    sources: list[Path],
    out: Path,
    *,
    val_fraction: float = 0.05,
    include: str = "*",
    shard_bytes: int = 64 << 20,
) -> dict[str, Any]:
    """Tokenize ``sources`` (files, or directories walked for ``include``) into ``out``; return the manifest."""
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"must be in [0, 1), got {val_fraction}", field="--val-fraction")
    if shard_bytes < 1:
        raise ValueError("shard_bytes must be positive")
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(
                f"{out} is not an empty directory; choose a new one (datasets are immutable)", field="--out"
            )
    except OSError as exc:
        raise ConfigError(f"cannot use {out}: {exc.strerror or exc}", field="--out") from None
    data = _split_bytes(_documents(sources, include), val_fraction, None)
    if not data["train"]:
        raise ConfigError(
            f"no training text found in {', '.join(map(str, sources))} (include {include!r})", field="SRC"
        )
    # Written beside ``out`` and renamed into place: never half a dataset under its name.
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        staging.chmod(0o755)  # mkdtemp's 0700 would make the dataset private to this user
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror or exc}", field="--out") from None
    try:
        manifest = _write(staging, data, val_fraction, shard_bytes)
        if out.is_dir():
            out.rmdir()  # the empty directory the user made for it
        os.replace(staging, out)
    except OSError as exc:
        raise ConfigError(f"cannot write the dataset to {out}: {exc.strerror or exc}", field="--out") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _write(out: Path, data: dict[str, bytearray], val_fraction: float, shard_bytes: int) -> dict[str, Any]:
    """Write the shards and the manifest into ``out``; return the manifest."""
    manifest: dict[str, Any] = {"format": FORMAT, "tokenizer": "bytes", "val_fraction": val_fraction, "splits": {}}
    digests: dict[str, list[str]] = {}
    for split in SPLITS:
        shards: list[dict[str, Any]] = []
        blob = bytes(data[split])
        for index, start in enumerate(range(0, len(blob), shard_bytes)):
            chunk = blob[start : start + shard_bytes]
            name = f"{split}-{index:05d}.bin"
            (out / name).write_bytes(chunk)
            shards.append({"file": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
        manifest["splits"][split] = {"bytes": len(blob), "shards": shards}
        digests[split] = [s["sha256"] for s in shards]
    manifest["version"] = _version(digests, val_fraction)
    (out / _MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _read_manifest(path: Path) -> dict[str, Any]:
    """A prepared dataset's manifest, checked for format and self-consistency (shards unread)."""
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{path} is not a prepared dataset (no {_MANIFEST}); run `infractl data prepare`", field="data.path"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path / _MANIFEST} ({exc})", field="data.path") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ConfigError(f"{path} has format {found!r}, expected {FORMAT!r}", field="data.path")
    try:
        digests = {split: [s["sha256"] for s in manifest["splits"][split]["shards"]] for split in SPLITS}
        consistent = _version(digests, manifest["val_fraction"]) == manifest["version"]
    except (KeyError, TypeError):
        consistent = False
    if not consistent:
        raise ConfigError(f"{path / _MANIFEST} was edited: its version does not match its shards", field="data.path")
    return manifest


def _load_prepared(path: Path, *, verify: bool) -> Dataset:
    import numpy as np

    manifest = _read_manifest(path)
    splits: dict[str, np.ndarray] = {}
    for split in SPLITS:
        parts = []
        for shard in manifest["splits"][split]["shards"]:
            file = path / shard["file"]
            if not file.is_file() or file.stat().st_size != shard["bytes"]:
                raise ConfigError(f"shard {file} is missing or not {shard['bytes']} bytes", field="data.path")
            tokens = np.fromfile(file, dtype=np.uint8)
            if verify and hashlib.sha256(tokens.tobytes()).hexdigest() != shard["sha256"]:
                raise ConfigError(f"shard {file} does not match its sha256 in the manifest", field="data.path")
            parts.append(tokens)
        splits[split] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    return Dataset(version=manifest["version"], splits=splits, description=str(path))


def _load_stdlib(spec: DataSpec) -> Dataset:
    import numpy as np

    data = _split_bytes(stdlib_files(), spec.val_fraction, spec.max_bytes)
    splits = {split: np.frombuffer(bytes(data[split]), dtype=np.uint8) for split in SPLITS}
    digests = {split: [hashlib.sha256(splits[split].tobytes()).hexdigest()] for split in SPLITS}
    return Dataset(version=_version(digests, spec.val_fraction), splits=splits, description="stdlib")


def dataset_version(spec: DataSpec) -> str:
    """The version a run on ``spec`` would train on (a prepared dataset's shards are not read)."""
    if spec.source == "stdlib":
        return _load_stdlib(spec).version
    assert spec.path is not None  # the DataSpec validator guarantees it
    return str(_read_manifest(Path(spec.path))["version"])


def version_mismatch(run_id: str, *, saved: str | None, current: str, data: DataSpec) -> str | None:
    """Why run ``run_id`` must not go on with ``data`` (its dataset changed), or None. The launcher
    asks before it starts anything, the trainer again before it loads a checkpoint: continuing
    on other data would silently make a different model under the same name."""
    if saved is None or saved == current:
        return None
    return (
        f"run {run_id!r} was trained on dataset version {saved}, "
        f"but {data.path or data.source} is now version {current}"
    )


def open_dataset(spec: DataSpec, *, verify: bool = True) -> Dataset:
    """The dataset a run trains on; ``verify`` checks every shard's sha256 (prepared datasets)."""
    if spec.source == "stdlib":
        return _load_stdlib(spec)
    assert spec.path is not None  # the DataSpec validator guarantees it
    return _load_prepared(Path(spec.path), verify=verify)
