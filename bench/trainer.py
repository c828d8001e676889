"""Trainer benchmark: ours against a plain baseline, side by side in one run, reported as ratios.

(a) step time: the infractl trainer, at its defaults (in-memory replicas every
    checkpoint.replicate_every steps, when that many steps fit the measured ones), without
    replicas, with a replica every quarter of the measured steps (a replica's cost, then spread
    over the default interval: the ratio at the default), and at log_every 1 (a read back
    every step), vs a plain torchrun DDP loop doing the same math (bench/plain_ddp.py), over the
    same steps after warm-up; each measured --repeats times, interleaved, medians compared. On
    CUDA it also prints MFU. The trainer's tensor-parallel (``parallel: {tp: 2}``) and pipeline
    (``parallel: {pp: 2}``: 1f1b, 2 micro-batches) layouts of the same model and batch on the
    same ranks are measured in the same rounds, against its ddp (on an even number of ranks);
(b) training-blocking seconds per checkpoint: asynchronous save vs synchronous save (save + wait)
    with the trainer's Checkpointer on the same model and optimizer state;
(c) upload throughput to an S3 API server (moto's, on loopback): the store's ``put_file`` vs a
    plain boto3 ``upload_file`` of the same bytes.

    python bench/trainer.py [--quick] [--repeats 3] [--json results.json]
    python bench/trainer.py --world 8 --model 12x768 --seq-len 1024 --bf16 --only-step-time   # GPUs

Numbers depend on the machine; the ratios are what to compare. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# One torchrun of the benchmark; a run that takes longer is stuck (the full step-time run takes ~30 s).
_RUN_TIMEOUT_S = 600
# Run as a script, this folder comes first on the path, and this file would be the `trainer` package
# that infractl imports: the checkout comes first instead.
sys.path[0:1] = [str(REPO), str(REPO / "tests")]  # the tests' folder: the S3 server launcher they use

import psutil  # noqa: E402
import torch  # noqa: E402

from infractl import runstore  # noqa: E402
from infractl.config import CheckpointSpec, DataSpec, ModelSpec, RunSpec  # noqa: E402
from infractl.store import open_store  # noqa: E402

from s3server import AWS_TEST_ENV, moto_server  # noqa: E402


def torchrun(args: list[str], *, cwd: Path, world: int, agent: str = "torch.distributed.run") -> str:
    """Run one standalone torchrun of WORLD ranks from CWD; its stdout. Exits the benchmark when it
    fails or hangs (bench/planner_vs_peers.py runs its probes through it too). ``agent``: the
    trainer's own (``trainer.agent``, which holds the in-memory replicas) or torch's."""
    # Workers run as modules (-m bench.x) from a scratch cwd: run as scripts, bench/ would come
    # first on sys.path and this file would shadow the trainer package.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", agent, "--standalone", f"--nproc-per-node={world}", *args]
    agent = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = agent.communicate(timeout=_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # torchrun's workers outlive a killed agent (they run in their own sessions): kill the tree.
        for p in [*psutil.Process(agent.pid).children(recursive=True), psutil.Process(agent.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        agent.communicate()
        raise SystemExit(f"{' '.join(cmd)} did not finish within {_RUN_TIMEOUT_S}s") from None
    if agent.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    return stdout


def _ours(tmp: Path, spec: RunSpec, window: tuple[int, int], *, world: int, tag: str) -> float:
    """Seconds per step of the infractl trainer between the steps after the two window steps:
    the window steps are log steps, where the trainer reads back from the device, so on a GPU
    the next step starts once the device is done with them (the host clock is then the truth)."""
    run_dir = tmp / tag
    run_dir.mkdir()
    (run_dir / "store").mkdir()
    spec_path = run_dir / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    store_uri = (run_dir / "store").as_uri()
    torchrun(
        ["-m", "trainer.train", "--spec", str(spec_path), "--store", store_uri, "--run-id", "bench",
         "--workdir", str(run_dir / "work")],
        cwd=run_dir,
        world=world,
        agent="trainer.agent",
    )  # fmt: skip
    ended = {r["step"]: r["time"] for r in runstore.read_metrics(open_store(store_uri), "bench")}
    first, last = window
    return (ended[last + 1] - ended[first + 1]) / (last - first)


def _plain(tmp: Path, spec: RunSpec, window: tuple[int, int], *, world: int) -> float:
    run_dir = tmp / "plain"
    run_dir.mkdir(exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    out = torchrun(
        ["-m", "bench.plain_ddp", "--spec", str(spec_path), "--window", str(window[0]), str(window[1])],
        cwd=run_dir,
        world=world,
    )
    return float(json.loads(out.strip().splitlines()[-1])["step_s"])


def step_time(
    tmp: Path,
    *,
    model: ModelSpec,
    batch_size: int,
    steps: int,
    world: int,
    precision: str,
    repeats: int,
) -> dict[str, Any]:
    """(a): seconds per step of the trainer at the default log_every and at log_every 1 (a
    read back every step), of the plain loop, and of the trainer with each copy of the model
    split over two ranks (tensor, then pipeline parallel), on the same steps of the same run;
    each measured ``repeats`` times, interleaved, and the medians compared."""
    spec = RunSpec(
        name="bench",
        model=model,
        data=DataSpec(max_bytes=1_000_000),
        batch_size=batch_size,
        steps=steps,
        checkpoint=CheckpointSpec(every=steps),
        mixed_precision=precision,
        nodes={"min": 1, "max": 1},
    )
    every_step = spec.model_copy(update={"log_every": 1})
    no_replicas = RunSpec.model_validate(spec.model_dump() | {"checkpoint": {"every": steps, "replicate_every": 0}})
    # From the first log step after warm-up to the last log step before the final one.
    window = (spec.log_every, (steps - 1) // spec.log_every * spec.log_every)
    # The default interval may exceed the measured steps: a replica's cost is measured with four
    # of them in the window, then spread over the default interval.
    dense = max(1, (window[1] - window[0]) // 4)
    replicated = RunSpec.model_validate(spec.model_dump() | {"checkpoint": {"every": steps, "replicate_every": dense}})
    # Degree 2 (data parallel over the other ranks): a world of odd size has no such layout.
    layouts = {
        name: RunSpec.model_validate(spec.model_dump() | {"parallel": {name: 2}})
        for name in ("tp", "pp")
        if world % 2 == 0
    }
    ours, ours_every_step, ours_no_replicas, ours_replicated, plain = [], [], [], [], []
    split: dict[str, list[float]] = {name: [] for name in layouts}
    for i in range(repeats):
        plain.append(_plain(tmp, spec, window, world=world))
        ours.append(_ours(tmp, spec, window, world=world, tag=f"ours-{i}"))
        ours_every_step.append(_ours(tmp, every_step, window, world=world, tag=f"ours-every-step-{i}"))
        ours_no_replicas.append(_ours(tmp, no_replicas, window, world=world, tag=f"ours-no-replicas-{i}"))
        ours_replicated.append(_ours(tmp, replicated, window, world=world, tag=f"ours-replicated-{i}"))
        for name, layout in layouts.items():
            split[name].append(_ours(tmp, layout, window, world=world, tag=f"ours-{name}-{i}"))
    ours_s, every_s, bare_s, replicated_s, plain_s = (
        statistics.median(x) for x in (ours, ours_every_step, ours_no_replicas, ours_replicated, plain)
    )
    replica_s = max(0.0, replicated_s - bare_s) * dense
    default = spec.checkpoint.replicate_every
    split_s = {name: statistics.median(runs) for name, runs in split.items()}
    tokens = batch_size * model.seq_len
    return {
        "ours_step_s": ours_s,
        "ours_every_step_s": every_s,
        "plain_step_s": plain_s,
        "ratio": ours_s / plain_s,
        "ratio_every_step": every_s / plain_s,
        "ours_no_replicas_step_s": bare_s,
        "ratio_no_replicas": bare_s / plain_s,
        "replicate_every": default,
        "replicas_in_window": (window[1] - window[0]) // default if default else 0,
        "ours_replicated_step_s": replicated_s,
        "replicated_every": dense,
        "replica_s": replica_s,
        "ratio_replicas_at_default": (bare_s + (replica_s / default if default else 0.0)) / plain_s,
        **{f"{name}_step_s": seconds for name, seconds in split_s.items()},
        **{f"ratio_{name}": seconds / ours_s for name, seconds in split_s.items()},
        "runs": {
            "ours": ours,
            "ours_every_step": ours_every_step,
            "ours_no_replicas": ours_no_replicas,
            "ours_replicated": ours_replicated,
            "plain": plain,
        }
        | split,
        "log_every": spec.log_every,
        "tokens_per_s": tokens / ours_s,
        "model": model.model_dump(),
        "batch_size": batch_size,
        "mixed_precision": precision,
        "world_size": world,
        "steps_measured": window[1] - window[0],
        "repeats": repeats,
    }


def checkpoint_blocking(tmp: Path, *, layers: int, hidden: int, saves: int, world: int) -> dict[str, Any]:
    (tmp / "ckpt-store").mkdir()  # a file:// store is a directory that must exist, as a bucket must
    out = torchrun(
        [
            "-m",
            "bench.checkpoint_worker",
            f"--layers={layers}",
            f"--hidden={hidden}",
            f"--saves={saves}",
            "--store",
            (tmp / "ckpt-store").as_uri(),
            "--workdir",
            str(tmp / "ckpt-work"),
        ],
        cwd=tmp,
        world=world,
    )
    result = json.loads(out.strip().splitlines()[-1])
    # The first async save has no earlier save to wait for; later ones may (at most one in flight).
    async_s = statistics.median(result["blocked_s"]["async"])
    sync_s = statistics.median(result["blocked_s"]["sync"])
    return {
        "async_blocked_s": async_s,
        "sync_blocked_s": sync_s,
        "ratio_sync_over_async": sync_s / async_s,
        "params": result["params"],
        "saves": saves,
    }


def upload_throughput(tmp: Path, *, mib: int, repeats: int) -> dict[str, Any]:
    import boto3
    from botocore.config import Config

    os.environ.update(AWS_TEST_ENV)
    payload = tmp / "payload.bin"
    payload.write_bytes(os.urandom(mib << 20))
    with moto_server(tmp / "moto.log") as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        store = open_store(f"s3://{bucket}/ours?endpoint_url={endpoint}")
        ours, plain = [], []
        for i in range(repeats):  # interleaved, so drift on the machine hits both alike
            started = time.perf_counter()
            store.put_file(f"obj-{i}", payload)
            ours.append(time.perf_counter() - started)
            started = time.perf_counter()
            client.upload_file(str(payload), bucket, f"plain/obj-{i}")
            plain.append(time.perf_counter() - started)
    ours_mbs, plain_mbs = mib / statistics.median(ours), mib / statistics.median(plain)
    return {
        "ours_mib_s": ours_mbs,
        "plain_mib_s": plain_mbs,
        "ratio": ours_mbs / plain_mbs,
        "mib": mib,
        "repeats": repeats,
    }


# Peak dense bf16 tensor FLOP/s per device (the vendors' datasheets, without sparsity): MFU's
# denominator. Matched against torch.cuda.get_device_name() by substring, first match wins.
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
]


def model_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward) plus the attention
    scores and values, 12 x layers x hidden x seq_len (PaLM's accounting)."""
    from trainer.model import GPT, GPTConfig

    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(GPTConfig.from_spec(model)).parameters())
    return 6.0 * params + 12.0 * model.layers * model.hidden * model.seq_len


