"""Cross-node health check: a timed gloo all_reduce across every node, reported as one JSON line.

Every node runs ``python -m infractl.health --rendezvous HOST:PORT --key NONCE --rank R --world N``
at the same time. The ranks meet in the cluster's rendezvous store under ``health/<NONCE>/`` (a
fresh nonce per check, so keys left by an earlier check never mix in), run a few all_reduce
iterations of ``--bytes`` bytes and each print::

    {"node": "node-0", "rank": 0, "world": 2, "backend": "gloo", "algorithm": "ring",
     "bytes": 4194304, "iterations": 5, "seconds": 0.0041, "algbw_gbps": 1.02, "busbw_gbps": 1.02}

``seconds`` is the mean time of one all_reduce; bandwidths are in GB/s (10^9 bytes per second) as
nccl-tests reports them: algbw = bytes / seconds, busbw = algbw * 2 * (n - 1) / n, the traffic a
ring all_reduce puts on each link. On failure or timeout it prints one line to stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

__all__ = ["run", "main"]

DEFAULT_BYTES = 4 * 1024 * 1024
DEFAULT_TIMEOUT_S = 60.0
_WARMUP = 1
_ITERATIONS = 5


class HealthCheckError(Exception):
    """The collective could not be set up or did not complete."""


def run(
    rendezvous: tuple[str, int],
    *,
    key: str,
    rank: int,
    world: int,
    nbytes: int = DEFAULT_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    node: str | None = None,
) -> dict[str, Any]:
    """Join the health check under ``key`` as ``rank`` of ``world`` and time the all_reduce."""
    import torch.distributed as dist

    host, port = rendezvous
    timeout = timedelta(seconds=timeout_s)
    try:
        # torch's stubs do not re-export the c10d store classes from torch.distributed.
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    except Exception as exc:  # torch raises several types (RuntimeError, DistStoreError, ...)
        raise HealthCheckError(f"cannot reach the rendezvous at {host}:{port}: {_first_line(exc)}") from None
    store = dist.PrefixStore(f"health/{key}", client)  # type: ignore[attr-defined]
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except Exception as exc:
        raise HealthCheckError(
            f"rank {rank} of {world}: the nodes did not all join within {timeout_s:g}s: {_first_line(exc)}"
        ) from None
    try:
        nbytes, seconds = _time_all_reduce(nbytes, world)
    except HealthCheckError:
        raise
    except Exception as exc:
        raise HealthCheckError(f"rank {rank} of {world}: all_reduce failed: {_first_line(exc)}") from None
    finally:
        dist.destroy_process_group()
    algbw = nbytes / seconds / 1e9
    return {
        "node": node or f"node-{rank}",
        "rank": rank,
        "world": world,
        "backend": "gloo",
        # ProcessGroupGloo's CPU all_reduce uses gloo's default algorithm, the ring.
        "algorithm": "ring",
        "bytes": nbytes,
        "iterations": _ITERATIONS,
        "seconds": seconds,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (world - 1) / world,
    }


def _time_all_reduce(nbytes: int, world: int) -> tuple[int, float]:
    """All-reduce about ``nbytes`` over the group: the bytes moved and the seconds one took."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    for _ in range(_WARMUP):
        dist.all_reduce(tensor)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(_ITERATIONS):
        dist.all_reduce(tensor)
    seconds = (time.perf_counter() - start) / _ITERATIONS
    # Every rank contributed ones at each step: the sum checks that all ranks took part.
    expected = float(world) ** (_WARMUP + _ITERATIONS)
    if tensor[0].item() != expected:
        raise HealthCheckError(f"all_reduce gave {tensor[0].item()}, expected {expected}: a rank is missing")
    return tensor.numel() * tensor.element_size(), seconds


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _endpoint(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rendezvous", type=_endpoint, required=True, help="the cluster's rendezvous HOST:PORT")
    parser.add_argument("--key", required=True, help="nonce naming this check in the store")
    parser.add_argument("--rank", type=int, required=True, help="this node's index")
    parser.add_argument("--world", type=int, required=True, help="number of nodes taking part")
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help="all_reduce size in bytes")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the others")
    parser.add_argument("--node", help="node name to report (default node-<rank>)")
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.world:
        parser.error(f"--rank must be in 0..{args.world - 1}")

    # A hung peer must not hang the check: past twice the timeout, give up whatever torch is doing.
    limit = 2 * args.timeout + 10
    watchdog = threading.Timer(limit, _give_up, args=(args.rank, args.world, limit))
    watchdog.daemon = True
    watchdog.start()
    try:
        report = run(
            args.rendezvous,
            key=args.key,
            rank=args.rank,
            world=args.world,
            nbytes=args.bytes,
            timeout_s=args.timeout,
            node=args.node,
        )
    except HealthCheckError as exc:
        print(f"health check failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        watchdog.cancel()
    print(json.dumps(report), flush=True)
    return 0


def _give_up(rank: int, world: int, limit: float) -> None:
    message = f"health check failed: rank {rank} of {world}: no result after {limit:g}s"
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
