#!/usr/bin/env bash
# Regenerate requirements.txt from requirements.in: every package pinned (at constraints.txt's version where
# it has one) with the sha256 of each of its files, for the image's Python: 3.12 on Ubuntu 24.04, x86_64.
# Needs PyPI. uv comes from the tools venv (scripts/tools.sh).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$here"
"$repo/.venv-tools/bin/uv" pip compile requirements.in \
  --constraint ../../constraints.txt \
  --generate-hashes \
  --python-version 3.12 \
  --python-platform x86_64-manylinux_2_28 \
  --custom-compile-command "images/trainer/lock.sh" \
  --output-file requirements.txt
