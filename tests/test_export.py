"""``infractl export`` and ``infractl sample``: a committed checkpoint of a sharded (fsdp) and of a
replicated (ddp) 2-rank run, real torchrun on gloo, becomes one file of model weights that a plain
single-process GPT loads and computes the trainer's own logits with; the JSON beside it; the
refusals. The runs are tests/test_schemes.py's reference runs (made once per session, shared)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_schemes import STEPS, copy_of, reference_run, scheme_spec

from infractl import runstore
from infractl.cli import model as model_cli
from infractl.config import default_cluster
from infractl.model import export
from infractl.model.sample import generate
from infractl.runstore import RunRecord, checkpoint_prefix
from infractl.statedir import ClusterRecord, ClusterState, Endpoint
from infractl.store import Store
from trainer.engine import config_hash
from trainer.model import GPT, GPTConfig

from conftest import REPO, Cli, one_line

TIMEOUT_S = 120


def exported_run(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, scheme: str) -> Store:
    """A copy (in ``tmp_path/store``) of ``scheme``'s reference run: 2 ranks, 12 steps, committed
    at 4, 8 and 12. torchrun started it directly, so the run record the launcher writes at launch
    (its resolved spec: the model's shape) is written here."""
    store = copy_of(reference_run(tmp_path_factory, scheme), tmp_path)
    manifest = runstore.read_manifest(store, "tiny", STEPS)
    assert manifest is not None
    record = RunRecord(
        run_id="tiny",
        cluster="local",
        dataset_version=manifest.extra["dataset_version"],
        spec=scheme_spec(scheme).model_dump(mode="json"),
    )
    runstore.write_run_record(store, record)
    return store


def on_cluster(cli: Cli, store: Store) -> None:
    """Make ``store`` the store of the CLI's default cluster. The cluster record's ``store`` is all
    that export and sample read of a cluster; `infractl up` would spend a minute provisioning
    nodes they never use, so the record has no node."""
    record = ClusterRecord(
        name="local", spec=default_cluster(), store=store.uri, id=None, rendezvous=Endpoint("127.0.0.1", 0), nodes=()
    )
    ClusterState("local", cli.home / "local").write(record)


def trainer_logits(store: Store, scheme: str, tmp_path: Path) -> dict[str, Any]:
    """The logits of the trainer's own model at the run's newest committed step, on 2 ranks as it
    was trained (tests/trainer_logits.py: the ``Trainer`` resumes as a job does)."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(scheme_spec(scheme).model_dump_json())
    out = tmp_path / "trainer-logits.pt"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
        str(REPO / "tests" / "trainer_logits.py"),
        "--spec", str(spec_path), "--store", store.uri, "--run-id", "tiny",
        "--workdir", str(tmp_path / "trainer"), "--out", str(out),
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded: dict[str, Any] = torch.load(out, weights_only=True)
    return loaded


def fresh_model(described: dict[str, Any]) -> GPT:
    """A new single-process GPT of the shape the JSON describes."""
    shape = {key: described["model"][key] for key in ("layers", "hidden", "heads", "seq_len")}
    return GPT(GPTConfig(**shape)).eval()


# -- the done-when: same logits as the trainer's model ----------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("scheme", ["fsdp", "ddp"])
def test_exported_weights_compute_the_trainers_logits(
    scheme: str, cli: Cli, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The comparison: the trainer's model is the scheme's parallel model on 2 ranks, resumed from
    the step by the trainer's own loading path (``Trainer.resume``: DCP resharding into fsdp's
    DTensor shards or ddp's replicas). The exported file goes through none of that: DCP's
    metadata and a single-process read, then ``load_state_dict(strict=True)`` into a fresh GPT.
    Both run the same fixed inputs in fp32; the logits agree within fp32 tolerance."""
    store = exported_run(tmp_path_factory, tmp_path, scheme)
    reference = trainer_logits(store, scheme, tmp_path)
    assert reference["step"] == STEPS
    on_cluster(cli, store)
    out = tmp_path / "model.safetensors"
    printed = json.loads(cli("export", "tiny", "--out", str(out), "--json").stdout)
    torch_file = tmp_path / "model.pt"
    cli("export", "tiny", "--out", str(torch_file), "--format", "torch")

    for path, weights in ((out, load_file(out)), (torch_file, torch.load(torch_file, weights_only=True))):
        model = fresh_model(json.loads(export.description_path(path).read_text()))
        model.load_state_dict(weights)  # strict: every parameter, nothing else (no optimizer state)
        with torch.no_grad():
            torch.testing.assert_close(model(reference["inputs"]), reference["logits"])

    described = json.loads(export.description_path(out).read_text())
    assert printed == described | {"path": str(out), "description": str(export.description_path(out))}
    losses = {r["step"]: r["loss"] for r in runstore.read_metrics(store, "tiny")}
    manifest = runstore.read_manifest(store, "tiny", STEPS)
    assert manifest is not None
    # The checkpoint describes itself: export takes the model's shape and the scheme from it.
    assert manifest.extra["model"] == scheme_spec(scheme).model.model_dump(mode="json")
    assert manifest.extra["parallel"] == scheme
    assert described == {
        "file": "model.safetensors",
        "format": "safetensors",
        "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
        "bytes": out.stat().st_size,
        "run": "tiny",
        "step": STEPS,
        "loss": losses[STEPS],
        "tokens_seen": STEPS * 8 * 32,
        "model": {"architecture": "trainer.model.GPT", "layers": 2, "hidden": 32, "heads": 2, "seq_len": 32}
        | {"vocab_size": 256},
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer": "bytes: one token per byte of the UTF-8 text, ids 0-255",
        "dataset_version": manifest.extra["dataset_version"],
        "config_hash": config_hash(scheme_spec(scheme)),
        "scheme": scheme,
        "world_size": 2,
        "checkpoint": str(tmp_path / "store" / checkpoint_prefix("tiny", STEPS)),
    }
    torch_described = json.loads(export.description_path(torch_file).read_text())
    assert torch_described["format"] == "torch"
    assert torch_described["sha256"] == hashlib.sha256(torch_file.read_bytes()).hexdigest()
    # The output projection is tied to the token embedding: one tensor, stored once.
    assert "tok_emb.weight" in load_file(out) and len(load_file(out)) == len(model.state_dict())
    # The store records each file and the command that made it: the handover bundle names them.
    pairs = (("safetensors", out), ("torch", torch_file))
    made = [f"infractl export tiny --step {STEPS} --format {fmt} --out {path} -c local" for fmt, path in pairs]
    assert runstore.read_export_records(store, "tiny") == [
        described | {"path": str(out), "command": made[0]},
        torch_described | {"path": str(torch_file), "command": made[1]},
    ]


@pytest.mark.cluster
def test_an_earlier_step_exports_its_own_weights_and_loss_and_again_the_same_bytes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = exported_run(tmp_path_factory, tmp_path, "fsdp")
    losses = {r["step"]: r["loss"] for r in runstore.read_metrics(store, "tiny")}
    with export.consolidate(store, "tiny") as newest, export.consolidate(store, "tiny", step=8) as earlier:
        assert (newest.step, newest.loss) == (STEPS, losses[STEPS])
        assert (earlier.step, earlier.loss) == (8, losses[8])
        assert not torch.equal(newest.weights()["tok_emb.weight"], earlier.weights()["tok_emb.weight"])
        out = tmp_path / "step-8.safetensors"
        first = export.export(earlier, out, fmt="safetensors")
    with export.consolidate(store, "tiny", step=8) as again_read:
        again = export.export(again_read, out, fmt="safetensors")
    assert first == again  # same weights, same bytes: a regenerated bundle stays byte-identical
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("step-8", ".step-8"))) == [
        "step-8.safetensors",
        "step-8.safetensors.json",
    ]


