#!/usr/bin/env bash
# Install everything, then run the quickstart end to end on the local provider:
# plan -> up -> train examples/quickstart.yaml -> status -> bundle -> teardown.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/bootstrap.sh"
cd "$repo"
infractl plan examples/quickstart.yaml
infractl up
infractl train examples/quickstart.yaml
infractl status
infractl bundle
infractl teardown --yes
