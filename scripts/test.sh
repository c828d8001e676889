#!/usr/bin/env bash
# Install everything, then lint, format-check and type-check the code, and run the whole test
# suite (unit, integration, end-to-end, property-based). Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/bootstrap.sh"
cd "$repo"
ruff check infractl trainer tests bench
ruff format --check infractl trainer tests bench
mypy
# loadgroup: the tests of a module that share one cluster (xdist_group) run on one worker.
exec python -m pytest -n 2 --dist loadgroup "$@"
