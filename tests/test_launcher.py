"""infractl.launcher's decisions that need no cluster: what of the operator's environment an agent
gets (an allowlist, plus what the run.yaml's ``env:`` names). tests/test_security.py checks the
same on a running netns cluster's processes and files."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infractl.config import RunSpec
from infractl.errors import UsageError
from infractl.launcher import passed_environment
from trainer.faults import HOOKS

OPERATOR = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "HF_TOKEN": "hf_secret",
    "GITHUB_TOKEN": "ghp_secret",
    "VAULT_TOKEN": "hvs.secret",
    "LD_PRELOAD": "/tmp/evil.so",
    "INFRACTL_CKPT_UPLOAD_DELAY_S": "60",
    "AWS_ACCESS_KEY_ID": "AKIA",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "OMP_NUM_THREADS": "4",
    "NCCL_DEBUG": "INFO",
}


def test_an_agent_gets_the_allowlist_and_nothing_else_of_the_operators_environment() -> None:
    passed = passed_environment(RunSpec(name="r"), OPERATOR)

    assert passed == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "AWS_ACCESS_KEY_ID": "AKIA",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "OMP_NUM_THREADS": "4",
    }


def test_the_variables_a_run_yaml_names_pass_too_and_must_be_set() -> None:
    spec = RunSpec(name="r", env=["HF_TOKEN", "NCCL_DEBUG", "INFRACTL_CKPT_UPLOAD_DELAY_S"], rehearsal=True)

    passed = passed_environment(spec, OPERATOR)

    assert {"HF_TOKEN", "NCCL_DEBUG", "INFRACTL_CKPT_UPLOAD_DELAY_S"} <= set(passed)
    assert "GITHUB_TOKEN" not in passed and "LD_PRELOAD" not in passed
    with pytest.raises(UsageError, match="HF_TOKEN is not set in this environment") as refused:
        passed_environment(spec, {k: v for k, v in OPERATOR.items() if k != "HF_TOKEN"})
    assert refused.value.field == "env"


def test_a_run_yaml_passes_the_trainers_fault_hooks_in_a_rehearsal_only() -> None:
    for hook in HOOKS:
        assert RunSpec(name="r", env=[hook], rehearsal=True).env == [hook]
        with pytest.raises(ValidationError, match=f"{hook} is a fault-injection hook for drills and tests"):
            RunSpec(name="r", env=[hook])
    with pytest.raises(ValidationError, match="INFRACTL_RUN cannot be passed to the trainers"):
        RunSpec(name="r", env=["INFRACTL_RUN"], rehearsal=True)
