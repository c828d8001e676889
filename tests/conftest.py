"""Shared fixtures: the one CLI helper every CLI test goes through."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from infractl import proc

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Cli:
    """Runs the real ``infractl`` in its own process, in a private working directory."""

    cwd: Path

    @property
    def home(self) -> Path:
        return self.cwd / ".infractl"

    def env(self) -> dict[str, str]:
        return {**os.environ, "INFRACTL_HOME": str(self.home), "NO_COLOR": "1", "COLUMNS": "200"}

    def __call__(self, *args: str, expect: int = 0, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Run ``infractl ARGS`` and assert its exit code; a failure must be one clean message."""
        result = subprocess.run(
            [sys.executable, "-m", "infractl", *args],
            cwd=self.cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        detail = f"infractl {' '.join(args)}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        assert result.returncode == expect, detail
        if expect != 0:
            assert "Traceback" not in result.stderr, detail
        return result


@pytest.fixture
def cli(tmp_path: Path) -> "Cli":
    runner = Cli(tmp_path)
    yield runner
    # A failed test must not leak node processes: kill whatever its clusters still run, by PID.
    if runner.home.is_dir():
        for cluster_dir in runner.home.iterdir():
            proc.kill(proc.find(cluster_dir))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
