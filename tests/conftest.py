"""Shared fixtures: the one CLI helper every CLI test goes through."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist
import yaml
from hypothesis import HealthCheck, settings
from labhosts import LAB_RECORD, remove_lab

from infractl import proc, providers, runstore
from infractl.cli import main
from infractl.errors import InfractlError
from infractl.providers.aws.spec import AwsSpec
from infractl.providers.aws.sweep import CLUSTER_TAG, reap
from infractl.providers.ssh.hosts import HostRecord
from infractl.statedir import ClusterState, started_clusters
from infractl.store import Store

from awsemu import NETWORK_RECORD, STATE_BUCKET, EmulatedAws, emulated_aws, remove_network
from s3server import AWS_TEST_ENV, AWS_TEST_ENV_UNSET, moto_server

REPO = Path(__file__).resolve().parent.parent

# Property tests (tests/test_properties.py): `ci`, the default, is a fixed budget that keeps them
# within two minutes on 2 cores; `pytest --hypothesis-profile=long` runs thousands of examples.
_PROPERTY_SETTINGS = {
    "deadline": None,  # one example runs a whole command; its time varies with the machine
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=120, **_PROPERTY_SETTINGS)
settings.register_profile("long", max_examples=3000, **_PROPERTY_SETTINGS)
settings.load_profile("ci")


#: In each test session's base temporary directory (``pytest-N``): the pid of the process that runs
#: the session (xdist's controller), so the next session can tell whether it is still going.
_SESSION_PID = "session.pid"
#: The environment variable that names a process's session (its base temporary directory).
_SESSION_ENV = "INFRACTL_TEST_SESSION"


@pytest.hookimpl(trylast=True)  # after pytest's own, which makes the base temporary directory's factory
def pytest_configure(config: pytest.Config) -> None:
    """Before any test (once, in the process that starts the workers): clusters an earlier session
    left up are torn down (it was killed before its fixtures could), then ``infractl gc --yes``, so
    what an interrupted earlier run left on this machine (clusters whose state directory is gone,
    an `up` that never finished) cannot break this one. What could not be removed is printed."""
    if hasattr(config, "workerinput"):
        return
    # pytest's factory of the base temporary directory: the only handle on it before any test.
    base = config._tmp_path_factory.getbasetemp()
    _reap_earlier_sessions(base.parent)
    (base / _SESSION_PID).write_text(str(os.getpid()))
    # Every process the session starts inherits it (workers, moto servers, torchrun agents, CLIs).
    os.environ[_SESSION_ENV] = str(base)
    done = subprocess.run(
        [sys.executable, "-m", "infractl", "gc", "--yes"], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        sys.stderr.write(f"infractl gc --yes before the tests failed:\n{done.stderr}")


# --- tiers: what `scripts/test.sh --quick` runs ---------------------------------------------------
#
# Every test is quick unless it is marked `cluster` (pyproject.toml's markers, on the test or as its
# module's pytestmark), and `--quick` deselects those (`-m "not cluster"`). Mark a test that brings a
# cluster up (`infractl up`, netns), launches ranks (torchrun, a fixture's run included) or needs the
# trainer image or the emulated AWS. The last two mark the tests that use their fixtures here; a
# test that brings a cluster up without the mark fails before its `up` runs, naming the mark.

#: Fixtures whose tests are cluster tests by using them: the trainer image, the emulated AWS.
_CLUSTER_FIXTURES = frozenset({"cpu_image", "emulation"})

#: The test being set up, run or torn down in this process (what an `up` is checked against).
_running: pytest.Item | None = None


@pytest.hookimpl(tryfirst=True)  # before pytest's own, which deselects by the marks (-m)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(tryfirst=True)  # before its fixtures are set up (a module's cluster among them)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _running
    _running = item


def _refuse_unmarked_up(args: tuple[str, ...]) -> None:
    """An `infractl up` that would bring a cluster up (not a dry run) is for tests marked
    ``cluster`` only: anything else fails here, before the cluster exists."""
    if args[:1] != ("up",) or "--dry-run" in args or _running is None:
        return
    if _running.get_closest_marker("cluster") is None:
        pytest.fail(
            f"{_running.nodeid} brings a cluster up: mark it @pytest.mark.cluster "
            "(or its module: pytestmark), so that scripts/test.sh --quick leaves it out",
            pytrace=False,
        )


#: Lines of each node's run log a failed test's report shows (its cluster is torn down, and its
#: logs with it, before anyone can read them: on CI the report is all there is).
_LOG_TAIL_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used a cluster (a ``Cli`` among its fixtures) reports the tail of every
    node's run log beside its output."""
    report = yield
    if report.failed and call.when == "call":
        homes = {arg.home for arg in getattr(item, "funcargs", {}).values() if isinstance(arg, Cli)}
        for log in sorted(path for home in homes for path in home.glob("*/nodes/*/logs/*.log")):
            tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
            report.sections.append((f"node log {log.relative_to(log.parents[4])}", "\n".join(tail)))
    return report


