"""Building the trainer image, caching it by its inputs, and copying it to a registry.

Two flavours come from ``images/trainer/``: ``gpu`` (the Dockerfile: a CUDA base image, EFA,
aws-ofi-nccl and nccl-tests; built with Docker where a registry serves its base) and ``cpu``
(built here from Debian's and PyPI's packages alone). The cpu image is one layer: a Debian
bookworm root filesystem from mmdebstrap with Python 3.11, the hash-locked requirements
(``requirements-cpu.txt``) installed offline into ``/opt/venv`` from a wheelhouse downloaded on
this machine, and infractl from its own wheel; buildah commits it to an OCI layout.

The result is kept in the image cache (``$INFRACTL_IMAGE_CACHE``, default
``$XDG_CACHE_HOME/infractl/images``), in a folder named after the hash of every input (the
requirements, the infractl sources, the Debian suite and packages, and this recipe): building
again from unchanged inputs finds it there. The pin is the manifest's digest, recorded with the
inputs in ``images/<flavour>.lock.json``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

import infractl
from infractl.config import IMAGE_REFERENCE
from infractl.errors import InfractlError, UsageError
from infractl.providers.engines import IMAGE_UID

__all__ = ["FLAVOURS", "BuiltImage", "build", "cache_root", "infractl_wheel", "locate", "lock_path", "push"]

FLAVOURS = ("cpu", "gpu")
#: The checkout's folder of image descriptions (images/ is not in the wheel: building needs a checkout).
_IMAGES = Path(__file__).resolve().parents[2] / "images"
_SUITE = "bookworm"
#: Debian's archive and its security updates, as this machine's apt sources name them.
_MIRRORS = (
    f"deb http://deb.debian.org/debian {_SUITE} main",
    f"deb http://deb.debian.org/debian-security {_SUITE}-security main",
)
#: The wheels bookworm's Python runs (x86_64, glibc 2.36), whatever machine downloads them.
_PLATFORMS = ("manylinux2014_x86_64", *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 37)))
#: What the trainer needs from Debian (bookworm's python3 is 3.11, the pinned CPU torch's Python).
_PACKAGES = ("python3", "python3-venv", "ca-certificates")
#: The image's user (images/trainer/README.md's contract), and its Python first on PATH.
_USER, _UID = "trainer", IMAGE_UID
_PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Every command a cpu build runs, and the Debian package that has it.
_TOOLS = {"mmdebstrap": "mmdebstrap", "buildah": "buildah", "skopeo": "skopeo"}
#: What the image takes from infractl's sdist (its top-level names).
_IMAGE_SOURCES = frozenset(
    {"infractl", "trainer", "infra", "playbooks", "runbooks", "bundle", "pyproject.toml", "setup.py", "MANIFEST.in"}
)
#: Seconds between "still running" lines of a long step.
_HEARTBEAT_S = 15.0
_STEP_TIMEOUT_S = 1800.0
_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
#: What builds of this checkout take turns on (``_sdist``): in the checkout's own ``build/`` (which
#: git ignores), never a predictable path in a world-writable folder such as /tmp, where another
#: user could plant a symbolic link for the build to write through, or hold the lock so that no
#: build ever starts.
_SDIST_TURN = _IMAGES.parent / "build" / "sdist.lock"


@dataclass(frozen=True)
class BuiltImage:
    """An image in the cache."""

    flavour: str
    layout: Path
    """The OCI image layout (``index.json``, ``blobs/``)."""
    digest: str
    """The manifest's digest, ``sha256:<64 hex>``: what ``runtime.image`` pins."""
    size: int
    """Bytes of the manifest, its config and its layers."""
    inputs_hash: str
    cached: bool
    """Found in the cache, not built now."""

    def reference(self, repository: str = "infractl/trainer") -> str:
        return f"{repository}@{self.digest}"


def cache_root() -> Path:
    override = os.environ.get("INFRACTL_IMAGE_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "infractl" / "images"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_digest(layout: Path) -> str:
    index = json.loads((layout / "index.json").read_text())
    return str(index["manifests"][0]["digest"])


def _layout_size(layout: Path, digest: str) -> int:
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / digest.removeprefix("sha256:")).read_text())
    parts = [digest, manifest["config"]["digest"], *(layer["digest"] for layer in manifest["layers"])]
    return sum((blobs / part.removeprefix("sha256:")).stat().st_size for part in parts)


