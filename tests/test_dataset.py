"""Versioned byte-level datasets: prepare, version, split, verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infractl import dataset
from infractl.config import DataSpec
from infractl.errors import ConfigError

from conftest import Cli


def _corpus(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


FILES = {f"doc{i:02d}.txt": f"document {i} " * 50 for i in range(40)}


def _prepared(tmp_path: Path, name: str, files: dict[str, str] = FILES) -> tuple[Path, dict]:
    src = _corpus(tmp_path / f"src-{name}" / "corpus", files)
    out = tmp_path / f"out-{name}"
    return out, dataset.prepare([src], out, val_fraction=0.2)


def test_same_input_gives_the_same_version(tmp_path: Path) -> None:
    _, first = _prepared(tmp_path, "a")
    _, second = _prepared(tmp_path, "b")
    assert first["version"] == second["version"]
    assert first["splits"]["val"]["bytes"] > 0 and first["splits"]["train"]["bytes"] > 0


def test_changed_content_changes_the_version(tmp_path: Path) -> None:
    _, first = _prepared(tmp_path, "a")
    _, second = _prepared(tmp_path, "b", {**FILES, "doc00.txt": "changed"})
    assert first["version"] != second["version"]


def test_adding_a_document_moves_no_other_document_between_splits() -> None:
    names = [f"corpus/doc{i:02d}.txt" for i in range(200)]
    before = {n: dataset.split_of(n, 0.1) for n in names}
    assert 5 < sum(v == "val" for v in before.values()) < 40
    assert all(dataset.split_of(n, 0.1) == s for n, s in before.items())


def test_prepared_dataset_loads_with_its_version(tmp_path: Path) -> None:
    out, manifest = _prepared(tmp_path, "a")
    loaded = dataset.open_dataset(DataSpec(source="prepared", path=str(out)))
    assert loaded.version == manifest["version"]
    assert len(loaded.tokens("train")) == manifest["splits"]["train"]["bytes"]


def test_corrupt_shard_is_refused(tmp_path: Path) -> None:
    out, _ = _prepared(tmp_path, "a")
    shard = out / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="does not match its sha256"):
        dataset.open_dataset(DataSpec(source="prepared", path=str(out)))


def test_edited_manifest_is_refused(tmp_path: Path) -> None:
    out, manifest = _prepared(tmp_path, "a")
    manifest["val_fraction"] = 0.5
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="was edited"):
        dataset.open_dataset(DataSpec(source="prepared", path=str(out)))


def test_missing_dataset_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.path: .* is not a prepared dataset"):
        dataset.open_dataset(DataSpec(source="prepared", path=str(tmp_path)))


def test_stdlib_source_is_deterministic_and_bounded() -> None:
    spec = DataSpec(max_bytes=200_000)
    first, second = dataset.open_dataset(spec), dataset.open_dataset(spec)
    assert first.version == second.version
    assert sum(len(t) for t in first.splits.values()) <= 200_000 + 1000  # plus separators


def test_cli_prepare_refuses_a_non_empty_out_dir(cli: Cli, tmp_path: Path) -> None:
    src = _corpus(tmp_path / "src", FILES)
    made = json.loads(cli("data", "prepare", str(src), "--out", "ds", "--json").stdout)
    assert (cli.cwd / "ds" / "manifest.json").is_file() and made["version"]
    before = (cli.cwd / "ds" / "manifest.json").read_text()
    refused = cli("data", "prepare", str(src), "--out", "ds", expect=2)
    assert "--out: ds is not an empty directory" in refused.stderr
    assert (cli.cwd / "ds" / "manifest.json").read_text() == before


def test_cli_prepare_missing_source(cli: Cli) -> None:
    refused = cli("data", "prepare", "nowhere", "--out", "ds", expect=2)
    assert "SRC: no such file or directory: nowhere" in refused.stderr
    assert not (cli.cwd / "ds").exists()
