#!/usr/bin/env bash
# Create or update .venv-tools: checkov, ansible-lint and uv at tools-constraints.txt's pins, in a venv of
# their own because their pins clash with .venv's. Idempotent: when the venv already matches the
# constraints (a stamp holds the file's hash), nothing is installed and no registry is asked.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${INFRACTL_TOOLS_VENV:-$repo/.venv-tools}"
constraints="$repo/tools-constraints.txt"
stamp="$venv/.tools-constraints.sha256"
want="$(sha256sum "$constraints" | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/checkov" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" checkov ansible-lint uv
echo "$want" >"$stamp"
