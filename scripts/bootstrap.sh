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
export PATH="$venv/bin:$PATH"
