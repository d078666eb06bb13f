"""What `LLM(backend=...)` asks for (see `LLM` and docs/per_phase.md: None, a backend name or
class, a decode/prefill pair, or "fastest"), and moving the loaded model's layers onto it."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from anyattn.backend import AttentionBackend
from anyattn.config import BatchLimits
from anyattn.registry import get_backend_class
from anyattn.selector import ENV_VAR, FASTEST, measure_backends

logger = logging.getLogger(__name__)

__all__ = ["BackendRequest", "parse_backend_request", "use_backend_pair", "use_fastest_backends"]

BackendArg = str | type[AttentionBackend]


@dataclass(frozen=True, slots=True)
class BackendRequest:
    """A parsed `backend` argument: `backend`, the single or decode backend the model is loaded
    with (None: the selector's, also for "fastest", chosen after the load); `prefill_backend`,
    a pair's prefill backend; `is_fastest`: measure and choose."""

    backend: BackendArg | None
    prefill_backend: BackendArg | None = None
    is_fastest: bool = False


def _pair(values: Sequence[object], source: str) -> BackendRequest:
    if len(values) != 2 or not all(
        isinstance(v, type) or (isinstance(v, str) and v.strip()) for v in values
    ):
        raise ValueError(
            f"{source}: a backend pair is two backend names or classes, decode then prefill "
            f"(got {values!r}, expected e.g. ('TRITON', 'FLASHINFER') or 'TRITON,FLASHINFER')."
        )
    decode, prefill = (v.strip() if isinstance(v, str) else v for v in values)
    for value in (decode, prefill):
        if isinstance(value, str) and value.lower() == FASTEST:
            raise ValueError(
                f"{source}: 'fastest' chooses both phases itself (got it in the pair {values!r})."
            )
    return BackendRequest(decode, prefill)


def parse_backend_request(backend: object) -> BackendRequest:
    """Parse `LLM`'s `backend` argument (None: `$ANYATTN_BACKEND` for "fastest" or a pair).
    TypeError: not a name, a backend class, a pair of them, or None; ValueError: a pair that is
    not two names or classes."""
    source = "LLM: backend"
    if backend is None:
        backend, source = os.environ.get(ENV_VAR, "").strip(), ENV_VAR
        if backend.lower() != FASTEST and "," not in backend:
            return BackendRequest(None)  # the selector reads the variable itself
    if isinstance(backend, str):
        if backend.strip().lower() == FASTEST:
            return BackendRequest(None, is_fastest=True)
        return _pair(backend.split(","), source) if "," in backend else BackendRequest(backend)
    if isinstance(backend, type):
        return BackendRequest(backend)
    if isinstance(backend, tuple | list):
        return _pair(list(backend), source)
    raise TypeError(
        f"{source} must be a backend name, a backend class, a (decode, prefill) pair of them, "
        f"or 'fastest' (got {type(backend).__name__})."
    )


def _as_class(backend: BackendArg) -> type[AttentionBackend]:
    return backend if isinstance(backend, type) else get_backend_class(backend)


def use_backend_pair(model: torch.nn.Module, prefill_backend: BackendArg) -> str:
    """Run every attention layer's prefill rows on `prefill_backend` (decodes stay on the
    loaded backend); returns a note for the log. ValueError: an MLA layer (one backend only),
    or a layer whose two backends cannot share its cache (`Attention.use_backend` says why)."""
    prefill = _as_class(prefill_backend)
    layers = list(model.attention_layers())
    for layer in layers:
        if layer.config.use_mla:
            raise ValueError(
                f"LLM: backend pair for MLA layer {layer.layer_name!r} (got decode "
                f"{layer.backend.get_name()}, prefill {prefill.get_name()}; MLA layers run one "
                "backend for every phase). Pass one MLA backend name."
            )
    for layer in layers:
        layer.use_backend(layer.backend, prefill_backend=prefill)
    decode = ", ".join(sorted({layer.backend.get_name() for layer in layers}))
    return f"decodes on {decode}, prefills on {prefill.get_name()} (requested)"


def use_fastest_backends(
    model: torch.nn.Module, device: torch.device, limits: BatchLimits
) -> list[str]:
    """Measure each distinct layer config under the engine's limits (cached on disk) and move
    its layers onto the choice: the decode and prefill choices as a pair when the measurement
    says so (`Measurement.phase_pair`), else the overall one. Returns one note per config
    (`Measurement.pair_note`), also logged."""
    notes: list[str] = []
    chosen: dict[object, tuple[type[AttentionBackend], type[AttentionBackend] | None]] = {}
    layers = list(model.attention_layers())
    # The layers of a config share one metadata build per step (a KV-cache group): the
    # measurement weighs each build over them.
    per_config = Counter(layer.config for layer in layers)
    for layer in layers:
        if layer.config not in chosen:
            measured = measure_backends(
                layer.config,
                limits,
                device,
                layer_params=layer.impl.layer_params(),
                progress=True,
                layers_per_step=per_config[layer.config],
            )
            decode, prefill = measured.phase_pair or (measured.overall, None)
            prefill_cls = None if prefill is None else get_backend_class(prefill)
            chosen[layer.config] = (get_backend_class(decode), prefill_cls)
            notes.append(f"{layer.layer_name} (and layers like it): {measured.pair_note()}")
            logger.info("measured backends: %s", notes[-1])
        backend, prefill = chosen[layer.config]
        if prefill is not None:
            layer.use_backend(backend, prefill_backend=prefill)
        elif layer.backend is not backend:
            layer.use_backend(backend)
    return notes
