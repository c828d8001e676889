"""The trainer image on a multi-host cluster, end to end: a 2-node netns cluster whose
``runtime.image`` pins the cpu image this session built (``cpu_image``). ``up`` starts the
cluster's registry (TLS from the cluster's own CA), copies the image into it, and every node pulls
it by digest into its own store and verifies it; a node whose store holds another image under the
pinned name fails ``up`` naming it and both digests. A run trains in confined containers and
survives a killed node (that the quickstart's checkpoints name the digest read inside the
container is tests/test_ssh.py's, on hosts of a team's). Teardown leaves no container, image store,
registry or namespace."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from infractl import proc
from infractl.providers.engines import IMAGE_UID
from infractl.statedir import ClusterState
from infractl.store import FileStore

from conftest import BuiltImage, Cli, module_cluster, stop_runs, wait_for_commit, write

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("containers")]

CLUSTER = """\
name: boxed
provider: netns
nodes: 2
runtime: {{image: "infractl/trainer@{digest}"}}
"""
RUN = """\
name: {name}
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: {steps}
checkpoint: {{every: 10, keep: 2}}
nodes: {{min: 1, max: 2}}
max_restarts: 3
watchdog: {{step_timeout_s: 8}}
"""


@pytest.fixture(scope="module")
def boxed(tmp_path_factory: pytest.TempPathFactory, cpu_image: BuiltImage) -> Iterator[Cli]:
    with module_cluster(tmp_path_factory, "containers", cluster_yaml=CLUSTER.format(digest=cpu_image.digest)) as cli:
        state = cli.home / "boxed"
        namespaces = [f"infractl-{ClusterState('boxed', state).short_id}-{index}" for index in range(2)]
        yield cli
    # Torn down (module_cluster found no process with the cluster's marker): no image store, no
    # mount from one, no registry, no namespace; only the kept store and the lock.
    assert sorted(p.name for p in state.iterdir()) == ["lock", "store"]
    with open("/proc/self/mountinfo") as mounts:
        assert [line for line in mounts if str(state) in line] == []
    assert [p.pid for p in psutil.process_iter(["cmdline"]) if str(state) in " ".join(p.info["cmdline"] or [])] == []
    listed = subprocess.run(["ip", "-json", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert set(namespaces).isdisjoint(n["name"] for n in json.loads(listed or "[]"))


def _record(cli: Cli) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((cli.home / "boxed" / "cluster.json").read_text())
    return record


def _engine(cli: Cli, node: str) -> dict[str, Any]:
    """The node's container engine as Ansible got it from the provider (its own store and run root)."""
    inventory = json.loads((cli.home / "boxed" / "ansible" / "inventory" / "hosts.json").read_text())
    host: dict[str, Any] = inventory["all"]["hosts"][node]
    return host


