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
# The access roles are POSIX ACLs on the nodes (the local provider's nodes are this machine):
# setfacl and getfacl come from Debian's acl package.
if ! command -v setfacl >/dev/null; then
  if [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq acl >/dev/null || { apt-get update -qq && apt-get install -y -qq acl >/dev/null; }
  else
    echo "bootstrap: setfacl not found: install the acl package as root (Debian: apt-get install acl)" >&2
    return 1
  fi
fi
export PATH="$venv/bin:$PATH"
