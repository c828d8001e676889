"""Recovery benchmark: N kill-node drills in a row on one 2-node local run.

What a user would type, in a scratch directory: ``infractl up``, ``infractl train --detach`` of a
long run, then ``infractl drill kill-node --node node-1 --repeat N --no-wait`` (node-1 is
SIGKILLed, node-0 goes on alone from the last committed step, node-1 rejoins, the world is 2
again, and the next drill starts), then ``infractl teardown``. Reports how many drills
recovered from the last committed step, and the median and worst restart_s (fault -> first
step completed after resume) and rejoin_s (rejoin -> first step on 2 nodes again).

    python bench/recovery.py [--drills 20] [--json results.json]

Not a test: it asserts nothing. The numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUN = """\
name: recovery
model: {{layers: 2, hidden: 64, heads: 2, seq_len: 64}}
data: {{max_bytes: 200000}}
batch_size: 8
steps: 10000000
checkpoint: {{every: 10, keep: 2}}
nodes: {{min: 1, max: 2}}
max_restarts: {budget}
"""


def _infractl(home: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "INFRACTL_HOME": str(home), "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "infractl", *args], cwd=home.parent, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode not in (0, 1):  # 1: a drill did not recover; still a result to report
        raise SystemExit(f"infractl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def _waited_for_first_commit(home: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = json.loads(_infractl(home, "status", "--json", timeout=60).stdout)
        if any((run.get("last_committed_step") or 0) >= 10 for run in status.get("runs", [])):
            return
        time.sleep(1)
    raise SystemExit(f"the run committed no checkpoint within {timeout:g}s")


def measure(drills: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="infractl-recovery-") as tmp:
        home = Path(tmp) / ".infractl"
        run = Path(tmp) / "run.yaml"
        run.write_text(RUN.format(budget=drills + 1))
        _infractl(home, "up", timeout=600)
        try:
            _infractl(home, "train", str(run), "--detach", timeout=300)
            _waited_for_first_commit(home, timeout=300)
            started = time.monotonic()
            series = json.loads(_infractl(home, "drill", "kill-node", "--node", "node-1", "--repeat", str(drills),
                                          "--no-wait", "--json", timeout=drills * 600).stdout)
            elapsed = time.monotonic() - started
        finally:
            _infractl(home, "teardown", "--yes", timeout=600)
    results = series["results"]
    rejoins = [r["rejoin_s"] for r in results if r.get("rejoin_s") is not None]
    detects = [r["detect_s"] for r in results if r.get("detect_s") is not None]
    return {
        "drills": series["drills"],
        "succeeded": series["succeeded"],
        "resumed_from_last_committed": sum(1 for r in results if r["resumed_correctly"]),
        "median_restart_s": series["median_restart_s"],
        "worst_restart_s": series["worst_restart_s"],
        "median_detect_s": round(statistics.median(detects), 3) if detects else None,
        "median_rejoin_s": round(statistics.median(rejoins), 3) if rejoins else None,
        "median_lost_work_steps": statistics.median(r["lost_work_steps"] for r in results if r["lost_work_steps"] is not None),
        "series_s": round(elapsed, 1),
        "restart_s": [r["restart_s"] for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drills", type=int, default=20, help="kill-node drills in the series (default 20)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    report = measure(args.drills)
    print(f"kill-node drills recovered:   {report['succeeded']}/{report['drills']} "
          f"(resumed from the last committed step: {report['resumed_from_last_committed']})")
    print(f"restart_s median / worst:     {report['median_restart_s']} / {report['worst_restart_s']}")
    print(f"detect_s median:              {report['median_detect_s']}")
    print(f"rejoin_s median:              {report['median_rejoin_s']}")
    print(f"lost work, median steps:      {report['median_lost_work_steps']}")
    print(f"series wall time (s):         {report['series_s']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
