"""Apply the access roles on this node in one process: each role's group exists with exactly its
members (those with an account here), each node directory carries exactly its ACL (its default
ACL included, or none), and the directories above the work directory let the groups through
(search only).

Run by the access role's configure.yml with one argument, the JSON of:
    {"groups": {GROUP: [USER, ...]}, "workdir": ABS, "acls": [{"path": RELATIVE, "acl": [ENTRY, ...]}],
     "traverse": [ABS, ...]}
It first checks that it can do it all (root, setfacl, the directories exist) and changes nothing
otherwise. It prints {"changed": [what it changed, ...]} as JSON; a failed check or command ends it
with exit 1 and one line on stderr saying why. One process instead of a task per group and directory: each
Ansible task costs a module run, and `infractl up` runs this on every node.

It holds an exclusive lock on /run/lock for the whole read-compare-write: the local provider's
nodes are one machine, share the directories above their work directories and the groups, and
are configured at once, as are the clusters of parallel tests.
"""

from __future__ import annotations

import fcntl
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import time


def run(argv: list[str], *, retries: int = 1) -> str:
    """``argv``'s stdout; retried (another process may hold /etc/group's lock for a moment)."""
    for attempt in range(retries):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return done.stdout
        if attempt + 1 < retries:
            time.sleep(1)
    sys.exit(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}")


def has_account(user: str) -> bool:
    try:
        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


def members(group: str) -> list[str] | None:
    try:
        return sorted(grp.getgrnam(group).gr_mem)
    except KeyError:
        return None


def acl(path: str) -> list[str]:
    return sorted(
        line
        for line in run(["getfacl", "--omit-header", "--absolute-names", "--no-effective", path]).splitlines()
        if line
    )


LOCK = "/run/lock/infractl-access.lock"


def main() -> None:
    spec = json.loads(sys.argv[1])
    check(spec)
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        changed = apply(spec)
    print(json.dumps({"changed": changed}))


def check(spec: dict) -> None:
    """Exit with the reason if this node cannot take ``spec``."""
    if os.geteuid() != 0:
        uid = os.geteuid()
        sys.exit(f"managing the access groups and ACLs needs root on the node (uid {uid}); run infractl as root")
    if not (shutil.which("setfacl") and shutil.which("getfacl")):
        sys.exit("setfacl not found: install the acl package (Debian: apt-get install acl)")
    for entry in spec["acls"]:
        path = os.path.normpath(os.path.join(spec["workdir"], entry["path"]))
        if not os.path.isdir(path):
            sys.exit(f"{path} is not a directory (run infractl up)")


def apply(spec: dict) -> list[str]:
    """Bring the node to ``spec``; return what it changed."""
    changed: list[str] = []
    for group, wanted_members in sorted(spec["groups"].items()):
        # A member whose account is gone stays out of the group (and in infractl's record until revoked).
        wanted = sorted(u for u in wanted_members if has_account(u))
        current = members(group)
        if current is None:
            run(["groupadd", "-f", group], retries=10)  # -f: another node on this machine may have made it
            changed.append(f"group {group} created")
            current = []
        if current != wanted:
            run(["gpasswd", "-M", ",".join(wanted), group], retries=10)
            changed.append(f"group {group}: members {', '.join(wanted) or 'none'}")
    for entry in spec["acls"]:
        path = os.path.normpath(os.path.join(spec["workdir"], entry["path"]))
        if acl(path) != sorted(entry["acl"]):
            # --set replaces the access ACL only: a default ACL no longer wanted must go (-k), or
            # every file made there later would still inherit it.
            inherits = any(e.startswith("default:") for e in entry["acl"])
            run(["setfacl", *([] if inherits else ["-k"]), "--set", ",".join(entry["acl"]), path])
            changed.append(f"ACL of {path}")
    through = [f"group:{group}:--x" for group in sorted(spec["groups"])]
    for path in spec["traverse"]:
        missing = [e for e in through if e not in acl(path)]
        if missing:
            run(["setfacl", "-m", ",".join(missing), path])
            changed.append(f"ACL of {path}: {', '.join(missing)}")
    return changed


if __name__ == "__main__":
    main()
