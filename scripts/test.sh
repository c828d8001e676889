#!/usr/bin/env bash
# Install everything, then run the whole test suite (unit, integration, end-to-end).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/bootstrap.sh"
cd "$repo"
# loadgroup: the tests of a module that share one cluster (xdist_group) run on one worker.
exec python -m pytest -n 2 --dist loadgroup "$@"
