"""The agent's side of in-memory checkpoint replicas (trainer/replicas.py): the server that holds
this node's replicas in the agent's memory and serves them to the ranks of every node, and the run
key that authenticates every request to it.

Apart from the ranks' side so that the agent imports neither DCP nor the tensor machinery it
pulls in: the agent starts on every launch and every rejoin, and those imports cost it about 0.6 s
of CPU before its first rendezvous.

Nothing reaches a replica server without the run's key (``RunKey``): the launcher makes a secret
per launch and writes it to a file on each node that only root (and the trainer's own user) can
read, whose path the agent and its workers find in ``$INFRACTL_RUN_KEY_FILE``; the secret itself is
never on a command line or in an environment. Every file and manifest PUT carries an HMAC-SHA256
over (run, attempt, step, key, sha256 of the body), every GET one over its method and path; the
server checks the signature before it reads a body (a body longer than the cap is refused
unread), refuses a name that is not one of a replica's own, and logs who sent what it refused.
A manifest is checked before it replaces an older step, and it is served with its signature so
that rank 0 checks it again before it trusts a replica (trainer/replicas.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from infractl.log import get_logger

__all__ = [
    "MAX_BYTES_ENV",
    "REPLICA_ADDR_ENV",
    "RUN_KEY_FILE_ENV",
    "ReplicaServer",
    "RunKey",
    "file_key_ok",
    "serve",
]

log = get_logger(__name__)

#: Where this node's agent holds replicas (host:port), set by the agent for its workers.
REPLICA_ADDR_ENV = "INFRACTL_REPLICA_ADDR"
#: The file that holds the run's key (its path only: the key is never in an environment).
RUN_KEY_FILE_ENV = "INFRACTL_RUN_KEY_FILE"
#: The most bytes one replica file may have (the launcher sizes it from the model: a rank's shard
#: is never more than the whole state).
MAX_BYTES_ENV = "INFRACTL_REPLICA_MAX_BYTES"

#: The header that carries a request's signature, and the one that carries a body's sha256.
SIGNATURE_HEADER = "X-Infractl-Signature"
SHA256_HEADER = "X-Sha256"
#: A manifest lists every file's size and hash, and rank 0's metrics records since the last one.
_MAX_MANIFEST_BYTES = 16 << 20
#: The files of a replica: each rank's shard, and rank 0's DCP metadata (trainer/replicas.py).
_FILE_KEY = re.compile(r"rank-(0|[1-9][0-9]{0,5})|metadata")
#: A step number as a replica names it (no sign, no leading zero, at most 12 digits).
_STEP = re.compile(r"0|[1-9][0-9]{0,11}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def file_key_ok(key: str) -> bool:
    """Whether ``key`` is the name of a replica's file (``rank-<R>`` or ``metadata``)."""
    return _FILE_KEY.fullmatch(key) is not None


@dataclass(frozen=True)
class RunKey:
    """The run's secret and what every signature binds it to: the run and the launch's attempt."""

    secret: bytes
    run: str
    attempt: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RunKey | None:
        """The key of the run this process belongs to, from the file ``$INFRACTL_RUN_KEY_FILE``
        names; None when it names none (a trainer started without infractl's launcher)."""
        path = environ.get(RUN_KEY_FILE_ENV)
        if not path:
            return None
        secret = bytes.fromhex(Path(path).read_text().strip())
        if len(secret) < 32:
            raise ValueError(f"{path}: a run key has 32 bytes at least")
        return cls(secret=secret, run=environ["INFRACTL_RUN"], attempt=int(environ["INFRACTL_ATTEMPT"]))

    def _sign(self, *fields: object) -> str:
        message = "\n".join([self.run, str(self.attempt), *(str(f) for f in fields)]).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def sign_body(self, kind: str, step: int, key: str, sha256: str) -> str:
        """The signature of a ``kind`` (``file`` or ``manifest``) body of replica ``step``."""
        return self._sign(kind, step, key, sha256)

    def sign_request(self, method: str, path: str) -> str:
        """The signature of a request that carries no body (GET)."""
        return self._sign("request", method, path)

    def verify_body(self, signature: str, kind: str, step: int, key: str, sha256: str) -> bool:
        return hmac.compare_digest(signature, self.sign_body(kind, step, key, sha256))

    def verify_request(self, signature: str, method: str, path: str) -> bool:
        return hmac.compare_digest(signature, self.sign_request(method, path))


@dataclass
class _Held:
    """One step an agent holds: file key -> (bytes, sha256, signature), checked on receipt; its
    manifest (the signed JSON text) and the manifest's signature."""

    files: dict[str, tuple[bytes, str, str]]
    manifest: bytes | None = None
    manifest_signature: str = ""


