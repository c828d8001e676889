"""The trained model leaves with the team: a committed checkpoint of a run, whatever scheme and
world size saved it, consolidated into one file of model weights with a JSON beside it that says
what they are and where they came from.

A checkpoint holds every rank's DCP shards of the whole training state (model, optimizer,
progress, RNGs; see trainer/engine.py ``Trainer._state``). Consolidating reads only the model's
tensors, each whole, in this one process: DCP's metadata names every tensor with its global shape,
and ``dcp.load(no_dist=True)`` assembles each from whichever shards hold it (fsdp's DTensor
shards, ddp's and zero1's replicas alike). The keys are the plain ``trainer.model.GPT``'s parameter
names (``ModelState`` saves them without DDP's prefix), so the weights load strictly into a fresh
``GPT(GPTConfig(...))``; the output projection is tied to ``tok_emb.weight`` (one tensor, no copy).

The step's facts come from its manifest: the model's shape and the scheme that saved it, world
size, config hash, dataset version, tokens seen (checkpoints written before the manifest recorded
the shape and scheme take them from the run's record, ``run.json``); the loss at that step from
the run's metrics.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ValidationError
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load

from infractl import runstore
from infractl.config import ModelSpec, RunSpec
from infractl.errors import InfractlError, UsageError
from infractl.runstore import CheckpointError, Manifest, checkpoint_prefix, file_sha256
from infractl.store import Store
from trainer.model import GPT, VOCAB_SIZE, GPTConfig

__all__ = ["Format", "FORMATS", "Consolidated", "consolidate", "check_destination", "description_path", "export"]

Format = Literal["safetensors", "torch"]
FORMATS: tuple[Format, ...] = ("safetensors", "torch")

#: The checkpoint's key of the model's weights (``Trainer._state``); DCP flattens it to ``model.<name>``.
_MODEL_KEY = "model"


@dataclass(frozen=True)
class Consolidated:
    """One committed step of a run as a plain, single-process model."""

    run_id: str
    step: int
    shape: ModelSpec  # the model's shape that saved the step
    scheme: str  # the parallel scheme that saved it
    manifest: Manifest
    model: GPT  # in eval mode, the step's weights loaded strictly
    loss: float | None  # the training loss at ``step`` (None when the metrics lack it)
    checkpoint: str  # where the step lives in the store (``Store.location``)

    def weights(self) -> dict[str, torch.Tensor]:
        """The state dict to write: every parameter once, by its GPT name."""
        return {name: tensor.detach().contiguous() for name, tensor in sorted(self.model.state_dict().items())}


def consolidate(store: Store, run_id: str, *, step: int | None = None) -> Consolidated:
    """The run's newest committed step (or ``step``) as a plain model. Refused (``UsageError``)
    for an unknown run, a run with nothing committed and a step that is not committed; a checkpoint
    that fails verification raises ``CheckpointError`` and the store's failures ``StoreError``."""
    record = runstore.read_run_record(store, run_id)
    if record is None:
        raise UsageError(f"no run named {run_id!r} in the store {store.uri}", field="RUN")
    spec = _spec(record.spec, run_id)
    step = _committed_step(store, run_id, step)
    manifest = runstore.verify_checkpoint(store, run_id, step)
    shape, scheme = _saved_by(manifest, spec, f"step {step} of run {run_id!r}")
    with tempfile.TemporaryDirectory(prefix="infractl-export-") as tmp:
        _download(store, run_id, manifest, Path(tmp))
        weights = _read_model(Path(tmp), f"step {step} of run {run_id!r}")
    model = GPT(GPTConfig.from_spec(shape))
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:  # a missing, unexpected or misshapen parameter
        raise CheckpointError(
            f"step {step} of run {run_id!r} does not fit the run's model ({_first_line(exc)})"
        ) from None
    losses = [r["loss"] for r in runstore.read_metrics(store, run_id) if r["step"] == step]
    return Consolidated(
        run_id=run_id,
        step=step,
        shape=shape,
        scheme=scheme,
        manifest=manifest,
        model=model.eval(),
        loss=losses[0] if losses else None,
        checkpoint=store.location(checkpoint_prefix(run_id, step)),
    )


def _saved_by(manifest: Manifest, spec: RunSpec, what: str) -> tuple[ModelSpec, str]:
    """The model's shape and the scheme that saved a step: its manifest says (checkpoints since
    it records them), else the run's record (its latest launch; a resume keeps the model's shape)."""
    saved = manifest.extra
    try:
        shape = ModelSpec.model_validate(saved["model"]) if "model" in saved else spec.model
    except ValidationError as exc:
        raise CheckpointError(f"{what}: the model in its manifest is not valid ({_first_line(exc)})") from None
    return shape, str(saved.get("parallel", spec.parallel.label))


def _spec(raw: dict[str, Any] | None, run_id: str) -> RunSpec:
    """The run's resolved spec from its record: the model's shape and the scheme."""
    if raw is None:
        raise InfractlError(f"run {run_id!r} has no resolved spec in its run.json (it was never launched)")
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as exc:
        raise InfractlError(f"run {run_id!r}: the spec in its run.json is not valid ({_first_line(exc)})") from None


