"""The store's layout and its typed records: the one place that knows where a run's objects
live and what they hold (the CLI, the trainer, drills, and the handover bundle and outside tools
read the store through this package). Rooms: ``records`` (the typed records), ``layout`` (keys,
and reading and writing records), ``commit`` (the checkpoint commit protocol).

Layout (``<store>/runs/<run-id>/``)::

    run.json                          RunRecord: resolved spec, cluster, dataset version, attempts
                                      (each with its nodes, rejoins and outcome); the launcher writes it
    metrics/<first-step>-<ns>.jsonl   StepRecord lines, one object per chunk (object stores cannot
                                      append); a step written again after a resume: the newest counts
    tensorboard/...                   TensorBoard event files, uploaded whole
    ckpt/step-<N>/...                 DCP shards and .metadata
    ckpt/step-<N>/MANIFEST.json       Manifest: every key with size and sha256, step, world size, and
                                      extra (the SaveReason, tokens seen, config hash, dataset version,
                                      environment fingerprint, save timings)
    ckpt/step-<N>/COMMITTED           written last and create-only
    rolled-back/<UTC time>/step-<N>/  steps `infractl rollback` moved out of ckpt/, whole, kept
    drills/<drill-id>.json            DrillRecord: one fault drill and its measured recovery
    chaos/<series-id>.json            ChaosRecord: a seeded series of random faults (its drills are
                                      in drills/) and the finished run against a reference run
    profiles/request.json             ProfileRequest: `infractl profile` asks every rank to trace steps
    profiles/<first>-<last>/rank-<r>.pt.trace.json.gz
                                      rank r's torch.profiler trace of those steps (gzipped Chrome
                                      trace JSON; each folder is a run for TensorBoard's profiler plugin)

Besides the runs (``<store>/``)::

    plan/<run-id>/measured.json       `infractl plan --measure`: the prediction beside what a probe
                                      run of the run.yaml measured (infractl/planning/probe.py)
    bench/<bench-id>/baseline.json    `infractl bench`: the scaling baseline (infractl/scaling/bench.py)
    bench/<bench-id>/*.png            its plots: throughput and efficiency, the step-time split

A probe run (``runs/<run-id>/memory/rank-<r>.json``, each rank's measured memory) is deleted once
`plan --measure` has read it.

Two more top-level prefixes belong to the team rather than to a command: ``datasets/`` and
``configs/``, where config-admins keep shared datasets and run configs. Nothing in infractl writes
them; the access roles (infractl/access/) grant them, so they are part of the layout.
``PREFIXES`` names every top-level prefix.

A checkpoint exists only once COMMITTED exists (``commit``).
"""

from __future__ import annotations

from infractl.runstore.commit import (
    CheckpointError,
    commit_checkpoint,
    committed_steps,
    fetch_checkpoint_file,
    fetch_verified,
    file_sha256,
    latest_committed_step,
    prune_checkpoints,
    read_manifest,
    set_aside,
    step_objects,
    verify_checkpoint,
)
from infractl.runstore.keys import (
    PREFIXES,
    MetricsTail,
    bench_prefix,
    chaos_key,
    checkpoint_prefix,
    drill_key,
    export_record_key,
    latest_metrics,
    list_runs,
    memory_report_key,
    plan_measured_key,
    profile_prefix,
    profile_trace_key,
    profile_traces,
    read_chaos_records,
    read_drill_records,
    read_export_records,
    read_metrics,
    read_profile_request,
    read_run_record,
    run_prefix,
    write_chaos_record,
    write_drill_record,
    write_metrics,
    write_profile_request,
    write_run_record,
)
from infractl.runstore.records import (
    Attempt,
    ChaosRecord,
    DrillRecord,
    Manifest,
    ManifestEntry,
    ProfileRequest,
    Rejoin,
    RunRecord,
    SaveReason,
    StepRecord,
    starts_a_process,
)

__all__ = [
    "Attempt",
    "ChaosRecord",
    "CheckpointError",
    "DrillRecord",
    "Manifest",
    "ManifestEntry",
    "MetricsTail",
    "PREFIXES",
    "ProfileRequest",
    "Rejoin",
    "RunRecord",
    "SaveReason",
    "StepRecord",
    "bench_prefix",
    "chaos_key",
    "checkpoint_prefix",
    "commit_checkpoint",
    "committed_steps",
    "drill_key",
    "export_record_key",
    "fetch_checkpoint_file",
    "fetch_verified",
    "file_sha256",
    "latest_committed_step",
    "latest_metrics",
    "list_runs",
    "memory_report_key",
    "plan_measured_key",
    "profile_prefix",
    "profile_trace_key",
    "profile_traces",
    "prune_checkpoints",
    "read_chaos_records",
    "read_drill_records",
    "read_export_records",
    "read_manifest",
    "read_metrics",
    "read_profile_request",
    "read_run_record",
    "run_prefix",
    "set_aside",
    "starts_a_process",
    "step_objects",
    "verify_checkpoint",
    "write_chaos_record",
    "write_drill_record",
    "write_metrics",
    "write_profile_request",
    "write_run_record",
]