class ReplicaServer(ThreadingHTTPServer):
    """A node's replicas, in its agent's memory, over HTTP (every request signed, see the module doc)::

    PUT  /steps/<N>/files/<key>?copy=own|peer   X-Sha256 (400 if the body differs), signed body
    PUT  /steps/<N>/manifest                    signed body; then every step before N is dropped
    GET  /index                                 {"<N>": {"manifest": TEXT, "signature": ..., "files": {key: sha256}}}
    GET  /steps/<N>/files/<key>                 the body, its signature in X-Infractl-Signature
    """

    daemon_threads = True

    def __init__(self, host: str, key: RunKey, *, max_bytes: int, corrupt_peer_copies: bool = False) -> None:
        super().__init__((host, 0), _Handler)
        self.key = key
        self.max_bytes = max_bytes
        self.corrupt_peer_copies = corrupt_peer_copies
        self.lock = threading.Lock()
        self.steps: dict[int, _Held] = {}

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, name="replica-server", daemon=True).start()

    def put_file(self, step: int, key: str, body: bytes, sha256: str, signature: str, *, peer: bool) -> bool:
        """Hold ``body`` as file ``key`` of ``step`` (its signature checked by the caller); False
        when the body is not what ``sha256`` says."""
        if hashlib.sha256(body).hexdigest() != sha256:
            return False
        if peer and self.corrupt_peer_copies and body:  # fault injection (module doc)
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        with self.lock:
            self.steps.setdefault(step, _Held(files={})).files[key] = (body, sha256, signature)
        return True

    def put_manifest(self, step: int, body: bytes, signature: str) -> None:
        with self.lock:
            held = self.steps.setdefault(step, _Held(files={}))
            held.manifest, held.manifest_signature = body, signature
            for older in [s for s in self.steps if s < step]:
                del self.steps[older]

    def index(self) -> dict[str, Any]:
        with self.lock:
            return {
                str(step): {
                    "manifest": held.manifest.decode() if held.manifest is not None else None,
                    "signature": held.manifest_signature,
                    "files": {key: sha for key, (_, sha, _) in held.files.items()},
                }
                for step, held in self.steps.items()
            }

    def get_file(self, step: int, key: str) -> tuple[bytes, str] | None:
        """The body of file ``key`` of ``step`` and the signature it was sent with."""
        with self.lock:
            held = self.steps.get(step)
            if held is None or key not in held.files:
                return None
            body, _, signature = held.files[key]
            return body, signature


class _Handler(BaseHTTPRequestHandler):
    server: ReplicaServer
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        step_ok = len(parts) >= 3 and parts[0] == "steps" and _STEP.fullmatch(parts[1]) is not None
        is_file = step_ok and len(parts) == 4 and parts[2] == "files"
        is_manifest = step_ok and len(parts) == 3 and parts[2] == "manifest"
        if not (is_file or is_manifest):
            return self._refuse(404, "no such replica path")
        if is_file and not file_key_ok(parts[3]):
            return self._refuse(404, f"{parts[3]!r} is not a replica file's name")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self._refuse(411, "no Content-Length")
        cap = self.server.max_bytes if is_file else _MAX_MANIFEST_BYTES
        if not 0 <= length <= cap:
            return self._refuse(413, f"a body of {length} bytes (at most {cap})")
        signature = self.headers.get(SIGNATURE_HEADER, "")
        sha256 = self.headers.get(SHA256_HEADER, "") if is_file else ""
        if not signature or (is_file and _SHA256.fullmatch(sha256) is None):
            return self._refuse(403, "an unsigned request")
        body = self.rfile.read(length)
        step = int(parts[1])
        if is_manifest:
            sha256 = hashlib.sha256(body).hexdigest()
            if not self.server.key.verify_body(signature, "manifest", step, "manifest", sha256):
                return self._refuse(403, f"a manifest of step {step} whose signature does not verify")
            self.server.put_manifest(step, body, signature)
            return self._answer(204)
        if not self.server.key.verify_body(signature, "file", step, parts[3], sha256):
            return self._refuse(403, f"file {parts[3]} of step {step} whose signature does not verify")
        ok = self.server.put_file(step, parts[3], body, sha256, signature, peer=_copy(url.query) == "peer")
        self._answer(204) if ok else self._refuse(400, f"file {parts[3]} of step {step} that differs from its sha256")

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if not self.server.key.verify_request(self.headers.get(SIGNATURE_HEADER, ""), "GET", path):
            return self._refuse(403, f"an unsigned GET {path}")
        parts = path.strip("/").split("/")
        if parts == ["index"]:
            return self._answer(200, json.dumps(self.server.index()).encode())
        if len(parts) == 4 and parts[:1] == ["steps"] and _STEP.fullmatch(parts[1]) and parts[2] == "files":
            held = self.server.get_file(int(parts[1]), parts[3])
            if held is not None:
                return self._answer(200, held[0], {SIGNATURE_HEADER: held[1]})
        self._answer(404)

    def _refuse(self, status: int, what: str) -> None:
        """Answer ``status`` and say in the agent's log who sent what was refused (the body, if
        any, is not read: the connection closes)."""
        host, port = self.client_address[:2]
        log.warning("replica_refused", what=what, sender=f"{host}:{port}", request=f"{self.command} {self.path}")
        self.close_connection = True
        self._answer(status)

    def _answer(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a request per file per replica would drown the agent's log."""


def _copy(query: str) -> str:
    return urllib.parse.parse_qs(query).get("copy", ["own"])[0]


def serve(host: str, environ: Mapping[str, str], *, corrupt_peer_copies: bool = False) -> ReplicaServer | None:
    """Start this node's replica server on ``host`` (the agent, before its workers start); None
    when ``environ`` names no run key (then the workers keep no replicas). ``corrupt_peer_copies``:
    a drill's hook (trainer/faults.py)."""
    key = RunKey.from_environ(environ)
    if key is None:
        return None
    server = ReplicaServer(
        host,
        key,
        max_bytes=int(environ.get(MAX_BYTES_ENV) or 0) or 1 << 40,
        corrupt_peer_copies=corrupt_peer_copies,
    )
    server.start()
    return server