def locate(digest: str) -> Path | None:
    """The cached OCI layout whose image has the manifest ``digest``, or None."""
    root = cache_root()
    if not root.is_dir():
        return None
    for layout in sorted(root.iterdir()):
        if (layout / "index.json").is_file() and not layout.name.startswith("."):
            if _manifest_digest(layout) == digest:
                return layout
    return None


def _step(what: str, argv: Sequence[str], progress: Callable[[str], None], log: Path) -> str:
    """Run one step of a build to its end, its output appended to ``log``; say when it starts,
    every ``_HEARTBEAT_S`` while it runs, and when it ends. Its stdout is returned."""
    progress(f"{what}…")
    started = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(_HEARTBEAT_S):
            progress(f"  still {what} ({time.monotonic() - started:.0f}s)")

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        finished = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            errors="replace",
            stdin=subprocess.DEVNULL,
            timeout=_STEP_TIMEOUT_S,
            check=False,
        )
    finally:
        done.set()
        beat.join()
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n{finished.stdout}{finished.stderr}\n")
    if finished.returncode != 0:
        last = (finished.stderr.strip() or finished.stdout.strip() or "no output").splitlines()[-1]
        raise InfractlError(f"image build: {what} failed (exit {finished.returncode}): {last}; see {log}")
    progress(f"{what}: done in {time.monotonic() - started:.0f}s")
    return finished.stdout


def _sdist(out: Path) -> Path:
    """An sdist of this checkout (this venv's setuptools, offline). Builds of one checkout take
    turns: each rewrites its ``infractl.egg-info``, and two at once break each other."""
    out.mkdir(parents=True, exist_ok=True)
    script = "import sys, setuptools.build_meta as backend; print(backend.build_sdist(sys.argv[1]))"
    with _turn(_SDIST_TURN):
        made = subprocess.run(
            [sys.executable, "-c", script, str(out)], cwd=_IMAGES.parent, capture_output=True, text=True, check=True
        )
    return out / made.stdout.strip().splitlines()[-1]


