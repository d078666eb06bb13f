"""Hugging Face folders: `config.json`, `*.safetensors` (one file or indexed shards) and the
tokenizer. Everything checkable is checked before any tensor is read, so a bad download fails at
once, naming the file; tensors are then streamed one at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.weights import CountedWeights

__all__ = ["load_hf_folder", "load_tokenizer"]

_INDEX = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _read_safetensors(files: list[Path]) -> CountedWeights:
    """The tensors of safetensors files (CPU, stored dtype), read lazily after every header is
    checked. ValueError names a truncated or corrupt file."""
    count = 0
    for file in files:
        with _open(file) as f:
            count += len(f.keys())

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with _open(file) as f:
                for name in f.keys():
                    try:
                        yield name, f.get_tensor(name)
                    except SafetensorError as exc:
                        raise _corrupt(file, exc) from exc

    return CountedWeights(read(), count)


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise _corrupt(file, exc) from exc


def _corrupt(file: Path, exc: Exception) -> ValueError:
    return ValueError(
        f"load_hf_folder: cannot read {file} ({exc}); the file is truncated or corrupt. "
        "Download it again."
    )


def load_hf_folder(path: str | os.PathLike) -> tuple[ModelConfig, CountedWeights]:
    """`(config, weights)` of a folder with `config.json` and `model.safetensors`, or shards
    listed in `model.safetensors.index.json` (else any `*.safetensors`); weights are streamed
    `(Hugging Face name, CPU tensor in the stored dtype)` pairs. FileNotFoundError: the folder,
    `config.json` or a safetensors file is missing. ValueError: not a folder, invalid JSON, an
    unsupported architecture, or a truncated or corrupt safetensors file (named)."""
    folder = _folder("load_hf_folder", path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"load_hf_folder: no config.json in {folder} (expected a Hugging Face model folder "
            "with config.json and *.safetensors)."
        )
    try:
        config_dict = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"load_hf_folder: {config_path} is not valid JSON ({exc}).") from exc
    if not isinstance(config_dict, dict):
        raise ValueError(
            f"load_hf_folder: {config_path} must hold a JSON object (got "
            f"{type(config_dict).__name__})."
        )
    try:
        config = ModelConfig.from_hf(config_dict)
    except ValueError as exc:
        raise ValueError(f"load_hf_folder: {config_path}: {exc}") from exc
    return config, _read_safetensors(_safetensors_files(folder))


def _folder(api: str, path: str | os.PathLike) -> Path:
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(
            f"{api}: no such folder {folder} (expected a Hugging Face model folder with "
            "config.json and *.safetensors)."
        )
    if not folder.is_dir():
        raise ValueError(
            f"{api}: not a folder (got {folder}, expected a Hugging Face model folder; a .gguf "
            "file goes to the GGUF loader)."
        )
    return folder


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, LookupError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"load_hf_folder: {index} is not a safetensors index (expected JSON with a "
                f"'weight_map' object; {type(exc).__name__}: {exc})."
            ) from exc
        files = [folder / name for name in names]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise FileNotFoundError(
                f"load_hf_folder: shards listed in {index} are missing (got none of "
                f"{', '.join(missing)} in {folder}). Download them again."
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = [p.name for ext in ("bin", "pt") for p in sorted(folder.glob(f"*.{ext}"))]
        hint = f" Found {', '.join(other)}: convert it to safetensors." if other else ""
        raise FileNotFoundError(
            f"load_hf_folder: no *.safetensors files in {folder} (expected model.safetensors or "
            f"shards with {_INDEX}).{hint}"
        )
    return files


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of a Hugging Face folder (chat template included), loaded offline by
    transformers' `AutoTokenizer`. FileNotFoundError: no folder or tokenizer files;
    ValueError: they cannot be loaded; ImportError: transformers is not installed."""
    folder = _folder("load_tokenizer", path)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"load_tokenizer: no tokenizer files in {folder} (expected one of "
            f"{', '.join(_TOKENIZER_FILES)})."
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ImportError(
            "load_tokenizer: transformers is not installed (needed to read Hugging Face "
            "tokenizers). Install it with pip install 'anyattn[hf]'."
        ) from exc
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"load_tokenizer: cannot load the tokenizer in {folder} ({exc}).") from exc
