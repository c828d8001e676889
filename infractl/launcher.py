"""``infractl train``: decide what a launch will do, then start one elastic torchrun agent per
node; ``infractl rejoin`` and ``infractl stop``. Following a run is the CLI's (it only reads the
store)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infractl import proc, providers, runs, runstore, workdir
from infractl.config import PreemptionSpec, RunSpec, check_layout
from infractl.dataset import dataset_version, version_mismatch
from infractl.errors import ConfigError, StateError, UsageError
from infractl.log import LOG_FORMAT_ENV, LogFormat
from infractl.node import Node
from infractl.planning.devices import EMULATED_MEMORY_ENV
from infractl.planning.memory import parameters
from infractl.planning.plan import refuse_unless_fits
from infractl.providers import NodeControl
from infractl.providers.engines import IMAGE_PYTHON, IMAGE_RUN_DIR
from infractl.runstore import Attempt, Rejoin, RunRecord
from infractl.servers import keep_rendezvous
from infractl.statedir import ClusterRecord, ClusterState, write_private
from infractl.store import Store, for_cluster
from trainer.faults import REHEARSAL_ENV
from trainer.replica_server import MAX_BYTES_ENV, RUN_KEY_FILE_ENV

__all__ = [
    "Launch",
    "LaunchPlan",
    "Rejoined",
    "prepare",
    "launch",
    "finish",
    "rejoin",
    "run_to_end",
    "stop",
    "Stopped",
    "torchrun_argv",
    "passed_environment",
]

# How often each agent looks at its workers (seconds; torchrun's default is 0.1): a failed worker
# is noticed within it, and each look also asks the rendezvous whether a node waits to join.
_MONITOR_S = 0.25
# Seconds an exited agent's helpers get to notice it (they go within a second when nothing is late).
_HELPERS_GONE_S = 15.0
#: What an agent takes from the environment of the `infractl` that starts it, besides the names a
#: run.yaml ``env:`` lists: the process's basics, the emulated device a rehearsal trains on, and the
#: store's credentials for nodes that reach the store with the operator's (local and netns: this
#: machine; a provider whose nodes have a role of their own withholds them, ``SshNodes.withheld``).
#: Nothing else: a token or a loader variable in the operator's shell stays there.
_PASSED = frozenset(
    {
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "OMP_NUM_THREADS",
        EMULATED_MEMORY_ENV,
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
        "AWS_CA_BUNDLE",
    }
)
#: The most a replica file may hold beyond the model's bytes (the state's small objects: RNG, data
#: position, DCP's metadata) on top of 16 bytes a parameter (fp32 weights and AdamW's two moments,
#: with room to spare): a rank's shard is never more than the whole state.
_REPLICA_SLACK_BYTES = 64 << 20


@dataclass
class Launch:
    run_id: str
    attempt: int
    resume_from: int
    nodes: list[Node]
    agents: dict[str, subprocess.Popen[bytes]]
    control: NodeControl  # how the nodes are reached


@dataclass(frozen=True)
class LaunchPlan:
    """What ``launch`` will do, decided before anything is started."""

    store: Store
    cluster: ClusterRecord
    record: RunRecord
    nodes: list[Node]
    resume_from: int
    complete: bool
    replaces: bool  # `--new` over a run the store already holds: delete it first


def prepare(state: ClusterState, spec: RunSpec, run_file: Path, *, new: bool = False) -> LaunchPlan:
    """Validate the run against the cluster, its data and the store; change nothing.

    With ``new``, the plan starts the run over: whatever the store holds for it is to be
    deleted (``LaunchPlan.replaces``) rather than resumed or checked against.
    """
    cluster = state.record()
    nodes = list(cluster.nodes)
    _check_fits(state, spec, run_file, cluster)
    store = for_cluster(state)
    store.ping()  # an unreachable store fails here, before the dataset is hashed
    version = dataset_version(spec.data)
    fresh = RunRecord(run_id=spec.name, cluster=state.name, dataset_version=version)
    existing = runstore.read_run_record(store, spec.name)
    if new:
        return LaunchPlan(
            store=store,
            cluster=cluster,
            record=fresh,
            nodes=nodes[: spec.nodes.max],
            resume_from=0,
            complete=False,
            replaces=existing is not None,
        )
    record = existing or fresh
    _check_continues(record, spec, version, run_file)
    last = runstore.latest_committed_step(store, spec.name) or 0
    return LaunchPlan(
        store=store,
        cluster=cluster,
        record=record,
        nodes=nodes[: spec.nodes.max],
        resume_from=last,
        complete=last >= spec.steps,
        replaces=False,
    )


def _check_fits(state: ClusterState, spec: RunSpec, run_file: Path, cluster: ClusterRecord) -> None:
    """The run fits the cluster: enough nodes, a layout every world size can run, memory enough on
    the devices ``up`` recorded (the plan's budget, infractl/planning/plan.py), not running yet."""
    nodes = cluster.nodes
    if spec.nodes.min > len(nodes):
        raise UsageError(
            f"{spec.nodes.min} exceeds the {len(nodes)} node(s) of cluster {state.name!r}",
            file=str(run_file),
            field="nodes.min",
        )
    processes = nodes[0].processes
    check_layout(
        spec,
        [
            (count * processes, f"{count} node(s) x {processes} process(es), in the range nodes.min to nodes.max")
            for count in range(spec.nodes.min, min(spec.nodes.max, len(nodes)) + 1)
        ],
        file=str(run_file),
    )
    # What `up` recorded; a cluster brought up before `up` recorded one is sized as `up` would now.
    device = cluster.device or providers.get(cluster.spec.provider).device(cluster.spec, os.environ)
    refuse_unless_fits(
        spec,
        device,
        processes=processes,
        nodes=(spec.nodes.min, spec.nodes.max),
        cluster=state.name,
        file=str(run_file),
    )
    if spec.name in runs.running(state):
        raise UsageError(
            f"run {spec.name!r} is already running on cluster {state.name!r}; see `infractl status` and `infractl logs`"
        )


def _check_continues(record: RunRecord, spec: RunSpec, version: str, run_file: Path) -> None:
    """A run that exists may go on only with the same data and the same model shape."""
    changed = version_mismatch(spec.name, saved=record.dataset_version, current=version, data=spec.data)
    if changed:
        raise ConfigError(f"{changed}; use a new run name, or --new to start over", file=str(run_file), field="data")
    saved_model = (record.spec or {}).get("model")
    if saved_model is not None and saved_model != spec.model.model_dump(mode="json"):
        changes = sorted(k for k, v in spec.model.model_dump(mode="json").items() if saved_model.get(k) != v)
        was = ", ".join(f"model.{k}={saved_model.get(k)}" for k in changes)
        raise ConfigError(
            f"run {spec.name!r} has checkpoints of another shape ({was}); "
            "its checkpoints cannot load into this model: use a new run name, or --new to start over",
            file=str(run_file),
            field="model",
        )


def torchrun_argv(
    spec: RunSpec,
    *,
    python: str,
    nnodes: int,
    processes: int,
    rendezvous: str,
    rdzv_id: str,
    local_addr: str,
    spec_path: Path,
    store_uri: str,
    workdir: Path,
    trainer_args: Sequence[str] = (),
) -> list[str]:
    return [
        python, "-m", proc.AGENT_MODULE,  # torchrun, see trainer/agent.py
        f"--nnodes={min(spec.nodes.min, nnodes)}:{nnodes}",
        f"--nproc-per-node={processes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous}",
        f"--rdzv-id={rdzv_id}",
        # The endpoint is the cluster's own rendezvous server, never a training node. After a node
        # dies, the survivors wait until its keep-alives have been missing for interval x attempts
        # (torchrun's default: 15 s), then wait last_call_timeout for more nodes once nodes.min
        # joined (default: 30 s): both dominate the restart (run.yaml's restart section). A launch's
        # first round waits launch_last_call instead (trainer/rendezvous_patch.py).
        f"--rdzv-conf=is_host=false,last_call_timeout={spec.restart.last_call_s},"
        f"{proc.LAUNCH_LAST_CALL_KEY}={spec.restart.launch_wait_s},"
        f"keep_alive_interval={spec.restart.keep_alive_s},keep_alive_max_attempt={spec.restart.keep_alive_misses}",
        # The address this node's peers reach it at: the rank-0 node's becomes the workers'
        # MASTER_ADDR (by default its host name, which a netns node shares with the host).
        f"--local-addr={local_addr}",
        f"--max-restarts={spec.max_restarts}",
        f"--monitor-interval={_MONITOR_S}",
        # forkserver: trainer.agent forks the workers from a process that imported the trainer (warm).
        f"--start-method={'forkserver' if spec.restart.warm else 'spawn'}",
        # SIGTERM to the agent (a preemption notice) reaches the workers, which save an emergency
        # checkpoint; they are SIGKILLed only after the grace period.
        f"--shutdown-timeout={spec.preemption.grace_s}",
        "-m", "trainer.train",
        "--spec", str(spec_path),
        "--store", store_uri,
        "--run-id", spec.name,
        "--workdir", str(workdir),
        *trainer_args,
    ]  # fmt: skip


def passed_environment(spec: RunSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """What of ``environ`` (the operator's) the run's agents get: the allowlist, and the names the
    run.yaml's ``env:`` lists (each must be set: ``UsageError`` naming the first that is not)."""
    missing = [name for name in spec.env if name not in environ]
    if missing:
        raise UsageError(
            f"{missing[0]} is not set in this environment; the run.yaml's env: passes it to the trainers", field="env"
        )
    return {name: environ[name] for name in sorted(_PASSED | set(spec.env)) if name in environ}


def _node_env(
    nodes: NodeControl,
    node: Node,
    spec: RunSpec,
    attempt: int,
    log_format: LogFormat,
    *,
    cluster: ClusterRecord,
    key_file: Path | None,
) -> dict[str, str]:
    run_id, home = spec.name, node.workdir
    env = passed_environment(spec, os.environ) | nodes.network_env(node.name) | nodes.agent_env(node.name)
    env.setdefault("OMP_NUM_THREADS", "1")
    if cluster.image:  # the reference the node's engine runs, pinned by digest
        env[proc.IMAGE_ENV] = cluster.image
    if key_file is not None:
        env[RUN_KEY_FILE_ENV] = str(key_file)
        env[MAX_BYTES_ENV] = str(16 * parameters(spec.model) + _REPLICA_SLACK_BYTES)
    if spec.rehearsal:  # the drills' hooks its env: passes may act there (trainer/faults.py)
        env[REHEARSAL_ENV] = "1"
    env.update(
        {
            # The agent runs torchrun's file-timer watchdog: a worker whose step deadline
            # (watchdog.step_timeout_s, armed by the trainer) passes is SIGKILLed, and the agent
            # handles it as any other worker failure. The named pipe is per node and run.
            "TORCHELASTIC_ENABLE_FILE_TIMER": "1",
            "TORCHELASTIC_TIMER_FILE": str(workdir.timer_file(home, run_id)),
            # torchrun shares its rendezvous TCP store with the workers by default, and then the
            # rank-0 agent publishes the workers' MASTER_ADDR only in its first round: a node that
            # joins later (`infractl rejoin`) waits for it forever. Without sharing, every round
            # publishes a fresh address and the workers' rank 0 hosts their store.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "PYTHONUNBUFFERED": "1",
            "INFRACTL_ATTEMPT": str(attempt),
            LOG_FORMAT_ENV: log_format,
            proc.CLUSTER_ENV: str(nodes.state.dir),
            proc.NODE_ENV: node.name,
            proc.RUN_ENV: run_id,
        }
    )
    return env


def _key_path(state: ClusterState, run_id: str) -> Path:
    """The run's replica key on this machine, kept for the attempt's rejoins (0600)."""
    return state.dir / "runs" / f"{run_id}.key"


def _read_key(state: ClusterState, run_id: str) -> str | None:
    """The key of the run's current attempt; None for a run launched before infractl made one
    (its rejoined node then holds no replicas, and the job none: it resumes from the store)."""
    try:
        return _key_path(state, run_id).read_text().strip()
    except FileNotFoundError:
        return None


def launch(
    state: ClusterState, spec: RunSpec, plan: LaunchPlan, *, log_format: LogFormat, trainer_args: Sequence[str] = ()
) -> Launch:
    """Record the attempt in the store, then start one torchrun agent per node. ``trainer_args``
    go to every rank's ``trainer.train`` (``plan --measure`` asks it for a memory probe)."""
    keep_rendezvous(state, plan.cluster)
    number = len(plan.record.attempts) + 1
    # Unique per launch: the rendezvous server outlives runs, and a closed rendezvous id (an
    # earlier run of the same name, say before `--new`) can never be joined again.
    rdzv_id = f"{spec.name}-{number}-{secrets.token_hex(4)}"
    plan.record.spec = spec.model_dump(mode="json")
    plan.record.cluster_id = plan.cluster.id  # `teardown --purge` deletes the runs of this id
    plan.record.attempts.append(
        Attempt(
            attempt=number,
            started=time.time(),
            resume_from=plan.resume_from,
            nodes=[n.name for n in plan.nodes],
            rdzv_id=rdzv_id,
        )
    )
    runstore.write_run_record(plan.store, plan.record)
    # The secret every replica request of this attempt is signed with (trainer/replica_server.py):
    # new for each launch, kept here for the attempt's rejoins, on the nodes in a root-only file.
    key = secrets.token_hex(32)
    write_private(_key_path(state, spec.name), key + "\n")
    nodes = providers.control(state)
    by_name = {node.name: node for node in plan.nodes}

    def start(name: str) -> subprocess.Popen[bytes]:
        return _start_agent(
            nodes,
            spec,
            by_name[name],
            cluster=plan.cluster,
            store=plan.store,
            attempt=number,
            nnodes=len(plan.nodes),
            rdzv_id=rdzv_id,
            key=key,
            log_format=log_format,
            trainer_args=trainer_args,
        )

    # Every node's agent at once: each start may wait on its node (an SSH session).
    agents = dict(zip(by_name, nodes.each(by_name, start), strict=True))
    return Launch(spec.name, number, plan.resume_from, plan.nodes, agents, nodes)


def finish(plan: LaunchPlan, spec: RunSpec, started: Launch, exit_codes: dict[str, int]) -> Attempt:
    """Record how the attempt a foreground ``train`` followed ended (every agent has exited), once
    what the agents started for themselves (the fork server, the resource tracker) has gone too:
    they notice their agent's exit a moment later, and until then the run counts as running."""
    started.control.wait_gone(timeout=_HELPERS_GONE_S, run=spec.name)
    attempt = plan.record.attempts[-1]
    attempt.ended = time.time()
    attempt.exit_codes = exit_codes
    attempt.last_committed_step = runstore.latest_committed_step(plan.store, spec.name) or 0
    attempt.outcome = "completed" if attempt.last_committed_step >= spec.steps else "failed"
    runstore.write_run_record(plan.store, plan.record)
    return attempt


def run_to_end(
    state: ClusterState,
    spec: RunSpec,
    run_file: Path,
    *,
    command: str,
    log_format: LogFormat,
    trainer_args: Sequence[str] = (),
    poll_s: float = 1.0,
    watch: Callable[[Launch], None] | None = None,
) -> Attempt:
    """Start ``spec`` over (whatever the store holds for it is deleted), wait until every agent
    has exited, and record how the attempt ended: the runs `plan --measure` and `bench` make
    from a run.yaml, which nobody follows on a progress bar. Holds the cluster lock throughout,
    in the name of ``command`` (what a refused `infractl` command is told is busy). ``watch``
    is called with the launch at every poll while the agents run (`bench` samples their CPU)."""
    with state.lock(command):
        plan = prepare(state, spec, run_file, new=True)
        if plan.replaces:
            plan.store.delete_prefix(runstore.run_prefix(spec.name))
        started = launch(state, spec, plan, log_format=log_format, trainer_args=trainer_args)
        exit_codes: dict[str, int] = {}
        while len(exit_codes) < len(started.agents):
            time.sleep(poll_s)
            if watch is not None:
                watch(started)
            for name, agent in started.agents.items():
                if name not in exit_codes and (rc := agent.poll()) is not None:
                    exit_codes[name] = rc
        return finish(plan, spec, started, exit_codes)


def _start_agent(
    nodes: NodeControl,
    spec: RunSpec,
    node: Node,
    *,
    cluster: ClusterRecord,
    store: Store,
    attempt: int,
    nnodes: int,
    rdzv_id: str,
    key: str | None,
    log_format: LogFormat,
    note: str = "",
    trainer_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    name = node.name
    home = node.workdir
    private = workdir.run_private(home, spec.name)
    # The image a cluster pulled and verified at `up` (None: the trainer is the node's own Python,
    # as root). In a container the trainer is the image's user, which cannot enter the root-only
    # folder its spec and key lie in: each is mounted alone in the container, at ``IMAGE_RUN_DIR``.
    image = cluster.image
    handed = {private / "spec.json": spec.model_dump_json(indent=1)}
    if key is not None:
        handed[private / "run.key"] = key + "\n"
    for path, text in handed.items():
        nodes.write_file(name, path, text)
    inside = {path: IMAGE_RUN_DIR / path.name if image else path for path in handed}
    spec_path, key_file = inside[private / "spec.json"], inside.get(private / "run.key")
    argv = torchrun_argv(
        spec,
        python=IMAGE_PYTHON if image else nodes.python(name),
        nnodes=nnodes,
        processes=node.processes,
        rendezvous=f"{cluster.rendezvous.host}:{cluster.rendezvous.port}",
        rdzv_id=rdzv_id,
        local_addr=node.address,
        spec_path=spec_path,
        store_uri=store.uri,
        workdir=home / workdir.WORK,
        trainer_args=trainer_args,
    )
    return nodes.start(
        name,
        argv,
        _node_env(nodes, node, spec, attempt, log_format, cluster=cluster, key_file=key_file),
        workdir=home,
        log_path=workdir.run_log(node.workdir, spec.name),
        header=f"=== infractl: attempt {attempt} of run {spec.name} on {name}{note} ===",
        image=image,
        mounts=_mounts(spec, store),
        files=inside if image else None,
    )


def _mounts(spec: RunSpec, store: Store) -> list[Path]:
    """The folders of a node beside its work directory that a containerized trainer reads or
    writes: a ``file://`` store, a prepared dataset."""
    root = store.local_path("")  # the store's folder, for a backend that keeps files on the node
    found = [root] if root is not None else []
    if spec.data.path is not None and Path(spec.data.path).is_absolute():
        found.append(Path(spec.data.path))
    return found


@dataclass(frozen=True)
class Rejoined:
    run_id: str
    node: str
    attempt: int
    pid: int
    rejoins: int  # times this node has rejoined this attempt, this one included
    budget: int


def rejoin(
    state: ClusterState, node_name: str, *, run: str | None = None, log_format: LogFormat = "console"
) -> Rejoined:
    """Start the agent of a node that left a running run, so it joins at the next rendezvous.

    The running agents see a node waiting and restart their workers on the larger world (no
    restart budget spent); the run resumes there from its last committed checkpoint. Each
    rejoin is recorded in the run record in the store, and a node may rejoin an attempt at
    most ``max_restarts`` times: a flapping node cannot loop forever.
    """
    cluster = state.record()
    node = runs.node(state, node_name, field="NODE")
    run, live = runs.running_run(state, run)
    if node_name in live:
        raise UsageError(f"node {node_name!r} is already running run {run!r}", field="NODE")
    store = for_cluster(state)
    record = runstore.read_run_record(store, run)
    attempt = record.last_attempt if record is not None else None
    if record is None or attempt is None or record.spec is None:
        raise StateError(f"run {run!r} has no run.json with its spec and attempts in the store")
    spec = RunSpec.model_validate(record.spec)
    if len(live) >= spec.nodes.max:
        raise UsageError(f"run {run!r} already runs on nodes.max ({spec.nodes.max}) node(s): {', '.join(sorted(live))}")
    done = attempt.rejoins_of(node_name)
    if done >= spec.max_restarts:
        raise StateError(
            f"node {node_name!r} has already rejoined attempt {attempt.attempt} of run {run!r} {done} time(s) "
            f"(max_restarts: {spec.max_restarts}); find out why it keeps failing (`infractl logs --node {node_name}`)"
        )
    agent = _start_agent(
        providers.control(state),
        spec,
        node,
        cluster=cluster,
        store=store,
        attempt=attempt.attempt,
        nnodes=len(attempt.nodes),
        rdzv_id=attempt.rdzv_id,
        key=_read_key(state, run),
        log_format=log_format,
        note=" (rejoined)",
    )
    attempt.rejoins.append(Rejoin(node=node_name, time=time.time(), pid=agent.pid))
    runstore.write_run_record(store, record)
    return Rejoined(
        run_id=run, node=node_name, attempt=attempt.attempt, pid=agent.pid, rejoins=done + 1, budget=spec.max_restarts
    )


@dataclass(frozen=True)
class Stopped:
    run_id: str
    nodes: list[str]
    killed: int  # processes SIGKILLed: all of them without a save, else those that outlived the grace period
    last_committed_step: int | None


def stop(state: ClusterState, *, run: str | None = None, save: bool = True) -> Stopped:
    """Stop a running run on every node. ``save``: as a preemption would, SIGTERM to each agent,
    whose workers save the step they are on and exit within ``preemption.grace_s`` (whatever is
    left after that is SIGKILLed). Else every process of the run is SIGKILLed at once, and the
    run's newest commit stays its newest (a rollback wants no newer one). ``infractl train`` of
    the same run.yaml resumes it."""
    run, live = runs.running_run(state, run)
    store = for_cluster(state)
    control = providers.control(state)
    left = control.processes(run=run)
    if save:
        record = runstore.read_run_record(store, run)
        preemption = RunSpec.model_validate(record.spec).preemption if record and record.spec else PreemptionSpec()
        grace_s = preemption.grace_s
        control.signal([p for p in left if p.agent], signal.SIGTERM)
        # The agents' own shutdown is the grace period; their exit and the save's commit get a little more.
        left = control.wait_gone(timeout=grace_s + 15, run=run)
    killed = 0
    if left:
        killed, alive = control.stop_all(timeout=30, run=run)
        if alive:
            raise StateError(f"run {run!r}: {len(alive)} process(es) survived SIGKILL on {alive[0].node}")
    return Stopped(
        run_id=run,
        nodes=sorted(live),
        killed=killed,
        last_committed_step=runstore.latest_committed_step(store, run),
    )
