"""The config loader: typed specs, unknown fields refused with the field path and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from infractl.cli.schema import write_schemas
from infractl.config import default_cluster, even_passes, load_cluster, load_run, micro_batch
from infractl.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_examples_load() -> None:
    assert load_run(REPO / "examples" / "quickstart.yaml").nodes.max == 2
    assert load_run(REPO / "examples" / "fsdp-bf16.yaml").parallel.scheme == "fsdp"
    elastic = load_run(REPO / "examples" / "elastic.yaml")
    assert (elastic.nodes.min, elastic.nodes.max, elastic.watchdog.step_timeout_s) == (1, 2, 30)
    assert load_cluster(REPO / "examples" / "cluster-local.yaml") == default_cluster()
    tensor = load_run(REPO / "examples" / "tensor-parallel.yaml")
    assert (tensor.parallel.dp_shard, tensor.parallel.tp, tensor.parallel.pp) == ("fsdp", 2, 1)
    assert (tensor.nodes.min, tensor.nodes.max) == (2, 2)
    pipeline = load_run(REPO / "examples" / "pipeline.yaml").parallel
    assert (pipeline.pp, pipeline.pp_schedule, pipeline.microbatches, pipeline.tp) == (2, "1f1b", 4, 1)


def test_yaml_exponent_learning_rate_is_a_number(tmp_path: Path) -> None:
    assert load_run(_write(tmp_path, "name: r\nlr: 3e-4\n")).lr == pytest.approx(3e-4)


def test_nested_unknown_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run.yaml: checkpoint.evry: unknown field"):
        load_run(_write(tmp_path, "name: r\ncheckpoint: {evry: 3}\n"))


def test_cross_field_rule_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nodes: min \(3\) must not exceed max \(2\)"):
        load_run(_write(tmp_path, "name: r\nnodes: {min: 3, max: 2}\n"))


def test_a_micro_batch_caps_each_pass_at_every_world_size_and_not_a_pipelines(tmp_path: Path) -> None:
    spec = load_run(_write(tmp_path, "name: r\nbatch_size: 48\nmicro_batch: 20\nnodes: {min: 1, max: 2}\n"))
    # Two ranks' shares of 24 take 2 passes of 12 each; one rank's 48 then takes 4 of the same size.
    assert [micro_batch(spec, world_size=n, max_world_size=2) for n in (2, 1)] == [12, 12]
    assert even_passes(48, 20) == 16 and even_passes(8, 20) == 8 and even_passes(8, None) == 8
    with pytest.raises(
        ConfigError, match=r"run.yaml: micro_batch: cannot be set with pipeline stages \(parallel.pp: 2\)"
    ):
        load_run(_write(tmp_path, "name: r\nmicro_batch: 2\nparallel: {pp: 2}\n"))
    with pytest.raises(ConfigError, match=r"run.yaml: micro_batch: Input should be greater than or equal to 1"):
        load_run(_write(tmp_path, "name: r\nmicro_batch: 0\n"))


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run.yaml: line 3: not valid YAML"):
        load_run(_write(tmp_path, "name: r\nsteps: [1,\n"))


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_run(_write(tmp_path, "- a\n- b\n"))


def test_committed_schemas_are_current(tmp_path: Path) -> None:
    for path in write_schemas(tmp_path):
        committed = REPO / "schemas" / path.name
        assert committed.read_text() == path.read_text(), "run `infractl schema` and commit schemas/"


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ("[LD_PRELOAD]", "LD_PRELOAD cannot be passed to the trainers"),
        ("[PYTHONPATH]", "PYTHONPATH cannot be passed to the trainers"),
        ("[INFRACTL_RUN_KEY_FILE]", "INFRACTL_RUN_KEY_FILE cannot be passed to the trainers"),
        ("[BASH_ENV]", "BASH_ENV cannot be passed to the trainers"),
        ("['A B']", "'A B' is not an environment variable's name"),
        ("[HF_TOKEN, HF_TOKEN]", "names a variable twice"),
    ],
)
def test_run_env_names_only_variables_a_trainer_may_be_given(tmp_path: Path, names: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"run.yaml: env: .*{message}"):
        load_run(_write(tmp_path, f"name: r\nenv: {names}\n"))


def test_run_env_may_name_a_token_and_in_a_rehearsal_the_fault_hooks(tmp_path: Path) -> None:
    text = "name: r\nenv: [HF_TOKEN, NCCL_DEBUG, INFRACTL_REPLICA_CORRUPT]\n"
    spec = load_run(_write(tmp_path, text + "rehearsal: true\n"))
    assert spec.env == ["HF_TOKEN", "NCCL_DEBUG", "INFRACTL_REPLICA_CORRUPT"] and spec.rehearsal
    with pytest.raises(ConfigError, match=r"run.yaml: env: INFRACTL_REPLICA_CORRUPT is a fault-injection hook for"):
        load_run(_write(tmp_path, text))
