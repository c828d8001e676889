"""Keep this node's guard on its own users: an iptables chain, jumped to first in OUTPUT, that lets
the trusted users' processes through and refuses every other process of the node a connection to
the cluster's addresses (every port but SSH's, TCP and UDP) and to the instance metadata service.

Run by the firewall role's configure.yml with one argument, the JSON of:
    {"chain": NAME, "addresses": [IPV4, ...], "trusted_uids": [UID, ...], "metadata": IPV4, "ssh_port": PORT}
It prints {"changed": true|false}: the chain is rewritten only when it differs from what it should
be. A failed command ends it with exit 1 and one line on stderr saying why.

Refused with an ICMP "port unreachable", so a refused process fails at once (connection refused)
rather than after a timeout. The owner match sees only what leaves this node: it guards the node's
own users, not other hosts (the replica servers authenticate those, SECURITY.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

REFUSE = ["-j", "REJECT", "--reject-with", "icmp-port-unreachable"]


def iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        sys.exit(f"iptables {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def rules(spec: dict) -> list[list[str]]:
    """The chain's rules as ``iptables -S`` prints them (what they are compared with)."""
    chain = spec["chain"]
    wanted = [["-A", chain, "-m", "owner", "--uid-owner", str(uid), "-j", "RETURN"] for uid in spec["trusted_uids"]]
    wanted.append(["-A", chain, "-d", f"{spec['metadata']}/32", "-p", "tcp", *REFUSE])
    for address in spec["addresses"]:
        port = str(spec["ssh_port"])
        wanted.append(["-A", chain, "-d", f"{address}/32", "-p", "tcp", "-m", "tcp", "!", "--dport", port, *REFUSE])
        wanted.append(["-A", chain, "-d", f"{address}/32", "-p", "udp", *REFUSE])
    return wanted


def main() -> None:
    spec = json.loads(sys.argv[1])
    chain = spec["chain"]
    wanted = rules(spec)
    listed = iptables("-S", chain, check=False)
    current = [line.split() for line in listed.stdout.splitlines() if line.startswith("-A ")]
    jumped = iptables("-C", "OUTPUT", "-j", chain, check=False).returncode == 0
    if listed.returncode == 0 and current == wanted and jumped:
        print(json.dumps({"changed": False}))
        return
    # The new chain is built whole beside the old one and takes its place in one jump: the node is
    # never unguarded while the rules change.
    fresh = f"{chain}-NEW"
    if iptables("-S", fresh, check=False).returncode == 0:  # what a run killed half-way left
        while iptables("-D", "OUTPUT", "-j", fresh, check=False).returncode == 0:
            pass
        iptables("-F", fresh)
        iptables("-X", fresh)
    iptables("-N", fresh)
    for rule in wanted:
        iptables(*[fresh if part == chain else part for part in rule])
    iptables("-I", "OUTPUT", "1", "-j", fresh)
    if listed.returncode == 0:
        while iptables("-D", "OUTPUT", "-j", chain, check=False).returncode == 0:
            pass
        iptables("-F", chain)
        iptables("-X", chain)
    iptables("-E", fresh, chain)
    print(json.dumps({"changed": True}))


if __name__ == "__main__":
    main()
