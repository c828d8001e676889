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

Exporting reads one layer at a time (a transformer block's tensors, or one of the others) and
writes it to the output before reading the next, so host memory holds about one layer, not the
model: safetensors is written directly (its header, every tensor's shape and place, comes from
the checkpoint's metadata before any tensor is read); for ``torch.save`` each layer goes to a
file of its own first, and the state dict saved maps those files instead of holding them.

The step's facts come from its manifest: the model's shape and the scheme that saved it, world
size, config hash, dataset version, tokens seen (checkpoints written before the manifest recorded
the shape and scheme take them from the run's record, ``run.json``); the loss at that step from
the run's metrics.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import struct
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy
import torch
from pydantic import ValidationError
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
    """One committed step of a run as a plain, single-process model: its files downloaded and
    checked, its tensors read on demand (``layers``, ``weights``, ``model``)."""

    run_id: str
    step: int
    shape: ModelSpec  # the model's shape that saved the step
    scheme: str  # the parallel scheme that saved it
    manifest: Manifest
    loss: float | None  # the training loss at ``step`` (None when the metrics lack it)
    checkpoint: str  # where the step lives in the store (``Store.location``)
    files: Path  # the step's DCP files
    tensors: dict[str, TensorStorageMetadata]  # the model's tensors by GPT name: global shape and dtype

    def layers(self) -> Iterator[dict[str, torch.Tensor]]:
        """The model's tensors, by GPT name in sorted order, one layer at a time: a transformer
        block's, or one other parameter."""
        names = sorted(self.tensors)
        for _, group in itertools.groupby(names, key=_layer):
            yield _read_model(self.files, {name: self.tensors[name] for name in group}, self.what)

    def weights(self) -> dict[str, torch.Tensor]:
        """The state dict to write: every parameter once, by its GPT name, sorted."""
        return {name: tensor for layer in self.layers() for name, tensor in layer.items()}

    def model(self) -> GPT:
        """A ``GPT`` of the step's shape holding its weights, in eval mode (built on the meta
        device: the weights read are its parameters, not a copy)."""
        with torch.device("meta"):
            model = GPT(GPTConfig.from_spec(self.shape))
        model.load_state_dict(self.weights(), assign=True)
        return model.eval()

    @property
    def what(self) -> str:
        return f"step {self.step} of run {self.run_id!r}"


@contextlib.contextmanager
def consolidate(store: Store, run_id: str, *, step: int | None = None) -> Iterator[Consolidated]:
    """The run's newest committed step (or ``step``) as a plain model, while the ``with`` lasts
    (its files are in a temporary directory). Refused (``UsageError``) for an unknown run, a run
    with nothing committed and a step that is not committed; a checkpoint that fails verification
    or does not fit the run's model raises ``CheckpointError`` and the store's failures
    ``StoreError``."""
    record = runstore.read_run_record(store, run_id)
    if record is None:
        raise UsageError(f"no run named {run_id!r} in the store {store.uri}", field="RUN")
    spec = _spec(record.spec, run_id)
    step = _committed_step(store, run_id, step)
    manifest = runstore.verify_checkpoint(store, run_id, step)
    what = f"step {step} of run {run_id!r}"
    shape, scheme = _saved_by(manifest, spec, what)
    losses = [r["loss"] for r in runstore.read_metrics(store, run_id) if r["step"] == step]
    with tempfile.TemporaryDirectory(prefix="infractl-export-") as tmp:
        _download(store, run_id, manifest, Path(tmp))
        yield Consolidated(
            run_id=run_id,
            step=step,
            shape=shape,
            scheme=scheme,
            manifest=manifest,
            loss=losses[0] if losses else None,
            checkpoint=store.location(checkpoint_prefix(run_id, step)),
            files=Path(tmp),
            tensors=_model_tensors(Path(tmp), shape, what),
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


def _model_tensors(directory: Path, shape: ModelSpec, what: str) -> dict[str, TensorStorageMetadata]:
    """The model's tensors in the DCP checkpoint in ``directory``, by GPT name: exactly the
    parameters of a ``GPT`` of ``shape``, each of its shape (``CheckpointError`` otherwise)."""
    prefix = f"{_MODEL_KEY}."
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as exc:  # DCP raises several types for a checkpoint it cannot read
        raise CheckpointError(f"{what} cannot be read: {type(exc).__name__}: {_first_line(exc)}") from None
    found = {
        key[len(prefix) :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not found:
        raise CheckpointError(f"{what} holds no model weights")
    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in GPT(GPTConfig.from_spec(shape)).named_parameters()}
    problems = [f"missing {n}" for n in sorted(expected.keys() - found.keys())]
    problems += [f"unexpected {n}" for n in sorted(found.keys() - expected.keys())]
    problems += [
        f"{n} is {tuple(found[n].size)}, not {expected[n]}"
        for n in sorted(expected.keys() & found.keys())
        if tuple(found[n].size) != expected[n]
    ]
    if problems:
        raise CheckpointError(f"{what} does not fit the run's model ({'; '.join(problems[:3])})")
    return found


def _read_model(directory: Path, tensors: dict[str, TensorStorageMetadata], what: str) -> dict[str, torch.Tensor]:
    """``tensors`` of the DCP checkpoint in ``directory``, whole, by GPT name."""
    templates = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in tensors.items()}
    try:
        # Only the keys asked for are read: the rest of the model, the optimizer's state and the
        # RNGs stay on disk.
        with warnings.catch_warnings():
            # "...assuming the intent is to load in a single process": it is, no_dist says so.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load({_MODEL_KEY: templates}, storage_reader=FileSystemReader(directory), no_dist=True)
    except Exception as exc:  # DCP raises several types for a checkpoint it cannot read
        raise CheckpointError(f"{what} cannot be read: {type(exc).__name__}: {_first_line(exc)}") from None
    return templates


def _layer(name: str) -> str:
    """The layer parameter ``name`` belongs to: ``blocks.<i>`` for a block's, else itself."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else name


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
    """Write the weights to ``out``, one layer at a time (the module docstring), and the
    description to ``FILE.json``; return the description.

    Each is written to a temporary file in the same directory and renamed into place, the
    weights first: ``out`` is never half written, and a JSON always describes a whole file
    (after a failure between the two renames, the previous JSON's sha256 no longer matches).
    """
    described = description_path(out)
    tmp_weights = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp_json = out.with_name(f".{described.name}.{os.getpid()}.tmp")
    try:
        if fmt == "safetensors":
            _write_safetensors(model, tmp_weights)
        else:
            _write_torch(model, tmp_weights)
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


#: safetensors' names of the dtypes a checkpoint's tensors may have.
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _write_safetensors(model: Consolidated, path: Path) -> None:
    """The safetensors file of ``model``'s weights (github.com/huggingface/safetensors: an 8-byte
    little-endian header length, a JSON header giving each tensor's dtype, shape and byte range,
    padded with spaces to 8 bytes, then the tensors' bytes), sorted by name, one layer in memory
    at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # "pt": transformers' key for torch tensors
    offset = 0
    for name in sorted(model.tensors):
        meta = model.tensors[name]
        size = math.prod(meta.size) * meta.properties.dtype.itemsize
        dtype = _SAFETENSORS_DTYPES[meta.properties.dtype]
        header[name] = {"dtype": dtype, "shape": list(meta.size), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for layer in model.layers():
            for tensor in layer.values():
                f.write(_raw(tensor).data)


def _write_torch(model: Consolidated, path: Path) -> None:
    """``torch.save`` of ``model``'s state dict, sorted by name: each layer is written to files
    of its own as it is read, and the state dict saved maps them (``torch.from_file``), so the
    weights are paged in from disk as they are written rather than held."""
    with tempfile.TemporaryDirectory(prefix="infractl-export-", dir=path.parent) as tmp:
        mapped: dict[str, torch.Tensor] = {}
        for layer in model.layers():
            for name, tensor in layer.items():
                spilled = Path(tmp) / name
                _raw(tensor).tofile(spilled)
                flat = torch.from_file(str(spilled), shared=False, size=tensor.numel(), dtype=tensor.dtype)
                mapped[name] = flat.view(tensor.shape)
        # Through a file object: given a path, torch names the archive's folder after the
        # (temporary) file name, and the same weights would give different bytes.
        with path.open("wb") as f:
            torch.save(mapped, f)


def _raw(tensor: torch.Tensor) -> numpy.ndarray[Any, numpy.dtype[numpy.uint8]]:
    """``tensor``'s bytes in memory order, without a copy (numpy has no bfloat16: as bytes)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


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
        "parameters": sum(math.prod(meta.size) for meta in model.tensors.values()),
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
