"""Load a model, its config and its tokenizer from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from anyattn.engine.default_model import default_model_path
from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models import build_model
from anyattn.engine.models.weights import CountedWeights

__all__ = ["LoadedModel", "load_model", "read_model"]


@dataclass
class LoadedModel:
    """A model ready to run, with what describes it."""

    model: torch.nn.Module
    config: ModelConfig
    tokenizer: object
    path: Path


def read_model(
    path: Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, CountedWeights, object]:
    """The config, the lazy weights (none read yet) and the tokenizer of a model path."""
    if path.is_file():
        from anyattn.engine.gguf_loader import load_gguf_tokenizer, read_gguf

        config_dict, weights = read_gguf(path, dtype=dtype)
        return ModelConfig.from_hf(config_dict), weights, load_gguf_tokenizer(path)
    from anyattn.engine.hf_loader import load_hf_folder, load_tokenizer

    config, weights = load_hf_folder(path)
    return config, weights, load_tokenizer(path)


def _with_progress(weights: CountedWeights, label: str) -> Iterable[tuple[str, torch.Tensor]]:
    """A progress bar on a terminal; quiet otherwise."""
    if not sys.stderr.isatty():
        yield from weights
        return
    from rich.progress import Progress, TextColumn

    # the label, a file name, is not markup ("smol[bold].gguf")
    columns = (TextColumn("{task.description}", markup=False), *Progress.get_default_columns()[1:])
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task(label, total=len(weights))
        for item in weights:
            yield item
            progress.advance(task)


def load_model(
    path: str | os.PathLike | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int = 16,
    backend: str | type | None = None,
    kv_cache_dtype: str = "auto",
    max_positions: int | None = None,
) -> LoadedModel:
    """Build the model for `path` (default: the embedded SmolLM2 GGUF) and load its weights;
    `max_positions` bounds the RoPE table (default: the model's whole context).
    FileNotFoundError: no such path (or the default model is not installed). ValueError: a
    corrupt file or an unsupported architecture / quantisation."""
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(
            f"LLM: model path does not exist (got {str(resolved)!r}, expected a .gguf file or "
            "a Hugging Face folder with config.json and *.safetensors)."
        )
    config, weights, tokenizer = read_model(resolved, dtype)
    model = build_model(
        config,
        dtype=dtype,
        device=device,
        block_size=block_size,
        backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        max_positions=min(config.max_position_embeddings, max_positions or 1 << 62),
    )
    model.load_weights(_with_progress(weights, f"loading {resolved.name}"))
    model.eval()
    return LoadedModel(model, config, tokenizer, resolved)
