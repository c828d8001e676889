"""The agent's side of in-memory checkpoint replicas (trainer/replicas.py): the server that holds
this node's replicas in the agent's memory and serves them to the ranks of every node.

Apart from the ranks' side so that the agent imports neither DCP nor the tensor machinery it
pulls in: the agent starts on every launch and every rejoin, and those imports cost it about 0.6 s
of CPU before its first rendezvous.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["CORRUPT_ENV", "REPLICA_ADDR_ENV", "ReplicaServer", "serve"]

#: Where this node's agent holds replicas (host:port), set by the agent for its workers.
REPLICA_ADDR_ENV = "INFRACTL_REPLICA_ADDR"
#: Fault-injection knob (trainer/replicas.py's doc): ``peer`` corrupts the copies an agent holds
#: for other nodes.
CORRUPT_ENV = "INFRACTL_REPLICA_CORRUPT"


@dataclass
class _Held:
    """One step an agent holds: file key -> (bytes, sha256 computed on receipt); its manifest."""

    files: dict[str, tuple[bytes, str]]
    manifest: bytes | None = None


class ReplicaServer(ThreadingHTTPServer):
    """A node's replicas, in its agent's memory, over HTTP::

    PUT  /steps/<N>/files/<key>?copy=own|peer   header X-Sha256 (400 if the body differs)
    PUT  /steps/<N>/manifest                    then every step before N is dropped
    GET  /index                                 {"<N>": {"manifest": ..., "files": {key: sha256}}}
    GET  /steps/<N>/files/<key>
    """

    daemon_threads = True

    def __init__(self, host: str, *, corrupt_peer_copies: bool = False) -> None:
        super().__init__((host, 0), _Handler)
        self.corrupt_peer_copies = corrupt_peer_copies
        self.lock = threading.Lock()
        self.steps: dict[int, _Held] = {}

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="replica-server", daemon=True).start()

    def put_file(self, step: int, key: str, body: bytes, sha256: str, *, peer: bool) -> bool:
        if hashlib.sha256(body).hexdigest() != sha256:
            return False
        if peer and self.corrupt_peer_copies and body:  # fault injection (module doc)
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        with self.lock:
            self.steps.setdefault(step, _Held(files={})).files[key] = (body, sha256)
        return True

    def put_manifest(self, step: int, body: bytes) -> None:
        with self.lock:
            self.steps.setdefault(step, _Held(files={})).manifest = body
            for older in [s for s in self.steps if s < step]:
                del self.steps[older]

    def index(self) -> dict[str, Any]:
        with self.lock:
            return {
                str(step): {
                    "manifest": json.loads(held.manifest) if held.manifest is not None else None,
                    "files": {key: sha for key, (_, sha) in held.files.items()},
                }
                for step, held in self.steps.items()
            }

    def get_file(self, step: int, key: str) -> bytes | None:
        with self.lock:
            held = self.steps.get(step)
            return held.files[key][0] if held is not None and key in held.files else None


class _Handler(BaseHTTPRequestHandler):
    server: ReplicaServer
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if len(parts) == 4 and parts[0] == "steps" and parts[1].isdigit() and parts[2] == "files":
            query = urllib.parse.parse_qs(url.query)
            ok = self.server.put_file(
                int(parts[1]),
                parts[3],
                body,
                self.headers.get("X-Sha256", ""),
                peer=query.get("copy", ["own"])[0] == "peer",
            )
            self._answer(204 if ok else 400)
        elif len(parts) == 3 and parts[0] == "steps" and parts[1].isdigit() and parts[2] == "manifest":
            self.server.put_manifest(int(parts[1]), body)
            self._answer(204)
        else:
            self._answer(404)

    def do_GET(self) -> None:
        parts = urllib.parse.urlsplit(self.path).path.strip("/").split("/")
        if parts == ["index"]:
            self._answer(200, json.dumps(self.server.index()).encode())
        elif len(parts) == 4 and parts[0] == "steps" and parts[1].isdigit() and parts[2] == "files":
            body = self.server.get_file(int(parts[1]), parts[3])
            self._answer(404) if body is None else self._answer(200, body)
        else:
            self._answer(404)

    def _answer(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a request per file per replica would drown the agent's log."""


def serve(host: str) -> ReplicaServer:
    """Start this node's replica server on ``host`` (the agent, before its workers start)."""
    server = ReplicaServer(host, corrupt_peer_copies=os.environ.get(CORRUPT_ENV, "").strip() == "peer")
    server.start()
    return server
