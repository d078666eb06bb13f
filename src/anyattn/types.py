"""Small value types shared by every part of anyattn (docs/semantics.md, docs/contract.md).
Nothing here touches a device: a hand-written `DeviceInfo` asks "would this work on an H100?"
from a laptop.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = [
    "CACHE_DTYPES",
    "DTYPES",
    "ENCODER_TYPES",
    "AttentionCGSupport",
    "AttentionType",
    "CacheDType",
    "DeviceInfo",
    "KVCacheLayout",
    "MultipleOf",
    "cache_torch_dtype",
    "check_positive_int",
    "is_fp8_cache",
    "parse_cache_dtype",
    "parse_dtype",
]


class AttentionType(enum.StrEnum):
    """What a layer's queries attend to."""

    DECODER = "decoder"
    """Self-attention of a decoder over its paged KV cache (causal unless configured otherwise)."""
    ENCODER = "encoder"
    """Bidirectional self-attention of the encoder of an encoder-decoder model; no KV cache."""
    ENCODER_ONLY = "encoder_only"
    """Bidirectional self-attention of an encoder-only model; no KV cache."""
    ENCODER_DECODER = "encoder_decoder"
    """Cross-attention: decoder queries over the encoder's K/V, kept in the layer's own cache."""


ENCODER_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
"""The attention types with no KV cache: their keys and values are the step's own."""


@functools.total_ordering
class AttentionCGSupport(enum.Enum):
    """How much of a step a backend can run inside a CUDA graph, ordered:
    ALWAYS > UNIFORM_BATCH > UNIFORM_SINGLE_TOKEN_DECODE > NEVER."""

    NEVER = 0
    """No CUDA-graph support."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Batches of decodes with exactly one query token each."""
    UNIFORM_BATCH = 2
    """Batches whose requests all have the same query length (spec-decode: 1 + num draft tokens)."""
    ALWAYS = 3
    """Any batch, mixed prefill and decode included."""

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, AttentionCGSupport):
            return NotImplemented
        return self.value < other.value


@dataclass(frozen=True, slots=True)
class MultipleOf:
    """A kernel block size constraint: any block size that is a multiple of `base`."""

    base: int

    def __post_init__(self) -> None:
        if isinstance(self.base, bool) or not isinstance(self.base, int) or self.base < 1:
            raise ValueError(
                f"MultipleOf: base must be a positive int (got {self.base!r}, expected >= 1)."
            )

    def __str__(self) -> str:
        return f"multiple of {self.base}"


class KVCacheLayout(enum.StrEnum):
    """Physical order inside a KV block, NHD `[block_size, num_kv_heads, head_size]` or HND
    `[num_kv_heads, block_size, head_size]`; the logical shape is the same, the strides differ."""

    NHD = "NHD"
    HND = "HND"


CacheDType = Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
CACHE_DTYPES: tuple[str, ...] = get_args(CacheDType)

_FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def parse_dtype(value: str | torch.dtype, *, argument: str = "dtype") -> torch.dtype:
    """Turn "float16" / "fp16" / torch.float16 into a model dtype; raise a clear error otherwise."""
    if isinstance(value, torch.dtype):
        if value in DTYPES.values():
            return value
        raise ValueError(
            f"{argument}: unsupported model dtype (got {value}, expected one of "
            f"{', '.join(DTYPES)})."
        )
    if isinstance(value, str):
        name = _DTYPE_ALIASES.get(value, value)
        if name in DTYPES:
            return DTYPES[name]
    raise ValueError(
        f"{argument}: unknown dtype (got {value!r}, expected one of "
        f"{', '.join(list(DTYPES) + list(_DTYPE_ALIASES))})."
    )


def parse_cache_dtype(value: str | None, *, argument: str = "kv_cache_dtype") -> CacheDType:
    """Validate a KV-cache dtype string; None means "auto"."""
    if value is None:
        return "auto"
    if isinstance(value, str) and value in CACHE_DTYPES:
        return value  # type: ignore[return-value]
    raise ValueError(
        f"{argument}: unknown KV-cache dtype (got {value!r}, expected one of "
        f"{', '.join(CACHE_DTYPES)})."
    )