def _podman(cli: Cli, node: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The node's own engine, as the cluster runs it."""
    return subprocess.run(
        [*_engine(cli, node)["container_runtime_cli"], *args], capture_output=True, text=True, timeout=120
    )


def test_every_node_pulls_the_pinned_image_into_its_own_store(boxed: Cli, cpu_image: BuiltImage) -> None:
    record = _record(boxed)
    registry = record["registry"]
    assert record["image"] == f"{registry['host']}:{registry['port']}/infractl/trainer@{cpu_image.digest}"
    for node in ("node-0", "node-1"):
        inspected = _podman(boxed, node, "image", "inspect", record["image"])
        assert inspected.returncode == 0, inspected.stderr
        assert json.loads(inspected.stdout)[0]["Digest"] == cpu_image.digest
    # Each node holds its own copy: two stores, each with the image's layers.
    stores = {node: boxed.home / "boxed" / "containers" / node / "storage" / "overlay" for node in ("node-0", "node-1")}
    assert all(any(store.iterdir()) for store in stores.values())
    # The nodes trust the cluster's CA, and the registry answers only over TLS.
    assert (boxed.home / "boxed" / "containers" / "node-0" / "certs" / "ca.crt").is_file()


def _plant(cli: Cli, node: str, pinned: str, tmp_path: Path) -> str:
    """Put another image into ``node``'s store under the pinned name (as a store that a stale or
    tampered pull left behind would hold it); return that image's own manifest digest."""
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    (rootfs / "planted").write_text("not the trainer\n")
    layout = tmp_path / "planted"
    home = cli.home / "boxed" / "containers" / node
    engine = _engine(cli, node)
    storage = f"containers-storage:[overlay@{home}/storage+{engine['container_runtime_runroot']}]"
    repository = pinned.rpartition("@")[0]
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tmp_path / "planted.tar"), "."], check=True)
    container = subprocess.run(
        ["buildah", "from", "scratch"], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        subprocess.run(
            ["buildah", "add", container, str(tmp_path / "planted.tar"), "/"], check=True, capture_output=True
        )
        subprocess.run(["buildah", "commit", "-q", container, f"oci:{layout}:planted"], check=True, capture_output=True)
    finally:
        subprocess.run(["buildah", "rm", container], check=True, capture_output=True)
    assert _podman(cli, node, "rmi", "--force", pinned).returncode == 0
    subprocess.run(["skopeo", "copy", "-q", f"oci:{layout}:planted", f"{storage}{repository}:planted"], check=True)
    planted = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    images_json = home / "storage" / "overlay-images" / "images.json"
    images = json.loads(images_json.read_text())
    pinned_digest = pinned.rpartition("@")[2]
    for image in images:
        if f"{repository}:planted" in image.get("names", []):
            image["digest"], image["digests"] = pinned_digest, [pinned_digest]
    images_json.write_text(json.dumps(images))
    return str(planted)


def test_a_node_holding_another_image_under_the_pinned_name_fails_up(
    boxed: Cli, cpu_image: BuiltImage, tmp_path: Path
) -> None:
    pinned = _record(boxed)["image"]
    planted = _plant(boxed, "node-1", pinned, tmp_path)
    # The store's own record says the pinned digest: only the manifest's bytes tell.
    claimed = _podman(boxed, "node-1", "image", "inspect", pinned)
    assert claimed.returncode == 0 and json.loads(claimed.stdout)[0]["Digest"] == cpu_image.digest

    failed = boxed("up", "-c", str(boxed.cwd / "cluster.yaml"), expect=None)
    assert failed.returncode != 0
    # After what `up` did before (terraform, registry, Ansible starting), one line says what failed.
    line = failed.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: node-1: trainer_image: image {pinned} is pinned, but the image the node holds"), (
        line
    )
    assert planted in line and cpu_image.digest in line

    # The operator removes the stray image; the next `up` pulls the pinned one again, from the
    # registry that serves it already: this machine's image cache is not needed for it.
    assert _podman(boxed, "node-1", "rmi", "--force", f"{pinned.rpartition('@')[0]}:planted").returncode == 0
    again = boxed("up", "-c", str(boxed.cwd / "cluster.yaml"), env={"INFRACTL_IMAGE_CACHE": str(tmp_path / "none")})
    assert f"image: {pinned} (already in the registry)" in again.stderr
    inspected = _podman(boxed, "node-1", "image", "inspect", pinned)
    assert json.loads(inspected.stdout)[0]["Digest"] == cpu_image.digest


def test_a_killed_node_recovers_in_containers_from_the_last_commit(boxed: Cli) -> None:
    state = boxed.home / "boxed"
    store = FileStore(state / "store")
    run = write(boxed.cwd / "boxed.yaml", RUN.format(name="boxed", steps=400))
    try:
        boxed("train", str(run), "--detach", "-c", "boxed")
        wait_for_commit(store, "boxed", at_least=10, timeout=240)
        # The agents run in containers named and labelled after the run and node, which status counts.
        for node in ("node-0", "node-1"):
            [container] = json.loads(_podman(boxed, node, "ps", "--format", "json").stdout)
            assert container["Names"] == [f"infractl-boxed-{node}"]
            # The image's user, with no capability and none to gain: code a run brings cannot act as
            # the node's root. (In the container's mount namespace: the engine's client that started
            # it carries the markers too.)
            host = os.readlink("/proc/self/ns/mnt")
            found = proc.find(state, node=node, run="boxed")
            contained = [p for p in found if os.readlink(f"/proc/{p.pid}/ns/mnt") != host]
            assert contained, node
            for process in contained:
                status = dict(
                    line.split(":\t", 1) for line in Path(f"/proc/{process.pid}/status").read_text().splitlines()
                )
                assert (status["CapEff"], status["CapBnd"], status["NoNewPrivs"]) == ("0" * 16, "0" * 16, "1"), status
                # As the image's user, never the node's root.
                assert status["Uid"].split()[:2] == [str(IMAGE_UID)] * 2, status
            assert (container["Labels"]["org.infractl.run"], container["Labels"]["org.infractl.node"]) == (
                "boxed",
                node,
            )
        status = json.loads(boxed("status", "--json", "-c", "boxed").stdout)
        assert status["image"] == _record(boxed)["image"]
        assert all(n["live_processes"] for n in status["nodes"]), status["nodes"]
        assert [r["state"] for r in status["runs"] if r["run"] == "boxed"] == ["running"]

        drill = boxed("drill", "kill-node", "-c", "boxed", "--node", "node-1", "--json", "--timeout", "300")
        result = json.loads(drill.stdout)
        assert result["outcome"] == "recovered", result
        assert result["resumed_correctly"] and result["resumed_from_step"] >= 10, result
        assert result["final_committed"] and result["final_step"] == 400, result
    finally:
        stop_runs(state)
