"""The cluster's rendezvous endpoint: a c10d TCPStore served by a process that is not a training node.

torchrun's c10d rendezvous keeps its state in a TCPStore; whoever hosts it is a single point of
failure. Hosting it here, outside every node's failure domain, lets any node (node 0 included) die
without ending the run. Agents connect with ``--rdzv-conf=is_host=false``.

torch's TCPStore has no authentication, and the agents unpickle the rendezvous state they read
from it: whoever can connect can run code in every agent. So only the nodes may: the provider
fences the endpoint's host to the nodes' addresses (netns: infra/netns's guard; aws: the members-only
security group), and each node's guard keeps its other users off it (SECURITY.md).

Run as ``python -m infractl.servers.tcpstore --host H --port P``; it serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import threading
from datetime import timedelta

__all__ = ["serve"]


def serve(host: str, port: int) -> None:
    """Serve a multi-tenant TCPStore on ``host:port`` until SIGTERM or SIGINT."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not re-exported in torch's stubs

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    store = TCPStore(
        host,
        port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    print(f"rendezvous serving on {host}:{port}", flush=True)
    stop.wait()
    del store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
