"""The steps a measured selection times, derived from the engine's `BatchLimits`: decode steps,
one prefill step and one mixed step, decodes first in each (docs/measured_selection.md, "The
steps", gives the shapes and how they are clipped to the limits)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.types import AttentionType

__all__ = ["DECODE_CONTEXT", "MeasureStep", "Phase", "measurement_steps"]

# The short decode context of the recipe ("contexts of 1k and max_model_len/2").
DECODE_CONTEXT = 1024


class Phase(enum.StrEnum):
    """The kind of step a backend is chosen for."""

    DECODE = "decode"
    PREFILL = "prefill"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class MeasureStep:
    """One timed step: per request its new tokens and its length after them.

    Attributes:
        name: unique within a run, e.g. "decode/4x2048".
        phase: the phase whose choice the step counts towards.
        query_lens: new tokens per request, decodes first.
        seq_lens: context + new tokens per request.
    """

    name: str
    phase: Phase
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def describe(self) -> str:
        """A one-line summary, e.g. "64 requests, 64 new tokens, contexts 2047"."""
        contexts = sorted({s - q for q, s in zip(self.query_lens, self.seq_lens, strict=True)})
        shown = ", ".join(str(c) for c in contexts[:3]) + (", ..." if len(contexts) > 3 else "")
        requests = "1 request" if self.num_reqs == 1 else f"{self.num_reqs} requests"
        tokens = "1 new token" if self.num_tokens == 1 else f"{self.num_tokens} new tokens"
        return f"{requests}, {tokens}, context{'s' if len(contexts) > 1 else ''} {shown}"

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self) | {"phase": self.phase.value}

    @staticmethod
    def from_dict(data: dict[str, object]) -> MeasureStep:
        lens = (tuple(int(n) for n in data[k]) for k in ("query_lens", "seq_lens"))  # type: ignore[attr-defined]
        return MeasureStep(str(data["name"]), Phase(data["phase"]), *lens)


def _decode_steps(limits: BatchLimits, decode_len: int) -> list[MeasureStep]:
    most = min(limits.max_num_reqs, limits.max_num_tokens // decode_len)
    if most < 1:
        return []
    batches = dict.fromkeys((1, max(1, most // 4), most))
    longest = limits.max_model_len - decode_len
    contexts = dict.fromkeys(min(c, longest) for c in (DECODE_CONTEXT, limits.max_model_len // 2))
    return [
        MeasureStep(f"decode/{n}x{c}", Phase.DECODE, (decode_len,) * n, (c + decode_len,) * n)
        for n in batches
        for c in contexts
    ]


def _prefill_step(limits: BatchLimits) -> MeasureStep:
    per_request = min(limits.max_num_tokens, limits.max_model_len)
    num_reqs = min(limits.max_num_reqs, -(-limits.max_num_tokens // per_request))
    total = min(limits.max_num_tokens, num_reqs * per_request)
    whole, rest = divmod(total, per_request)
    lens = [per_request] * whole + ([rest] if rest else [])
    return MeasureStep(f"prefill/{total}", Phase.PREFILL, tuple(lens), tuple(lens))


def _mixed_step(limits: BatchLimits, decode_len: int) -> MeasureStep:
    # Room for at least one chunk token and one chunk request besides the decodes.
    # One request, or no room: the chunk alone.
    num_decodes = max(
        min(max(1, limits.max_num_reqs // 2), limits.max_num_reqs - 1,
            (limits.max_num_tokens - 1) // decode_len),
        0,
    )  # fmt: skip
    context = min(limits.max_model_len // 2, limits.max_model_len - decode_len)
    budget = limits.max_num_tokens - num_decodes * decode_len
    chunk_context = min(limits.max_model_len // 4, limits.max_model_len - 1)
    chunk = min(budget, limits.max_model_len - chunk_context)
    query_lens = (decode_len,) * num_decodes + (chunk,)
    seq_lens = (context + decode_len,) * num_decodes + (chunk_context + chunk,)
    name = f"mixed/{num_decodes}x{context}+{chunk}@{chunk_context}"
    return MeasureStep(name, Phase.MIXED, query_lens, seq_lens)


def measurement_steps(
    config: AttentionSelectorConfig, limits: BatchLimits
) -> tuple[MeasureStep, ...]:
    """The steps timed for `config` under `limits`, in phase order (decode, prefill, mixed).

    Raises:
        ValueError: `config` is not decoder attention (encoder and cross attention have no
            decode phase; measured selection does not cover them).
    """
    if config.attn_type is not AttentionType.DECODER:
        raise ValueError(
            f"measurement_steps: measured selection covers decoder attention (got attn_type "
            f"{config.attn_type.value}, expected decoder). Use the static order (policy="
            f"'priority') for encoder and cross attention."
        )
    decode_len = 1 + limits.num_speculative_tokens
    steps = [
        *_decode_steps(limits, decode_len),
        _prefill_step(limits),
        _mixed_step(limits, decode_len),
    ]
    unique: dict[tuple[tuple[int, ...], tuple[int, ...]], MeasureStep] = {}
    for step in steps:  # duplicates of small limits: the first one stays
        unique.setdefault((step.query_lens, step.seq_lens), step)
    return tuple(unique.values())