def check_positive_int(api: str, name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise `ValueError` ("{api}: {name} must be a positive int (got ...)") unless `value` is
    an int >= 1 (not a bool), or None when `allow_none`."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{api}: {name} must be {expected} (got {value!r}).")


def is_fp8_cache(cache_dtype: str) -> bool:
    """True for the fp8 cache dtypes, whose caches hold `value / scale` cast to fp8."""
    return cache_dtype in _FP8_CACHE_DTYPES


def cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a KV cache: the model dtype for "auto", else the named one."""
    cache_dtype = parse_cache_dtype(cache_dtype)
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in _FP8_CACHE_DTYPES:
        return _FP8_CACHE_DTYPES[cache_dtype]
    return DTYPES[cache_dtype]


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Where attention will run: the CPU, or a CUDA GPU of a given compute capability. Build
    it by hand (`DeviceInfo.cuda(9, 0)`, `DeviceInfo.parse("sm100")`) for hardware you do not
    have, or `DeviceInfo.current()` for this machine."""

    type: Literal["cpu", "cuda"]
    capability: tuple[int, int] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.type not in ("cpu", "cuda"):
            raise ValueError(
                f"DeviceInfo: unknown device type (got {self.type!r}, expected 'cpu' or 'cuda')."
            )
        if self.type == "cuda" and self.capability is None:
            raise ValueError(
                "DeviceInfo: a cuda device needs its compute capability (got None, expected "
                "e.g. (9, 0)). Use DeviceInfo.cuda(9, 0) or DeviceInfo.parse('sm90')."
            )
        if self.type == "cpu" and self.capability is not None:
            raise ValueError(
                f"DeviceInfo: a cpu device has no compute capability (got {self.capability})."
            )

    @staticmethod
    def cpu() -> DeviceInfo:
        return DeviceInfo("cpu")

    @staticmethod
    def cuda(major: int, minor: int = 0, name: str | None = None) -> DeviceInfo:
        return DeviceInfo("cuda", (major, minor), name)

    @staticmethod
    def parse(text: str) -> DeviceInfo:
        """Parse "cpu", "cuda" (this machine's GPU), "sm80", "sm90", "sm100", "sm_89", "9.0"."""
        if not isinstance(text, str):
            raise TypeError(
                f"device: expected text such as 'cpu' or 'sm90' (got {type(text).__name__})."
            )
        spec = text.strip().lower()
        if spec == "cpu":
            return DeviceInfo.cpu()
        if spec == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    "device: 'cuda' names this machine's GPU, but torch sees none (got 'cuda', "
                    "expected cpu or smXY such as sm90)."
                )
            return DeviceInfo.current(torch.device("cuda"))
        digits = spec.removeprefix("sm").lstrip("_")
        if "." in digits:
            major_text, _, minor_text = digits.partition(".")
        else:
            major_text, minor_text = digits[:-1], digits[-1:]
        if major_text.isdigit() and minor_text.isdigit() and 1 <= int(major_text) <= 20:
            return DeviceInfo.cuda(int(major_text), int(minor_text))
        raise ValueError(
            f"device: cannot read a device from {text!r} (expected cpu, cuda, or a compute "
            "capability such as sm80, sm90, sm100, 9.0)."
        )

    @staticmethod
    def current(device: torch.device | str | None = None) -> DeviceInfo:
        """Describe a real device: the given one, else the first CUDA GPU, else the CPU."""
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cpu":
            return DeviceInfo.cpu()
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            major, minor = torch.cuda.get_device_capability(index)
            return DeviceInfo.cuda(major, minor, torch.cuda.get_device_name(index))
        raise ValueError(
            f"DeviceInfo.current: unsupported device type (got {device.type!r}, expected "
            "'cpu' or 'cuda')."
        )

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    def __str__(self) -> str:
        if self.capability is None:
            return "cpu"
        major, minor = self.capability
        label = f"cuda sm{major}{minor}"
        return f"{label} ({self.name})" if self.name else label