def mfu(step: dict[str, Any]) -> dict[str, Any] | None:
    """Model FLOPs utilization of the measured step time, on a known CUDA device (else None)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    peak = next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)
    if peak is None:
        return {"device": name, "mfu": None}
    achieved = model_flops_per_token(ModelSpec(**step["model"])) * step["tokens_per_s"] / step["world_size"]
    return {"device": name, "peak_bf16_flops": peak, "achieved_flops_per_device": achieved, "mfu": achieved / peak}


def _model(text: str) -> tuple[int, int]:
    layers, _, hidden = text.partition("x")
    return int(layers), int(hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smaller model, fewer steps, one repeat (a smoke test).")
    parser.add_argument("--world", type=int, default=2, help="Ranks (on a GPU machine: one per GPU).")
    parser.add_argument("--model", type=_model, help="LAYERSxHIDDEN of the step-time model (default 4x256).")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="Global batch.")
    parser.add_argument("--bf16", action="store_true", help="Mixed precision bf16 (on GPUs).")
    parser.add_argument("--repeats", type=int, help="Step-time measurements of each, interleaved (default 3).")
    parser.add_argument("--only-step-time", action="store_true", help="Skip (b) and (c).")
    parser.add_argument("--json", type=Path, help="Also write the results to this file.")
    args = parser.parse_args()
    layers, hidden = args.model or ((2, 128) if args.quick else (4, 256))
    model = ModelSpec(layers=layers, hidden=hidden, heads=4, seq_len=args.seq_len)
    with tempfile.TemporaryDirectory(prefix="infractl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        results: dict[str, Any] = {
            "step_time": step_time(
                tmp,
                model=model,
                batch_size=args.batch_size,
                # --quick: the fewest steps with a window (the run's first log steps, 10 and 20) and
                # the step after it, whose end closes the window.
                steps=21 if args.quick else 60,
                world=args.world,
                precision="bf16" if args.bf16 else "fp32",
                repeats=args.repeats or (1 if args.quick else 3),
            )
        }
        results["step_time"]["mfu"] = mfu(results["step_time"])
        if not args.only_step_time:
            # --quick: two saves each way, so that an async save still meets one in flight.
            results["checkpoint"] = checkpoint_blocking(
                tmp, layers=layers * 2, hidden=hidden * 2, saves=2 if args.quick else 5, world=args.world
            )
            # --quick: 16 MiB still goes multipart through boto3 (above its 8 MiB threshold).
            results["upload"] = upload_throughput(tmp, mib=16 if args.quick else 128, repeats=2 if args.quick else 3)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def report(results: dict[str, Any]) -> None:
    st = results["step_time"]
    print(
        f"(a) step time, {st['world_size']} rank(s), {st['model']}, batch {st['batch_size']}, {st['mixed_precision']}, "
        f"median of {st['repeats']}: infractl {st['ours_step_s'] * 1e3:.1f} ms (log_every {st['log_every']}), "
        f"{st['ours_every_step_s'] * 1e3:.1f} ms (log_every 1) vs plain DDP {st['plain_step_s'] * 1e3:.1f} ms "
        f"-> ratio {st['ratio']:.3f} (log_every 1: {st['ratio_every_step']:.3f}; 1.00 = no overhead); "
        f"{st['tokens_per_s']:,.0f} tokens/s"
    )
    print(
        f"    in-memory replicas at their default, every {st['replicate_every']} steps ({st['replicas_in_window']} in "
        f"the {st['steps_measured']} steps measured); without them {st['ours_no_replicas_step_s'] * 1e3:.1f} ms "
        f"-> ratio {st['ratio_no_replicas']:.3f}"
    )
    print(
        f"    replicas every {st['replicated_every']} steps: {st['ours_replicated_step_s'] * 1e3:.1f} ms, "
        f"{st['replica_s'] * 1e3:.0f} ms per replica; spread over the default interval -> ratio "
        f"{st['ratio_replicas_at_default']:.3f} (without replicas, plus one per {st['replicate_every']} steps)"
    )
    if "tp_step_s" in st:
        print(
            f"    same model and batch, split over ranks: tensor parallel (tp 2) {st['tp_step_s'] * 1e3:.1f} ms, "
            f"pipeline (pp 2, 1f1b) {st['pp_step_s'] * 1e3:.1f} ms vs infractl ddp {st['ours_step_s'] * 1e3:.1f} ms "
            f"-> ratios {st['ratio_tp']:.2f} and {st['ratio_pp']:.2f} (1.00 = as fast as ddp)"
        )
    if st["mfu"] is not None:
        m = st["mfu"]
        print(f"    on {m['device']}: MFU {m['mfu']:.1%}" if m["mfu"] is not None else f"    on {m['device']}: MFU -")
    if "checkpoint" in results:
        ck = results["checkpoint"]
        print(
            f"(b) training blocked per checkpoint ({ck['params']:,} params + AdamW state): async "
            f"{ck['async_blocked_s'] * 1e3:.0f} ms vs sync {ck['sync_blocked_s'] * 1e3:.0f} ms -> sync/async "
            f"{ck['ratio_sync_over_async']:.1f}x"
        )
    if "upload" in results:
        up = results["upload"]
        print(
            f"(c) upload of {up['mib']} MiB to the S3 server: store.put_file {up['ours_mib_s']:.0f} MiB/s vs boto3 "
            f"upload_file {up['plain_mib_s']:.0f} MiB/s -> ratio {up['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
