"""The cluster record (``statedir.ClusterRecord``): read once, typed, and still readable when an
older infractl wrote it (a cluster that was up across an upgrade)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infractl.config import parse_cluster
from infractl.errors import InfractlError
from infractl.node import Node, SshLogin
from infractl.planning.devices import Device
from infractl.statedir import ClusterIntent, ClusterRecord, ClusterState, Endpoint

SPEC = parse_cluster({"name": "multi", "provider": "netns", "runtime": {"image": "trainer@sha256:" + "ab" * 32}})


def _previous_record(tmp_path: Path) -> dict[str, object]:
    """A netns cluster's record as infractl wrote it before records were typed: nodes with their
    namespace (a field nodes no longer have), and a record older still has no id and no device."""
    return {
        "name": "multi",
        "spec": SPEC.model_dump(mode="json"),
        "store": f"file://{tmp_path}/store",
        "infractl_version": "0.1.0",
        "rendezvous": {"host": "10.200.1.1", "port": 29400},
        "registry": {"host": "10.200.1.1", "port": 40123},
        "image": "10.200.1.1:40123/trainer@sha256:" + "ab" * 32,
        "nodes": [
            {
                "name": f"node-{index}",
                "address": f"10.200.1.{index + 2}",
                "workdir": str(tmp_path / f"node-{index}"),
                "processes": 1,
                "namespace": f"infractl-abcdef-{index}",
                "ssh": {"user": "root", "identity_file": "/k/id", "known_hosts": "/k/known_hosts"},
            }
            for index in range(2)
        ],
    }


def test_a_record_an_older_infractl_wrote_reads_with_what_it_lacks_unset(tmp_path: Path) -> None:
    state = ClusterState("multi", tmp_path / "multi")
    state.dir.mkdir()
    state.record_path.write_text(json.dumps(_previous_record(tmp_path)))

    record = state.record()

    assert record.spec == SPEC and record.spec.provider == "netns" and state.spec() == SPEC
    assert record.rendezvous == Endpoint("10.200.1.1", 29400) and record.registry == Endpoint("10.200.1.1", 40123)
    assert record.id is None and record.device is None
    login = SshLogin("root", Path("/k/id"), Path("/k/known_hosts"))
    assert record.nodes[1] == Node("node-1", "10.200.1.3", tmp_path / "node-1", 1, ssh=login)
    assert state.read_intent() == record


def test_a_record_is_written_as_it_is_read(tmp_path: Path) -> None:
    state = ClusterState("multi", tmp_path / "multi")
    record = ClusterRecord(
        name="multi",
        spec=SPEC,
        store="s3://bucket/prefix",
        id="0123456789abcdef",
        infractl_version="0.2.0",
        rendezvous=Endpoint("10.200.1.1", 29400),
        nodes=(Node("node-0", "10.200.1.2", tmp_path / "node-0", 2),),
        device=Device("cpu", 1 << 30, None, False),
    )
    state.write(record)
    assert state.record() == record
    # The same keys as before records were typed: an older infractl reads it too.
    written = json.loads(state.record_path.read_text())
    assert set(written) == {"name", "spec", "store", "id", "infractl_version", "rendezvous", "nodes", "device"}


def test_an_interrupted_up_is_read_from_its_intent(tmp_path: Path) -> None:
    state = ClusterState("multi", tmp_path / "multi")
    state.dir.mkdir()
    state.intent_path.write_text(json.dumps(ClusterIntent(name="multi", spec=SPEC, store="s3://b/p").to_json()))
    assert state.read_intent() == ClusterIntent(name="multi", spec=SPEC, store="s3://b/p")
    assert not isinstance(state.read_intent(), ClusterRecord)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rendezvous": None}, "'NoneType' object is not subscriptable"),
        ({"nodes": None}, "'NoneType' object is not iterable"),
        ({"spec": {"name": "multi", "provider": "gone"}}, "spec.provider: Input should be"),
    ],
)
def test_a_record_that_is_not_one_is_refused_in_one_line_naming_what(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    state = ClusterState("multi", tmp_path / "multi")
    state.dir.mkdir()
    state.record_path.write_text(json.dumps(_previous_record(tmp_path) | change))
    with pytest.raises(InfractlError, match=f"cannot read the cluster record {state.record_path}: ") as raised:
        state.record()
    assert message in raised.value.message and "\n" not in raised.value.message


def test_a_record_without_a_field_names_it(tmp_path: Path) -> None:
    state = ClusterState("multi", tmp_path / "multi")
    state.dir.mkdir()
    state.record_path.write_text(json.dumps({k: v for k, v in _previous_record(tmp_path).items() if k != "store"}))
    with pytest.raises(InfractlError, match="no 'store'"):
        state.record()
