"""The trainer image: the cpu flavour built here from Debian's and PyPI's packages (``cpu_image``,
once per session), found again in the cache from unchanged inputs (a killed build's folder
removed), run by podman as its user with the pinned torch and infractl's trainer, pushed to a
registry over TLS with its digest kept; bad options refused in one line before anything is built."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import infractl
from infractl.errors import InfractlError
from infractl.image import registry
from infractl.image.build import _SDIST_TURN, _turn, _write_lock
from infractl.image.build import BuiltImage as CachedImage
from infractl.providers.engines import ContainerEngine

from conftest import REPO, BuiltImage, Cli


def test_the_digest_is_the_layouts_and_the_lock_records_it_with_the_inputs(cpu_image: BuiltImage) -> None:
    index = json.loads((cpu_image.layout / "index.json").read_text())
    assert [m["digest"] for m in index["manifests"]] == [cpu_image.digest]
    lock = json.loads(cpu_image.lock.read_text())
    assert lock["digest"] == cpu_image.digest and lock["reference"] == f"infractl/trainer@{cpu_image.digest}"
    inputs = lock["inputs"]
    assert inputs["suite"] == "bookworm" and inputs["infractl"]["version"] == infractl.__version__
    requirements = Path(infractl.__file__).parents[1] / inputs["requirements"]["file"]
    assert inputs["requirements"]["sha256"] == hashlib.sha256(requirements.read_bytes()).hexdigest()
    # The size counts the manifest, its config and its one layer; the digest is the manifest's bytes'.
    raw = (cpu_image.layout / "blobs" / "sha256" / cpu_image.digest.split(":")[1]).read_bytes()
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == cpu_image.digest
    manifest = json.loads(raw)
    assert len(manifest["layers"]) == 1
    assert lock["size_bytes"] == len(raw) + sum(p["size"] for p in [manifest["config"], *manifest["layers"]])


def test_unchanged_inputs_find_the_cached_build_and_a_killed_builds_folder_is_removed(
    cli: Cli, cpu_image: BuiltImage
) -> None:
    gone = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True).stdout.strip()
    killed = cpu_image.layout.parent / f".build-{gone}-killed"
    running = cpu_image.layout.parent / f".build-{os.getpid()}-running"
    for folder in (killed, running):
        (folder / "storage").mkdir(parents=True)
    started = time.monotonic()
    again = json.loads(cli("image", "build", "--json", "--lock", str(cli.cwd / "lock.json")).stdout)
    assert again["cached"] is True and again["digest"] == cpu_image.digest
    assert again["layout"] == str(cpu_image.layout)
    assert time.monotonic() - started < 60  # found, not rebuilt (a build takes minutes)
    assert not killed.exists() and running.is_dir()
    shutil.rmtree(running)


def test_the_image_runs_the_trainer_as_its_user_with_the_pinned_torch(cpu_image: BuiltImage, tmp_path: Path) -> None:
    # A store of its own; the run root's path must be short (podman refuses one over 50 characters).
    runroot = Path(tempfile.mkdtemp(prefix="ix-", dir="/run"))
    engine = ["podman", "--root", str(tmp_path / "s"), "--runroot", str(runroot), "--tmpdir", str(runroot / "libpod"),
              "--storage-driver", "overlay"]  # fmt: skip
    # podman names an image pulled from an OCI layout after the layout's path, which a cache of any
    # name (scripts/test.sh makes one with mktemp) may spell with capitals: a reference may not.
    layout = tmp_path / "layout"
    layout.symlink_to(cpu_image.layout)
    script = (
        "import getpass, sys, torch, infractl, infractl.proc, trainer.agent; "
        "print(getpass.getuser(), sys.executable, torch.__version__, infractl.__version__)"
    )
    try:
        loaded = subprocess.run([*engine, "pull", "--quiet", f"oci:{layout}"], capture_output=True, text=True)
        assert loaded.returncode == 0, loaded.stderr
        ran = subprocess.run(
            [*engine, "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file", "run", "--rm",
             "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096",
             loaded.stdout.strip(), "python", "-c", script],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        # As teardown removes a node's store: the overlay driver's mount of it included.
        ContainerEngine(argv=tuple(engine), home=tmp_path / "s", runroot=runroot).remove_store()
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["trainer", "/opt/venv/bin/python", "2.13.0+cpu", infractl.__version__]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def tls_registry(tmp_path: Path) -> Iterator[registry.Registry]:
    """Debian's docker-registry on loopback, with a certificate from its own CA (as a cluster's)."""
    port = _free_port()
    ca, _, _ = registry.certificate_authority(tmp_path, "127.0.0.1")
    config = tmp_path / "registry" / "config.yml"
    config.write_text(registry.config(config.parent, "127.0.0.1", port))
    server = subprocess.Popen(
        ["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert server.poll() is None and time.monotonic() < deadline, "docker-registry did not start"
            time.sleep(0.1)
        yield registry.Registry(host="127.0.0.1", port=port, ca=ca)
    finally:
        server.kill()
        server.wait()


def test_a_push_keeps_the_digest_and_is_checked_against_the_registrys_ca(
    cli: Cli, cpu_image: BuiltImage, tls_registry: registry.Registry
) -> None:
    target = f"{tls_registry.address}/infractl/trainer"
    untrusted = cli("image", "build", "--push", target, "--lock", "lock.json", expect=1)
    assert "certificate" in untrusted.stderr and untrusted.stderr.count("\n") <= 30
    trust = ["--cert-dir", str(tls_registry.ca.parent)]
    pushed = json.loads(cli("image", "build", "--push", target, *trust, "--json", "--lock", "lock.json").stdout)
    assert pushed["pushed"] == f"{target}@{cpu_image.digest}"
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", f"--cert-dir={tls_registry.ca.parent}", f"docker://{target}@{cpu_image.digest}"],
        capture_output=True,
        check=True,
    ).stdout
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == cpu_image.digest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--flavour", "gpu"], "error: --flavour: the gpu flavour needs its CUDA base image from a registry"),
        (["--flavour", "tpu"], "error: --flavour: no image flavour 'tpu': choose one of cpu, gpu"),
        (["--push", "reg.example/t:1"], "error: --push: 'reg.example/t:1' is not HOST[:PORT]/REPOSITORY"),
        (["--push", "trainer"], "error: --push: 'trainer' is not HOST[:PORT]/REPOSITORY"),
        (["--cert-dir", "nowhere"], "error: --cert-dir: nowhere is not a folder"),
        (["--lock", "no/cpu.lock.json"], "error: --lock: no/cpu.lock.json is not a file in an existing folder"),
        (["--lock", "."], "error: --lock: . is not a file in an existing folder"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_in_one_line_before_building(cli: Cli, args: list[str], message: str) -> None:
    refused = cli("image", "build", *args, expect=2, env={"INFRACTL_IMAGE_CACHE": str(cli.cwd / "cache")})
    assert refused.stderr.startswith(message) and refused.stderr.count("\n") == 1, refused.stderr
    assert not (cli.cwd / "cache").exists()


def test_builds_take_turns_on_a_lock_of_the_checkouts_own_and_never_on_a_planted_one(tmp_path: Path) -> None:
    """The lock is in the checkout's build/, not at a path another user can predict in /tmp; a
    symbolic link, or a file another user owns or may open (and so hold), is refused, untouched."""
    assert _SDIST_TURN.parent == REPO / "build"
    victim = tmp_path / "victim"
    victim.write_text("someone else's\n")
    (tmp_path / "link.lock").symlink_to(victim)
    with pytest.raises(InfractlError, match="link.lock is a symbolic link, not the build's lock"):
        with _turn(tmp_path / "link.lock"):
            pass
    foreign = tmp_path / "foreign.lock"
    foreign.touch(mode=0o600)
    os.chown(foreign, 65534, 65534)  # nobody's
    readable = tmp_path / "readable.lock"
    readable.touch(mode=0o644)
    readable.chmod(0o644)
    for planted in (foreign, readable):
        with pytest.raises(InfractlError, match="is not a file of this user's alone"):
            with _turn(planted):
                pass
    assert victim.read_text() == "someone else's\n"
    # A new one: private, and held while the block runs.
    lock = tmp_path / "fresh" / "sdist.lock"
    with _turn(lock):
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600 and stat.S_IMODE(lock.parent.stat().st_mode) == 0o700
        with lock.open() as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with lock.open() as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_lock_record_replaces_a_link_planted_where_it_goes_and_never_writes_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("someone else's\n")
    record = tmp_path / "cpu.lock.json"
    record.symlink_to(victim)
    built = CachedImage("cpu", tmp_path / "layout", "sha256:" + "0" * 64, 1, "0" * 16, cached=True)
    _write_lock(record, built, {"suite": "bookworm"})
    assert victim.read_text() == "someone else's\n"
    assert not record.is_symlink() and json.loads(record.read_text())["digest"] == built.digest
    assert stat.S_IMODE(record.stat().st_mode) == 0o644 and sorted(p.name for p in tmp_path.iterdir()) == [
        "cpu.lock.json",
        "victim",
    ]