@contextlib.contextmanager
def _turn(path: Path) -> Iterator[None]:
    """Hold the exclusive lock on ``path`` while the block runs: a file of this user's alone (made
    0600, its folder 0700, where they are new). Refused (``InfractlError``) when it is a symbolic
    link, or a file another user owns or may open (who could hold the lock for ever)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise InfractlError(f"image build: {path} is a symbolic link, not the build's lock: remove it") from None
    try:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode) or held.st_uid != os.geteuid() or held.st_mode & 0o077:
            raise InfractlError(
                f"image build: {path} is not a file of this user's alone (it must be, or another user could hold "
                "the build's lock): remove it"
            )
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def infractl_wheel(out: Path) -> Path:
    """infractl's wheel, built from an sdist of this checkout as ``python -m build`` makes it: it
    holds exactly what the sdist ships."""
    tarball = _sdist(out)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(tarball)],
        capture_output=True,
        check=True,
    )
    [wheel] = out.glob("infractl-*.whl")
    return wheel


def _sources_hash() -> str:
    """The hash of what the image takes from the checkout (names and bytes): the packages, the
    templates and the build files, not the tests, the README or the commit it was made at (a new
    commit that changed none of them needs no new image)."""
    digest = hashlib.sha256()
    root = _IMAGES.parent
    for name in sorted(_IMAGE_SOURCES):
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in files:
            relative = path.relative_to(root)
            if {"__pycache__", "_templates"} & set(relative.parts) or path.suffix in (".pyc", ".pyo"):
                continue
            if path.name == "_revision.txt":
                continue
            digest.update(str(relative).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _inputs() -> dict[str, Any]:
    requirements = _IMAGES / "trainer" / "requirements-cpu.txt"
    return {
        "flavour": "cpu",
        "suite": _SUITE,
        "mirrors": list(_MIRRORS),
        "packages": list(_PACKAGES),
        "requirements": {"file": "images/trainer/requirements-cpu.txt", "sha256": _sha256(requirements.read_bytes())},
        "infractl": {"version": infractl.__version__, "sources_sha256": _sources_hash()},
        "recipe_sha256": _sha256(Path(__file__).read_bytes()),
    }


def lock_path(flavour: str) -> Path:
    """Where the checkout records the last build of ``flavour``: ``images/<flavour>.lock.json``."""
    return _IMAGES / f"{flavour}.lock.json"


def build(flavour: str, *, progress: Callable[[str], None], lock: Path | None = None) -> BuiltImage:
    """Build ``flavour`` (or find it in the cache) and return it; ``lock``: where to record its
    digest and inputs (``lock_path``, or elsewhere)."""
    if flavour not in FLAVOURS:
        raise UsageError(f"no image flavour {flavour!r}: choose one of {', '.join(FLAVOURS)}", field="--flavour")
    if flavour == "gpu":
        raise UsageError(
            "the gpu flavour needs its CUDA base image from a registry this machine cannot reach: build "
            "images/trainer/Dockerfile with docker on a machine that reaches one (see images/trainer/README.md)",
            field="--flavour",
        )
    if not (_IMAGES / "trainer" / "requirements-cpu.txt").is_file():
        raise UsageError(f"building an image needs infractl's checkout (no {_IMAGES / 'trainer'})", field="--flavour")
    missing = [f"{tool} (Debian package {package})" for tool, package in _TOOLS.items() if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"building the cpu image needs {', '.join(missing)}: install them", field="--flavour")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(root)
    inputs = _inputs()
    inputs_hash = _sha256(json.dumps(inputs, sort_keys=True).encode())[:16]
    layout = root / f"{flavour}-{inputs_hash}"
    cached = (layout / "index.json").is_file()
    if cached:
        progress(f"image: inputs unchanged (hash {inputs_hash}): using the cached build in {layout}")
    else:
        _build_cpu(layout, inputs, progress)
    digest = _manifest_digest(layout)
    built = BuiltImage(
        flavour=flavour,
        layout=layout,
        digest=digest,
        size=_layout_size(layout, digest),
        inputs_hash=inputs_hash,
        cached=cached,
    )
    if lock is not None:
        _write_lock(lock, built, inputs)
    return built


def _build_cpu(layout: Path, inputs: dict[str, Any], progress: Callable[[str], None]) -> None:
    """Build the cpu image into ``layout`` (whole or not at all)."""
    root = layout.parent
    with tempfile.TemporaryDirectory(dir=root, prefix=f".build-{os.getpid()}-") as work_dir:
        work = Path(work_dir)
        log = root / f"{layout.name}.log"
        log.write_text("")
        wheels = work / "wheels"
        requirements = _IMAGES / "trainer" / "requirements-cpu.txt"
        shutil.copy(requirements, work / "requirements.txt")
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
        _step(
            "downloading the locked Python packages",
            [*pip, "download", "--only-binary=:all:", "--no-deps", "--require-hashes",
             *(f"--platform={platform}" for platform in _PLATFORMS), "--python-version=3.11", "--implementation=cp",
             "-r", str(requirements), "-d", str(wheels)],
            progress, log,
        )  # fmt: skip
        progress("building infractl's wheel…")
        own = infractl_wheel(work / "infractl")
        progress(f"building infractl's wheel: {own.name}")
        rootfs = work / "rootfs.tar"
        hooks = _install_hooks([*wheels.iterdir(), own], work / "requirements.txt", own.name)
        _step(
            f"bootstrapping Debian {_SUITE} and installing the packages into /opt/venv",
            ["mmdebstrap", "--variant=minbase", f"--include={','.join(_PACKAGES)}",
             *(f"--customize-hook={hook}" for hook in hooks), _SUITE, str(rootfs), *_MIRRORS],
            progress, log,
        )  # fmt: skip
        labels = {
            "org.opencontainers.image.title": "infractl trainer (cpu)",
            "org.opencontainers.image.version": infractl.__version__,
            "org.opencontainers.image.revision": _revision(),
            "org.infractl.flavour": "cpu",
            "org.infractl.inputs": layout.name,
        }
        # buildah's own store lives in the build's folder, on vfs (no mounts): a build killed at any
        # moment leaves one folder behind, which the next build removes, and nothing in the
        # machine's container storage.
        buildah = ["buildah", f"--root={work / 'storage'}", f"--runroot={work / 'run'}", "--storage-driver=vfs"]
        container = _step("starting the image", [*buildah, "from", "scratch"], progress, log).strip()
        _step(f"adding the root filesystem ({rootfs.stat().st_size // 2**20} MiB)",
              [*buildah, "add", container, str(rootfs), "/"], progress, log)  # fmt: skip
        _step(
            "configuring the image",
            [*buildah, "config", f"--env=PATH={_PATH}", f"--user={_USER}", f"--workingdir=/home/{_USER}",
             *(f"--label={key}={value}" for key, value in labels.items()), container],
            progress, log,
        )  # fmt: skip
        partial = work / "layout"
        # Uncompressed: nodes pull over a local network, where gzip on 2 cores costs more than it saves.
        _step("committing the image",
              [*buildah, "commit", "--quiet", "--disable-compression", container, f"oci:{partial}:cpu"],
              progress, log)  # fmt: skip
        subprocess.run([*buildah, "rm", container], capture_output=True, check=False)
        partial.rename(layout)


def _remove_abandoned_builds(root: Path) -> None:
    """Remove the folders of builds whose process is gone (killed mid-build): ``.build-<pid>-*``."""
    for folder in root.glob(".build-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _install_hooks(wheels: Sequence[Path], requirements: Path, own: str) -> list[str]:
    """mmdebstrap's customize hooks (run with the root filesystem as ``$1``): the wheels in, the
    venv with the locked packages by hash and infractl without dependencies, the image's user; then
    nothing of the install is left but what it installed."""
    chroot = 'chroot "$1"'
    pip = f"{chroot} /opt/venv/bin/pip install --no-cache-dir --no-index"
    copied = " ".join(shlex.quote(str(p)) for p in [*wheels, requirements])
    return [
        f'mkdir -p "$1/tmp/wheels" && cp {copied} "$1/tmp/wheels/"',
        f"{chroot} python3 -m venv /opt/venv",
        f"{pip} --require-hashes --find-links /tmp/wheels -r /tmp/wheels/{requirements.name}",
        f"{pip} --no-deps /tmp/wheels/{own}",
        f'echo "{_USER}:x:{_UID}:{_UID}::/home/{_USER}:/bin/bash" >> "$1/etc/passwd"',
        f'echo "{_USER}:x:{_UID}:" >> "$1/etc/group"',
        f'mkdir -p "$1/home/{_USER}" && chown {_UID}:{_UID} "$1/home/{_USER}"',
        'rm -rf "$1/tmp/wheels" "$1/var/lib/apt/lists"/* "$1/var/cache/apt"/*',
    ]


def _revision() -> str:
    from trainer.fingerprint import source_revision

    return source_revision() or "unknown"


def _write_lock(path: Path, built: BuiltImage, inputs: dict[str, Any]) -> None:
    """The lock file: the digest and what it was built from."""
    lock = {
        "flavour": built.flavour,
        "digest": built.digest,
        "reference": built.reference(),
        "size_bytes": built.size,
        "inputs_hash": built.inputs_hash,
        "inputs": inputs,
    }
    # Written to a new file beside it and renamed over it: a symbolic link planted at ``path`` (say
    # a --lock in /tmp) is replaced, never written through.
    fd, written = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(lock, indent=2, sort_keys=True) + "\n")
        os.chmod(written, 0o644)  # the checkout's images/<flavour>.lock.json is committed, read by all
        os.replace(written, path)
    except BaseException:
        Path(written).unlink(missing_ok=True)
        raise


def push(layout: Path, destination: str, *, cert_dir: Path | None, progress: Callable[[str], None]) -> str:
    """Copy the image at ``layout`` to ``destination`` (``HOST/REPO@sha256:…``, which must be the
    layout's own digest) with skopeo, keeping its manifest byte for byte; return the digest the
    registry now serves (the pin, or an ``InfractlError`` naming both)."""
    match = IMAGE_REFERENCE.match(destination)
    if match is None:
        raise UsageError(f"{destination!r} is not HOST/REPOSITORY@sha256:<64 hex>", field="--push")
    log = layout.parent / f"{layout.name}.push.log"
    with tempfile.TemporaryDirectory() as scratch:
        digest_file = Path(scratch) / "digest"
        _step(
            f"pushing {_layout_size(layout, _manifest_digest(layout)) // 2**20} MiB to {match['host'] or 'docker.io'}",
            ["skopeo", "copy", "--quiet", "--preserve-digests", f"--digestfile={digest_file}",
             *([f"--dest-cert-dir={cert_dir}"] if cert_dir is not None else []),
             f"oci:{layout}", f"docker://{destination}"],
            progress, log,
        )  # fmt: skip
        pushed = digest_file.read_text().strip()
    if pushed != match["digest"]:
        raise InfractlError(f"the registry holds {pushed} after pushing {match['digest']} to {destination}")
    return pushed
