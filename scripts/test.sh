#!/usr/bin/env bash
# Install everything, then lint, format-check and type-check the code, and run the whole test
# suite (unit, integration, end-to-end, property-based). Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/bootstrap.sh"
# The trainer image (tests/conftest.py's cpu_image) builds in the background from here on, while the
# tools install and the checks run, into an image cache of this run's own that goes with it: the
# first test that needs the image waits on the same lock, then finds it built. Workers no longer
# sit idle for minutes at the start of the container tests. A cache named in INFRACTL_IMAGE_CACHE
# (a developer's, across runs) is used as it is.
if [ -z "${INFRACTL_IMAGE_CACHE:-}" ]; then
  INFRACTL_IMAGE_CACHE="$(mktemp -d -t infractl-images.XXXXXX)"
  export INFRACTL_IMAGE_CACHE
  (cd "$repo" && exec setsid flock "$INFRACTL_IMAGE_CACHE/.build.lock" python -m infractl image build \
    --json --lock "$INFRACTL_IMAGE_CACHE/cpu.lock.json" >"$INFRACTL_IMAGE_CACHE/prebuild.log" 2>&1) &
  prebuild=$!
  trap 'kill -- "-$prebuild" 2>/dev/null || true; rm -rf "$INFRACTL_IMAGE_CACHE"' EXIT
fi
# checkov, ansible-lint and uv live in .venv-tools: their pins clash with .venv's (boto3 1.35 against 1.44).
"$repo/scripts/tools.sh"
# The bundle's page is opened in headless Chromium (scripts/screenshot_bundle.py): Debian's chromium,
# driven by playwright from the test extra.
if ! command -v chromium >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends chromium ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; }
fi
cd "$repo"
ruff check infractl trainer tests bench scripts playbooks setup.py
ruff format --check infractl trainer tests bench scripts playbooks setup.py
mypy
# loadgroup: the tests of a module that share one cluster (xdist_group) run on one worker.
# 3 workers on CI's 2 cores: an end-to-end test spends much of its time waiting (on a fault's
# timeout, a rendezvous, a poll), and 2 workers left a third of the CPU idle (36 minutes of tests;
# 3 workers: 29). 4 overload it: recoveries slow down past the drills' fault windows (a 12 s
# partition ended before the survivors restarted). Every worker stays busy to the end, so the suite
# takes its whole work over 3: the slowest tests are listed at the end, to keep it inside CI's 45
# minutes.
python -m pytest -n 3 --dist loadgroup --durations=15 "$@"