def test_the_cli_offers_exactly_the_formats_export_writes() -> None:
    assert typing.get_args(model_cli.FormatName) == export.FORMATS


# -- refusals: one line, nothing written ----------------------------------------------------


@pytest.mark.cluster
def test_refusals_are_one_line_exit_2_and_write_nothing(
    cli: Cli, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = exported_run(tmp_path_factory, tmp_path, "ddp")
    never_trained = RunRecord(run_id="fresh", cluster="local", spec=scheme_spec("ddp").model_dump(mode="json"))
    runstore.write_run_record(store, never_trained)
    on_cluster(cli, store)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()

    refusals = {
        ("export", "nope", "--out", str(out)): f"RUN: no run named 'nope' in the store {store.uri}",
        ("export", "fresh", "--out", str(out)): "RUN: run 'fresh' has no committed checkpoint yet",
        ("export", "tiny", "--step", "5", "--out", str(out)): (
            "--step: step 5 of run 'tiny' is not committed (committed: 4, 8, 12)"
        ),
        ("export", "tiny", "--out", str(tmp_path / "no-such-dir" / "m.pt")): (
            f"--out: {tmp_path / 'no-such-dir'} does not exist; create the directory first"
        ),
        ("sample", "tiny", "--step", "7"): "--step: step 7 of run 'tiny' is not committed (committed: 4, 8, 12)",
    }
    for args, message in refusals.items():
        assert one_line(cli(*args, expect=2).stderr) == f"error: {message}"
    assert list(out.parent.iterdir()) == []

    out.write_bytes(b"the team's own file")
    line = one_line(cli("export", "tiny", "--out", str(out), expect=2).stderr)
    assert line == f"error: --out: {out} exists; pass --force to replace it"
    assert out.read_bytes() == b"the team's own file"
    cli("export", "tiny", "--out", str(out), "--force")
    assert load_file(out).keys() == GPT(GPTConfig(layers=2, hidden=32, heads=2, seq_len=32)).state_dict().keys()


@pytest.mark.cluster
def test_a_corrupt_checkpoint_fails_in_one_line_and_writes_nothing(
    cli: Cli, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = exported_run(tmp_path_factory, tmp_path, "ddp")
    manifest = runstore.read_manifest(store, "tiny", STEPS)
    assert manifest is not None
    shard = next(e for e in manifest.files if e.key.endswith(".distcp"))
    path = tmp_path / "store" / checkpoint_prefix("tiny", STEPS) / shard.key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 tells
    path.write_bytes(bytes(data))
    on_cluster(cli, store)

    line = one_line(cli("export", "tiny", "--out", str(tmp_path / "m.safetensors"), expect=1).stderr)
    assert line.startswith(f"error: step {STEPS}: {shard.key}: sha256 is "), line
    assert line.endswith(f", the manifest says {shard.sha256}"), line
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "m.safetensors.json").exists()
    cli("export", "tiny", "--step", "8", "--out", str(tmp_path / "m.safetensors"))  # an intact step still exports


# -- sample ---------------------------------------------------------------------------------


@pytest.mark.cluster
def test_sample_is_the_same_text_for_the_same_seed(
    cli: Cli, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = exported_run(tmp_path_factory, tmp_path, "fsdp")
    on_cluster(cli, store)
    args = ("sample", "tiny", "--prompt", "def ", "--tokens", "40", "--seed", "3")
    first = json.loads(cli(*args, "--json").stdout)
    assert first["text"].startswith("def ") and (first["step"], first["tokens"], first["seed"]) == (STEPS, 40, 3)
    human = cli(*args)
    # The text as it is, but for control characters (a 12-step model writes many), shown escaped.
    assert human.stdout.startswith("def ") and human.stdout.endswith("\n")
    assert all(c.isprintable() or c in "\n\t" for c in human.stdout)
    assert f"run 'tiny' at step {STEPS}" in human.stderr

    with export.consolidate(store, "tiny") as consolidated:
        model = consolidated.model()
    generated = generate(model, b"def ", tokens=40, temperature=0.8, seed=3)
    assert first["text"] == (b"def " + generated).decode("utf-8", errors="replace")
    assert generate(model, b"def ", tokens=40, temperature=0.8, seed=4) != generated
    greedy = generate(model, b"def ", tokens=20, temperature=0, seed=3)
    assert greedy == generate(model, b"def ", tokens=20, temperature=0, seed=4)
