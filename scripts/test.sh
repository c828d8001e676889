#!/usr/bin/env bash
# Install everything, then run the whole test suite (unit, integration, end-to-end, property-based)
# with the lint, format and type checks beside it: CI's command (.ci/run). Extra arguments go to pytest.
#
#   --quick   the quick tier: every test not marked `cluster` (pyproject.toml's markers; tests/conftest.py
#             says how a test gets the mark): no `infractl up`, netns, emulated AWS, torchrun launch or
#             image build. It installs the same (Chromium too: the bundle page's quick test opens it)
#             but does not prebuild the trainer image, which no quick test needs. 499 of the 664
#             tests: 6m51s on a fresh clone of 6a78ae0 on 2 cores (5m52s of it in pytest).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
quick=0
pytest_args=()
for arg in "$@"; do
  if [ "$arg" = "--quick" ]; then quick=1; else pytest_args+=("$arg"); fi
done

# What this run started in the background, stopped and removed however the run ends.
tools="" prebuild="" run_cache="" checks="" checks_log=""
# Removing never changes the run's verdict.
cleanup() {
  if [ -n "$tools" ]; then kill "$tools" 2>/dev/null || true; fi
  if [ -n "$checks" ]; then kill -- "-$checks" 2>/dev/null || true; fi
  if [ -n "$prebuild" ]; then
    # A build still running (a run of a few tests ends before it) writes into the cache until its
    # processes are gone: removing it before then fails on files that keep appearing.
    kill -- "-$prebuild" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 -- "-$prebuild" 2>/dev/null || break
      sleep 0.2
    done
  fi
  if [ -n "$run_cache" ]; then rm -rf "$run_cache" || echo "test.sh: could not remove $run_cache" >&2; fi
  if [ -n "$checks_log" ]; then rm -f "$checks_log" || true; fi
}
trap cleanup EXIT

# checkov, ansible-lint and uv live in .venv-tools: their pins clash with .venv's (boto3 1.35 against
# 1.44). It installs beside .venv, each on a core of its own (a fresh clone: 45 s for both, where one
# after the other took 100 s).
"$repo/scripts/tools.sh" &
tools=$!
source "$repo/scripts/bootstrap.sh"
wait "$tools"
tools=""

# The trainer image (tests/conftest.py's cpu_image) builds in the background from here on, while the
# checks and the first tests run, into an image cache of this run's own that goes with it: the
# first test that needs the image waits on the same lock, then finds it built. Workers no longer
# sit idle for minutes at the start of the container tests. A cache named in INFRACTL_IMAGE_CACHE
# (a developer's, across runs) is used as it is. No quick test needs the image: --quick builds none.
if [ "$quick" = 0 ] && [ -z "${INFRACTL_IMAGE_CACHE:-}" ]; then
  run_cache="$(mktemp -d -t infractl-images.XXXXXX)"
  export INFRACTL_IMAGE_CACHE="$run_cache"
  (cd "$repo" && exec setsid flock "$run_cache/.build.lock" python -m infractl image build \
    --json --lock "$run_cache/cpu.lock.json" >"$run_cache/prebuild.log" 2>&1) &
  prebuild=$!
fi
# The bundle's page is opened in headless Chromium (scripts/screenshot_bundle.py): Debian's chromium,
# driven by playwright from the test extra.
if ! command -v chromium >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends chromium ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; }
fi
cd "$repo"
# Lint, format check and type check run beside the tests' start (15 s of CPU on a fresh clone);
# what they said is printed after the tests when one of them failed, and the command fails then.
# In a process group of their own, so that a run ended early stops the check that is running too.
checks_log="$(mktemp -t infractl-checks.XXXXXX)"
(exec setsid bash -c '
  ruff check infractl trainer tests bench scripts playbooks setup.py &&
    ruff format --check infractl trainer tests bench scripts playbooks setup.py &&
    mypy' >"$checks_log" 2>&1) &
checks=$!
# loadgroup: the tests of a module that share one cluster (xdist_group) run on one worker.
# 3 workers on CI's 2 cores: an end-to-end test spends much of its time waiting (on a fault's
# timeout, a rendezvous, a poll), and 2 workers left a third of the CPU idle (36 minutes of tests;
# 3 workers: 29). 4 overload it: recoveries slow down past the drills' fault windows (a 12 s
# partition ended before the survivors restarted). Every worker stays busy to the end, so the suite
# takes its whole work over 3: the slowest tests are listed at the end, to keep it inside CI's 60
# minutes.
# Where the environment sets PYTHONDONTWRITEBYTECODE, no process of the suite writes the bytecode
# of infractl's and the trainer's modules, and every CLI call, agent and rank compiles them again
# (about 80 ms of CPU a CLI call); written once here, every process reads it (and recompiles a
# module whose source changed).
python -m compileall -q infractl trainer >/dev/null
tier=()
if [ "$quick" = 1 ]; then tier=(-m "not cluster"); fi
tests_status=0
python -m pytest -n 3 --dist loadgroup --durations=15 "${tier[@]}" "${pytest_args[@]}" || tests_status=$?
checks_status=0
wait "$checks" || checks_status=$?
checks=""
if [ "$checks_status" -ne 0 ]; then
  echo "the lint, format or type check failed:" >&2
  cat "$checks_log" >&2
fi
[ "$tests_status" -eq 0 ] && [ "$checks_status" -eq 0 ]
