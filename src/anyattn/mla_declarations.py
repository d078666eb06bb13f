"""The MLA part of a backend's declarations, judged against an `AttentionSelectorConfig`
(docs/mla.md, "Selection"): the latent split `head_size = kv_lora_rank + qk_rope_head_dim`
and the up-projected path's head sizes (Q/K rows `qk_nope_head_dim + qk_rope_head_dim`, V rows
`v_head_dim`). `AttentionBackend.validate_configuration` adds these reasons for MLA configs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from anyattn.config import AttentionSelectorConfig

__all__ = ["format_mla_splits", "mla_reasons"]


class _MLADeclarations(Protocol):
    """What the reasons read of an `AttentionBackend` class."""

    @classmethod
    def get_supported_mla_splits(cls) -> list[tuple[int, int]]: ...

    @classmethod
    def supports_mla_split(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> bool: ...


def format_mla_splits(splits: Sequence[tuple[int, int]]) -> str:
    """Latent splits as `kv_lora_rank+qk_rope_head_dim` text: `[(512, 64)]` reads "512+64",
    every rank 16, 32, ..., 512 with every rope 16, 32, 64 "{16, 32, ..., 512}+{16, 32, 64}";
    other sets list each rope size's ranks."""
    by_rope: dict[int, list[int]] = {}
    for rank, rope in splits:
        by_rope.setdefault(rope, []).append(rank)
    rank_sets = {tuple(sorted(set(ranks))) for ranks in by_rope.values()}
    if len(rank_sets) == 1:
        return f"{_format_ints(next(iter(rank_sets)))}+{_format_ints(sorted(by_rope))}"
    return ", ".join(
        f"{_format_ints(sorted(set(ranks)))}+{rope}" for rope, ranks in by_rope.items()
    )


def _format_ints(values: Sequence[int]) -> str:
    """One value as is; several in braces, an arithmetic run from its step (16, 32, ..., 512)
    shortened with an ellipsis."""
    if len(values) == 1:
        return str(values[0])
    step = values[0]
    if len(values) > 3 and all(v == step * (i + 1) for i, v in enumerate(values)):
        return f"{{{values[0]}, {values[1]}, ..., {values[-1]}}}"
    return "{" + ", ".join(str(v) for v in values) + "}"


def mla_reasons(cls: _MLADeclarations, config: AttentionSelectorConfig) -> list[str]:
    """Why the MLA backend `cls` cannot serve the MLA `config`'s sizes; empty when it can."""
    reasons = [_split_reason(cls, config)]
    if (head_dims := getattr(cls, "get_mla_head_dims_reason", None)) is not None:
        reasons.append(
            head_dims(config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
        )
    return [reason for reason in reasons if reason is not None]


def _split_reason(cls: _MLADeclarations, config: AttentionSelectorConfig) -> str | None:
    """Why an MLA backend does not take the config's latent split `head_size = L + R`, or None.

    One `head_size` may split several ways (576 = 512 + 64 or 448 + 128), so a backend that
    declares splits needs `qk_rope_head_dim` to judge."""
    splits = cls.get_supported_mla_splits()
    if not splits:
        return None
    rope = config.qk_rope_head_dim
    if rope is None:
        return (
            f"MLA latent split of head_size {config.head_size} unknown (qk_rope_head_dim not "
            f"given; supported kv_lora_rank+qk_rope_head_dim: {format_mla_splits(splits)})"
        )
    if not cls.supports_mla_split(config.head_size - rope, rope):
        return (
            f"MLA latent split {config.head_size - rope}+{rope} not supported (supported "
            f"kv_lora_rank+qk_rope_head_dim: {format_mla_splits(splits)})"
        )
    return None
