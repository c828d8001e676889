#!/usr/bin/env bash
# Create .venv (if missing) and install infractl with its pinned stack into it.
# Sourced by quickstart.sh and test.sh so both set-up commands install the same way.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${INFRACTL_VENV:-$repo/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -c "$repo/constraints.txt" -e "$repo[test]"
# Debian packages the tests and the providers need on this machine, installed when missing:
# acl (setfacl: the access roles are POSIX ACLs on the nodes, and local nodes are this machine),
# openssh-server and iproute2 (sshd and ip: the netns provider's nodes), util-linux (unshare,
# nsenter); the trainer image's build and its cluster registry: mmdebstrap, buildah and skopeo (build,
# push), podman with runc (the netns nodes' engine), docker-registry (the CNCF distribution registry);
# sudo (the login user of the ssh provider's test hosts, tests/labhosts.py, has password-less sudo).
missing=""
command -v setfacl >/dev/null || missing="$missing acl"
command -v sudo >/dev/null || missing="$missing sudo"
[ -x /usr/sbin/sshd ] || missing="$missing openssh-server"
command -v ssh >/dev/null || missing="$missing openssh-client"
command -v ip >/dev/null && command -v bridge >/dev/null || missing="$missing iproute2"
command -v unshare >/dev/null && command -v nsenter >/dev/null || missing="$missing util-linux"
for tool in mmdebstrap buildah skopeo podman runc docker-registry; do
  command -v "$tool" >/dev/null || missing="$missing $tool"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086 # one word per package
    apt-get install -y -qq --no-install-recommends $missing >/dev/null ||
      { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null; }
  else
    echo "bootstrap: missing Debian packages:$missing; install them as root (apt-get install$missing)" >&2
    return 1
  fi
fi
export PATH="$venv/bin:$PATH"
