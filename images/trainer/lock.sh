#!/usr/bin/env bash
# Regenerate the hash-locked requirements of both image flavours from requirements.in: every package
# pinned (at constraints.txt's version where it has one) with the sha256 of each of its files.
#   requirements.txt      gpu: Python 3.12 (Ubuntu 24.04), torch with CUDA from PyPI
#   requirements-cpu.txt  cpu: Python 3.11 (Debian 12), torch's CPU build from $TORCH_CPU_WHEELS
# Needs PyPI. uv comes from the tools venv (scripts/tools.sh). TORCH_CPU_WHEELS: a folder or index page
# holding torch-2.13.0+cpu (default /opt/wheels, where this project's machines keep it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
uv="$repo/.venv-tools/bin/uv"
cd "$here"
"$uv" pip compile requirements.in \
  --constraint ../../constraints.txt \
  --generate-hashes \
  --python-version 3.12 \
  --python-platform x86_64-manylinux_2_28 \
  --custom-compile-command "images/trainer/lock.sh" \
  --output-file requirements.txt
# unsafe-best-match: torch's CPU build (2.13.0+cpu) lives beside PyPI, not on it.
"$uv" pip compile requirements.in \
  --constraint ../../constraints.txt \
  --generate-hashes \
  --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28 \
  --find-links "${TORCH_CPU_WHEELS:-/opt/wheels}" \
  --index-strategy unsafe-best-match \
  --custom-compile-command "images/trainer/lock.sh" \
  --output-file requirements-cpu.txt
