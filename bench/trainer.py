"""Trainer benchmark: ours against a plain baseline, side by side in one run, reported as ratios.

(a) step time: the infractl trainer vs a plain torchrun DDP loop (bench/plain_ddp.py) on the same
    model, global batch and world size (median over the steps after warm-up);
(b) training-blocking seconds per checkpoint: asynchronous save vs synchronous save (save + wait)
    with the trainer's Checkpointer on the same model and optimizer state;
(c) upload throughput to an S3 API server (moto's, on loopback): the store's ``put_file`` vs a
    plain boto3 ``upload_file`` of the same bytes.

    python bench/trainer.py [--quick] [--json results.json]

Numbers depend on the machine; the ratios are what to compare. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(REPO / "tests"))  # the S3 server launcher the tests use

from infractl import runstore  # noqa: E402
from infractl.config import CheckpointSpec, DataSpec, ModelSpec, RunSpec  # noqa: E402
from infractl.store import open_store  # noqa: E402

from s3server import AWS_TEST_ENV, moto_server  # noqa: E402

WORLD = 2
WARMUP_STEPS = 5


def _torchrun(args: list[str], *, cwd: Path) -> str:
    # Workers run as modules (-m bench.x) from a scratch cwd: run as scripts, bench/ would come
    # first on sys.path and this file would shadow the trainer package.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def step_time(tmp: Path, *, layers: int, hidden: int, steps: int) -> dict[str, Any]:
    model = ModelSpec(layers=layers, hidden=hidden, heads=4, seq_len=128)
    spec = RunSpec(
        name="bench",
        model=model,
        data=DataSpec(max_bytes=1_000_000),
        batch_size=16,
        steps=steps,
        checkpoint=CheckpointSpec(every=steps),
        nodes={"min": 1, "max": 1},
    )
    spec_path = tmp / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    (tmp / "store").mkdir()
    store_uri = (tmp / "store").as_uri()
    _torchrun(
        [
            "-m",
            "trainer.train",
            "--spec",
            str(spec_path),
            "--store",
            store_uri,
            "--run-id",
            "bench",
            "--workdir",
            str(tmp / "work"),
        ],
        cwd=tmp,
    )
    ours = [r["step_time_s"] for r in runstore.read_metrics(open_store(store_uri), "bench")][WARMUP_STEPS:]
    plain_out = _torchrun(
        [
            "-m",
            "bench.plain_ddp",
            f"--layers={layers}",
            f"--hidden={hidden}",
            "--heads=4",
            "--seq-len=128",
            "--batch-size=16",
            f"--steps={steps}",
        ],
        cwd=tmp,
    )
    plain = json.loads(plain_out.strip().splitlines()[-1])["step_times"][WARMUP_STEPS:]
    ours_s, plain_s = statistics.median(ours), statistics.median(plain)
    return {
        "ours_step_s": ours_s,
        "plain_step_s": plain_s,
        "ratio": ours_s / plain_s,
        "model": model.model_dump(),
        "batch_size": 16,
        "world_size": WORLD,
        "steps_measured": len(ours),
    }


def checkpoint_blocking(tmp: Path, *, layers: int, hidden: int, saves: int) -> dict[str, Any]:
    out = _torchrun(
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smaller model and fewer repeats (about a minute).")
    parser.add_argument("--json", type=Path, help="Also write the results to this file.")
    args = parser.parse_args()
    size = {"layers": 2, "hidden": 128} if args.quick else {"layers": 4, "hidden": 256}
    with tempfile.TemporaryDirectory(prefix="infractl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        results = {
            "step_time": step_time(tmp, **size, steps=25 if args.quick else 60),
            "checkpoint": checkpoint_blocking(
                tmp, layers=size["layers"] * 2, hidden=size["hidden"] * 2, saves=3 if args.quick else 5
            ),
            "upload": upload_throughput(tmp, mib=32 if args.quick else 128, repeats=2 if args.quick else 3),
        }
    st, ck, up = results["step_time"], results["checkpoint"], results["upload"]
    print(
        f"(a) step time, {WORLD} ranks, {st['model']}: infractl {st['ours_step_s'] * 1e3:.1f} ms vs plain DDP "
        f"{st['plain_step_s'] * 1e3:.1f} ms -> ratio {st['ratio']:.2f} (lower is better; 1.00 = no overhead)"
    )
    print(
        f"(b) training blocked per checkpoint ({ck['params']:,} params + AdamW state): async "
        f"{ck['async_blocked_s'] * 1e3:.0f} ms vs sync {ck['sync_blocked_s'] * 1e3:.0f} ms -> sync/async "
        f"{ck['ratio_sync_over_async']:.1f}x"
    )
    print(
        f"(c) upload of {up['mib']} MiB to the S3 server: store.put_file {up['ours_mib_s']:.0f} MiB/s vs boto3 "
        f"upload_file {up['plain_mib_s']:.0f} MiB/s -> ratio {up['ratio']:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