def _committed_step(store: Store, run_id: str, step: int | None) -> int:
    committed = runstore.committed_steps(store, run_id)
    if not committed:
        raise UsageError(f"run {run_id!r} has no committed checkpoint yet", field="RUN")
    if step is None:
        return committed[-1]
    if step not in committed:
        shown = ", ".join(str(s) for s in committed)
        raise UsageError(f"step {step} of run {run_id!r} is not committed (committed: {shown})", field="--step")
    return step


def _download(store: Store, run_id: str, manifest: Manifest, dest: Path) -> None:
    """Every file of the step into ``dest``, each checked against the manifest's sha256."""
    for entry in manifest.files:
        runstore.fetch_checkpoint_file(store, run_id, manifest.step, entry, dest / entry.key, tag="export")


def _read_model(directory: Path, what: str) -> dict[str, torch.Tensor]:
    """The model's tensors of the DCP checkpoint in ``directory``, whole, by parameter name."""
    reader = FileSystemReader(directory)
    prefix = f"{_MODEL_KEY}."
    try:
        metadata = reader.read_metadata()
        templates = {
            key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
        }
        if not templates:
            raise CheckpointError(f"{what} holds no model weights")
        # Only the keys asked for are read: the optimizer's state and the RNGs stay on disk.
        with warnings.catch_warnings():
            # "...assuming the intent is to load in a single process": it is, no_dist says so.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load({_MODEL_KEY: templates}, storage_reader=reader, no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # DCP raises several types for a checkpoint it cannot read
        raise CheckpointError(f"{what} cannot be read: {type(exc).__name__}: {_first_line(exc)}") from None
    return templates


def description_path(out: Path) -> Path:
    """The JSON beside the weights file: ``FILE.json``."""
    return out.with_name(f"{out.name}.json")


def check_destination(out: Path, *, force: bool) -> None:
    """Refuse an ``--out`` that cannot be written, before anything is read: its directory must
    exist, and neither the file nor its JSON may exist unless ``force``."""
    try:
        if not out.parent.is_dir():
            problem = "is not a directory" if out.parent.exists() else "does not exist; create the directory first"
            raise UsageError(f"{out.parent} {problem}", field="--out")
        for path in (out, description_path(out)):
            if path.is_dir():
                raise UsageError(f"{path} is a directory", field="--out")
            if path.exists() and not force:
                raise UsageError(f"{path} exists; pass --force to replace it", field="--out")
    except (OSError, ValueError) as exc:  # a name the OS refuses (too long, a NUL byte)
        raise UsageError(f"cannot use {out}: {exc}", field="--out") from None


def export(model: Consolidated, out: Path, *, fmt: Format) -> dict[str, Any]:
    """Write the weights to ``out`` and the description to ``FILE.json``; return the description.

    Each is written to a temporary file in the same directory and renamed into place, the
    weights first: ``out`` is never half written, and a JSON always describes a whole file
    (after a failure between the two renames, the previous JSON's sha256 no longer matches).
    """
    described = description_path(out)
    tmp_weights = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp_json = out.with_name(f".{described.name}.{os.getpid()}.tmp")
    try:
        weights = model.weights()
        if fmt == "safetensors":
            save_file(weights, tmp_weights, metadata={"format": "pt"})  # "pt": transformers' key for torch tensors
        else:
            # Through a file object: given a path, torch names the archive's folder after the
            # (temporary) file name, and the same weights would give different bytes.
            with tmp_weights.open("wb") as f:
                torch.save(weights, f)
        description = _describe(model, file=out.name, fmt=fmt, sha256=file_sha256(tmp_weights))
        description["bytes"] = tmp_weights.stat().st_size
        tmp_json.write_text(json.dumps(description, indent=1, sort_keys=True) + "\n")
        os.replace(tmp_weights, out)
        os.replace(tmp_json, described)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}", field="--out") from None
    finally:
        tmp_weights.unlink(missing_ok=True)
        tmp_json.unlink(missing_ok=True)
    return description


def _describe(model: Consolidated, *, file: str, fmt: Format, sha256: str) -> dict[str, Any]:
    """What the exported file is. No times: exporting the same step again gives the same JSON."""
    extra = model.manifest.extra
    return {
        "file": file,
        "format": fmt,
        "sha256": sha256,
        "run": model.run_id,
        "step": model.step,
        "loss": model.loss,
        "tokens_seen": extra.get("tokens_seen"),
        "model": {"architecture": "trainer.model.GPT", **model.shape.model_dump(mode="json"), "vocab_size": VOCAB_SIZE},
        "parameters": sum(p.numel() for p in model.model.parameters()),
        "tokenizer": "bytes: one token per byte of the UTF-8 text, ids 0-255",
        "dataset_version": extra.get("dataset_version"),
        "config_hash": extra.get("config_hash"),
        # The scheme and the world size that saved this step.
        "scheme": model.scheme,
        "world_size": model.manifest.world_size,
        "checkpoint": model.checkpoint,
    }


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
