"""moto's standalone S3 server on loopback, for the tests and the benchmarks (no pytest needed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["AWS_TEST_ENV", "AWS_TEST_ENV_UNSET", "free_port", "moto_server"]

AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Keep the developer's real AWS config out, and never wait on the EC2 metadata service.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
AWS_TEST_ENV_UNSET = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server(
    log: Path, env: dict[str, str] | None = None, startup_s: float = 30.0, host: str = "127.0.0.1"
) -> Iterator[str]:
    """Run ``python -m moto.server`` on a free port of ``host`` (loopback) until the block ends;
    yield its URL."""
    for _attempt in range(3):  # the free port may be taken between probing and binding: retry
        port = free_port()
        endpoint = f"http://{host}:{port}"
        with log.open("ab") as out:
            server = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
            )
        deadline = time.monotonic() + startup_s
        ready = False
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):
                    ready = True
                    break
            except OSError:
                time.sleep(0.1)
        if ready:
            break
        server.terminate()
        server.wait(timeout=10)
    else:
        raise RuntimeError(f"moto server did not start; see {log}:\n{log.read_text()[-2000:]}")
    try:
        yield endpoint
    finally:
        server.terminate()  # by PID (Popen), never by name
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