def _ended(session: Path) -> bool:
    """Whether the test session of base temporary directory ``session`` recorded its pid and is
    gone (a session of an older checkout recorded none: it is left alone)."""
    pid_file = session / _SESSION_PID
    return pid_file.is_file() and not psutil.pid_exists(int(pid_file.read_text() or 0))


def _reap_earlier_sessions(sessions: Path) -> None:
    """What a session killed midway left under ``sessions`` (``pytest-of-<user>``): its module
    clusters still up (namespaces, sshds, a run still training: their state directories still
    exist, so gc sees them as owned) are torn down, then its other processes (moto servers,
    torchrun agents it started itself) are killed, and its emulated AWS networks removed (a second
    bridge routing the emulation's VPC would take this session's replies to its hosts), with its
    labs of existing machines and this machine's record of their hosts."""
    for state in started_clusters():
        if not state.dir.is_relative_to(sessions):
            continue
        if not _ended(sessions / state.dir.relative_to(sessions).parts[0]):
            continue
        done = subprocess.run(
            [sys.executable, "-m", "infractl", "teardown", "-c", state.name, "--yes"],
            env=os.environ | {"INFRACTL_HOME": str(state.dir.parent)},
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            # Its cloud was an emulation that died with the session (tests/awsemu.py), or its store a
            # moto server: nothing outside this machine to leak. Its state goes, so gc forgets it.
            sys.stderr.write(f"the cluster {state.dir} an earlier test session left up:\n{done.stderr}")
            shutil.rmtree(state.dir, ignore_errors=True)
    left = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            session = process.environ().get(_SESSION_ENV)
            if session and Path(session).is_relative_to(sessions) and _ended(Path(session)):
                left.append(process)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()  # by PID
    for session in sessions.iterdir():
        if session.is_dir() and _ended(session):
            for record in [*session.glob(f"*/{NETWORK_RECORD}"), *session.glob(f"*/*/{NETWORK_RECORD}")]:
                remove_network(record.parent)
            for record in session.glob(f"*/{LAB_RECORD}"):
                remove_lab(record.parent)
    # The ssh clusters of those sessions: their hosts (tests/labhosts.py) went with them.
    for hosts in HostRecord.every():
        cluster_dir = Path(hosts.cluster_dir)
        if cluster_dir.is_relative_to(sessions) and _ended(sessions / cluster_dir.relative_to(sessions).parts[0]):
            hosts.remove()


@dataclass
class Cli:
    """Runs the real ``infractl`` in its own process, in a private working directory."""

    cwd: Path
    program: list[str] = field(default_factory=lambda: [sys.executable, "-m", "infractl"])
    """How ``infractl`` is started: this checkout's, by default."""

    @property
    def home(self) -> Path:
        return self.cwd / ".infractl"

    def env(self) -> dict[str, str]:
        return {**os.environ, "INFRACTL_HOME": str(self.home), "NO_COLOR": "1", "COLUMNS": "200"}

    def __call__(
        self, *args: str, expect: int | None = 0, timeout: float = 600, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``infractl ARGS`` (``env``: extra variables) and assert its exit code (None: any);
        a failure must be one clean message. An ``up`` that may succeed must be a cluster test's."""
        if expect in (0, None):
            _refuse_unmarked_up(args)
        result = subprocess.run(
            [*self.program, *args],
            cwd=self.cwd,
            env=self.env() | (env or {}),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        detail = f"infractl {' '.join(args)}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        assert expect is None or result.returncode == expect, detail
        if result.returncode != 0:
            assert "Traceback" not in result.stderr, detail
        return result


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    runner = Cli(tmp_path)
    yield runner
    # A failed test must not leak node processes: kill whatever its clusters still run, by PID.
    if runner.home.is_dir():
        for cluster_dir in runner.home.iterdir():
            proc.kill_all(cluster_dir, timeout=30)


@contextlib.contextmanager
def module_cluster(
    tmp_path_factory: pytest.TempPathFactory, name: str, *, cwd: Path | None = None, cluster_yaml: str | None = None
) -> Iterator[Cli]:
    """For a module-scoped fixture: `infractl up` the default 2-node local cluster (or the one
    ``cluster_yaml`` describes, written to ``cluster.yaml``) in a fresh directory (or in ``cwd``),
    hand it to the module's tests, and tear it down (no process may remain)."""
    cli = Cli(cwd or tmp_path_factory.mktemp(name))
    cluster = ["-c", str(write(cli.cwd / "cluster.yaml", cluster_yaml))] if cluster_yaml else []
    cluster_name = yaml.safe_load(cluster_yaml)["name"] if cluster_yaml else "local"
    cli("up", *cluster)
    try:
        yield cli
    finally:
        cli("teardown", "--yes", "-c", cluster_name)
        assert proc.find(cli.home / cluster_name) == []


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str


def run_cli(args: list[str], *, home: Path, cwd: Path) -> Outcome:
    """``infractl ARGS`` in this process, as the console script runs it (for the many quick calls
    of the property tests): argv, state root, working directory and the standard streams are set
    for the call and put back after it. Any exception other than the exit is a traceback the user
    would have seen, and fails the test with it."""
    out, err = io.StringIO(), io.StringIO()
    saved = (sys.argv, sys.stdin, os.getcwd(), os.environ.get("INFRACTL_HOME"))
    sys.argv, sys.stdin = ["infractl", *args], io.StringIO("")
    os.environ["INFRACTL_HOME"] = str(home)
    os.chdir(cwd)
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.argv, sys.stdin = saved[0], saved[1]
        os.chdir(saved[2])
        if saved[3] is None:
            os.environ.pop("INFRACTL_HOME", None)
        else:
            os.environ["INFRACTL_HOME"] = saved[3]
    return Outcome(code if isinstance(code, int) else (0 if code is None else 1), out.getvalue(), err.getvalue())


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo process group in this process, for tests of collective code."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def one_line(stderr: str) -> str:
    """The one error line a refused or failed command printed (and nothing else on stderr)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]


def running_runs(cluster_dir: Path) -> dict[str, set[str]]:
    """run -> the nodes running it, as the cluster's provider sees them (what `infractl status` shows)."""
    return providers.control(ClusterState(cluster_dir.name, cluster_dir)).running_runs()


def stop_runs(cluster_dir: Path) -> None:
    """SIGKILL every run's processes of the cluster on this machine: a test that leaves its run
    going (or fails midway) must not leave it to the next test."""
    victims = [p for p in proc.listing(cluster_dir) if p.run is not None]
    proc.signal_listed(victims, signal.SIGKILL)
    for run in {p.run for p in victims}:
        assert proc.wait_gone(cluster_dir, run=run, timeout=30) == [], run


def wait_for_world(store: Store, run_id: str, *, size: int, since: float, timeout: float) -> int:
    """Poll until the run records a step on ``size`` ranks after ``since``; return that step."""
    deadline = time.monotonic() + timeout
    metrics = runstore.MetricsTail(store, run_id)
    while time.monotonic() < deadline:
        steps = [r["step"] for r in metrics.records() if r["time"] > since and r["world_size"] == size]
        if steps:
            return min(steps)
        time.sleep(1)
    raise AssertionError(f"{run_id} ran no step on {size} ranks within {timeout}s")


def wait_for_commit(store: Store, run_id: str, *, at_least: int, timeout: float) -> int:
    """Poll until the run has a committed checkpoint at ``at_least`` or later; return its step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step = runstore.latest_committed_step(store, run_id)
        if step is not None and step >= at_least:
            return step
        time.sleep(0.25)
    raise AssertionError(f"no checkpoint of {run_id} reached step {at_least} within {timeout}s")


# --- emulated AWS (tests/awsemu.py) ----------------------------------------------------------


def emulation_fixture(folder: str, vpc_cidr: str) -> Any:
    """A test module's ``emulation`` fixture (``emulation = emulation_fixture(...)``): one emulated AWS
    for the module, its VPC ``vpc_cidr``, its files in a fresh ``folder`` of the session's temporary
    directory, with the bucket the clusters' Terraform state goes in. Modules that may run at the
    same time (on two workers) need VPCs of their own: two of one range would route each other's hosts."""

    @pytest.fixture(scope="module")
    def emulation(aws_test_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedAws]:
        with emulated_aws(tmp_path_factory.mktemp(folder), vpc_cidr) as emulated:
            emulated.client("s3").create_bucket(Bucket=STATE_BUCKET)
            yield emulated

    return emulation


@pytest.fixture
def aws_left_clean(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """For the emulated-AWS tests (their module's ``emulation``, tests/awsemu.py): what a test leaves
    (a failed one) is removed after it and named as an error, so that one failure stays one: a
    cluster left in the VPC would give the next cluster's hosts its addresses, and `gc --yes`
    (tests/test_gc.py) would try to tear down an `up` of it after its AWS has gone with the
    emulation."""
    yield
    if "emulation" not in request.fixturenames or "applied" in request.fixturenames:
        return  # the class's cluster is destroyed with its fixture
    emulation = request.getfixturevalue("emulation")
    left = []
    for state in started_clusters():
        if not state.dir.is_relative_to(tmp_path_factory.getbasetemp()):
            continue
        try:
            aws = state.spec().settings(AwsSpec)
        except (InfractlError, OSError):
            aws = None
        if aws is None or aws.endpoint_url != emulation.endpoint:
            continue
        left.append(f"cluster {state.dir}")
        done = Cli(state.dir.parent.parent)("teardown", "-c", state.name, "--purge", "--yes", expect=None, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(state.dir, ignore_errors=True)
            state.unlist()
    mappings = emulation.client("resourcegroupstaggingapi").get_resources(TagFilters=[{"Key": CLUSTER_TAG}])
    tagged = {
        tag["Value"] for m in mappings["ResourceTagMappingList"] for tag in m["Tags"] if tag["Key"] == CLUSTER_TAG
    }
    for name in sorted(tagged):
        if removed := reap(name, "us-east-1", endpoint_url=emulation.endpoint):
            left.append(f"cluster {name}'s {', '.join(removed)}")
    emulation.sync()
    assert not left, f"the test left these behind (now removed): {left}"


# --- S3: a real S3 API server (moto's standalone server) over HTTP on loopback -------------------
#
# ``s3_server``     session-scoped endpoint URL of a moto server started for this test process
#                   (each xdist worker starts its own); stopped by PID at the end.
# ``aws_test_env``  session-scoped fake credentials in os.environ, so boto3 in the tests and in
#                   child processes (the CLI, torchrun trainers) finds them in its normal chain.
# ``s3_store_uri``  a fresh bucket per test: ``s3://<bucket>/<prefix>?endpoint_url=<endpoint>``.
# ``store_uri``     parametrized over ["file", "s3"]: write a test once, run it on both backends.
# ``s3_auth_server`` a second moto server that enforces credentials (IAM), with one valid user.


@pytest.fixture(scope="session")
def aws_test_env() -> Iterator[dict[str, str]]:
    with pytest.MonkeyPatch.context() as mp:
        for name in AWS_TEST_ENV_UNSET:
            mp.delenv(name, raising=False)
        for name, value in AWS_TEST_ENV.items():
            mp.setenv(name, value)
        yield dict(AWS_TEST_ENV)


@pytest.fixture(scope="session")
def s3_server(aws_test_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL (``http://127.0.0.1:PORT``) of a moto S3 server for this test process."""
    with moto_server(tmp_path_factory.mktemp("moto") / "server.log") as endpoint:
        yield endpoint


def s3_client(endpoint: str, **credentials: str) -> Any:
    """A plain boto3 S3 client for ``endpoint`` (tests use it to set up and inspect buckets)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 2}),
        **credentials,
    )


def new_bucket_name() -> str:
    return f"infractl-test-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def s3_store_uri(s3_server: str) -> str:
    """A store URI in a fresh, empty bucket on the test S3 server (unique per test)."""
    bucket = new_bucket_name()
    s3_client(s3_server).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/store?endpoint_url={s3_server}"


@pytest.fixture(params=["file", "s3"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store URI on each backend: ``file://<tmp>/store`` and ``s3_store_uri``."""
    if request.param == "file":
        (tmp_path / "store").mkdir()
        return (tmp_path / "store").as_uri()
    return str(request.getfixturevalue("s3_store_uri"))


@dataclass(frozen=True)
class S3AuthServer:
    """A moto server that checks signatures against its IAM users; the one user here may do
    anything (S3 and IAM: a test can make more users with narrower policies)."""

    endpoint: str
    access_key_id: str
    secret_access_key: str
    bucket: str

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
        }


@pytest.fixture(scope="session")
def s3_auth_server(aws_test_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3AuthServer]:
    """moto with authentication on: the first 3 requests (create a user, give it S3, make its key)
    run unauthenticated; every later request must be signed by a known key and be allowed."""
    import boto3

    log = tmp_path_factory.mktemp("moto-auth") / "server.log"
    with moto_server(log, env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as endpoint:
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1")
        iam.create_user(UserName="infractl-test")
        iam.put_user_policy(
            UserName="infractl-test",
            PolicyName="admin",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="infractl-test")["AccessKey"]
        server = S3AuthServer(endpoint, key["AccessKeyId"], key["SecretAccessKey"], new_bucket_name())
        owner = s3_client(
            endpoint,
            aws_access_key_id=server.access_key_id,
            aws_secret_access_key=server.secret_access_key,
        )
        owner.create_bucket(Bucket=server.bucket)
        yield server


# --- a cluster whose store is down ------------------------------------------------------------
#
# ``store_down_cluster(cwd, backend)`` brings a real 2-node cluster up on a store of ``backend``
# ("file" or "s3", on its own moto server), trains a tiny run to completion, then takes the store
# away (the directory is moved; the server is stopped by its PID). It tears the cluster down on
# exit. Test modules share one per module (a module-scoped fixture), never one per test.

OUTAGE_RUN = """\
name: tiny
model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}
data: {max_bytes: 100000}
batch_size: 4
steps: 4
checkpoint: {every: 2, keep: 2}
nodes: {min: 1, max: 2}
"""


@dataclass(frozen=True)
class Outage:
    """A cluster that is up, whose store is down."""

    cli: Cli
    cluster: str  # its name: the -c argument
    store_uri: str
    run_file: Path

    @property
    def state_dir(self) -> Path:
        return self.cli.home / self.cluster


@contextlib.contextmanager
def store_down_cluster(cwd: Path, backend: str) -> Iterator[Outage]:
    cli = Cli(cwd)
    name = f"outage-{backend}"
    with contextlib.ExitStack() as stack:
        if backend == "file":
            store_dir = cwd / "store"
            store_dir.mkdir()
            uri = store_dir.as_uri()

            def take_down() -> None:
                store_dir.rename(cwd / "store.away")
        else:
            server = contextlib.ExitStack()
            endpoint = server.enter_context(moto_server(cwd / "moto.log"))
            stack.callback(server.close)
            bucket = new_bucket_name()
            s3_client(endpoint).create_bucket(Bucket=bucket)
            uri = f"s3://{bucket}/runs?endpoint_url={endpoint}"
            take_down = server.close
        cluster_file = write(cwd / "cluster.yaml", f"name: {name}\nnodes: 2\nstore: {uri}\n")
        run_file = write(cwd / "run.yaml", OUTAGE_RUN)
        cli("up", "-c", str(cluster_file))
        stack.callback(lambda: cli("teardown", "-c", name, "--yes"))
        cli("train", str(run_file), "-c", name)
        take_down()
        yield Outage(cli, name, uri, run_file)


@dataclass(frozen=True)
class BuiltImage:
    """The cpu trainer image as ``infractl image build --json`` reported it."""

    digest: str
    layout: Path
    lock: Path
    build: dict[str, Any]


@pytest.fixture(scope="session")
def cpu_image(tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    """The cpu trainer image, built once per test session by the real CLI into an image cache the
    session's workers share (a file lock makes the first build it and the others wait, then find
    it cached); every ``infractl`` the tests start finds it there ($INFRACTL_IMAGE_CACHE).
    A cache named in $INFRACTL_IMAGE_CACHE already is used as it is (a developer's, across runs)."""
    base = tmp_path_factory.getbasetemp()
    session = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = Path(os.environ.get("INFRACTL_IMAGE_CACHE") or session / "image-cache")
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["INFRACTL_IMAGE_CACHE"] = str(cache)
    lock = cache / "cpu.lock.json"
    with (cache / ".build.lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        built = subprocess.run(
            [sys.executable, "-m", "infractl", "image", "build", "--json", "--lock", str(lock)],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "NO_COLOR": "1"},
        )
    assert built.returncode == 0, built.stderr
    result = json.loads(built.stdout)
    return BuiltImage(digest=result["digest"], layout=Path(result["layout"]), lock=lock, build=result)
