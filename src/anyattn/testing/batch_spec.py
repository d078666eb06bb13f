"""Batch shapes the conformance kit runs: `BatchSpec` and the curated catalogue.

A `BatchSpec` says, per request, how many new tokens this step brings (`query_lens`) and how long
the sequence is once they are added (`seq_lens`, context + new tokens). Requests are listed in the
order they enter the batch; the kit reorders them itself when a builder asks for decodes first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from anyattn.metadata import apply_swaps, reorder_batch_to_split_decodes_and_prefills

__all__ = ["CATALOGUE", "QUICK_CATALOGUE", "BatchSpec", "get_spec"]


@dataclass(frozen=True, slots=True)
class BatchSpec:
    """One step's batch layout.

    Attributes:
        name: a short identifier used in reports ("mixed", "odd_lengths", ...).
        query_lens: new tokens per request, each >= 1.
        seq_lens: context + new tokens per request, each >= its query length.
        encoder_seq_lens: encoder tokens per request (cross attention), else None. A request
            whose decoder has no context yet (`seq_len == query_len`) is at its first step: its
            encoder K/V arrive with this step and are written by the backend; later requests
            read encoder K/V already in the cache.
        common_prefix_len: leading tokens every request shares in the same physical KV blocks
            (cascade attention); must not exceed any request's context.
    """

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    encoder_seq_lens: tuple[int, ...] | None = None
    common_prefix_len: int = 0

    def __post_init__(self) -> None:
        api = f"BatchSpec({self.name!r})"
        object.__setattr__(self, "query_lens", tuple(int(n) for n in self.query_lens))
        object.__setattr__(self, "seq_lens", tuple(int(n) for n in self.seq_lens))
        if not self.query_lens:
            raise ValueError(f"{api}: needs at least one request (got no query_lens).")
        if len(self.query_lens) != len(self.seq_lens):
            raise ValueError(
                f"{api}: query_lens and seq_lens differ in length (got {len(self.query_lens)} "
                f"and {len(self.seq_lens)})."
            )
        for q, s in zip(self.query_lens, self.seq_lens, strict=True):
            if q < 1 or s < q:
                raise ValueError(
                    f"{api}: each request needs 1 <= query_len <= seq_len (got query_len={q}, "
                    f"seq_len={s})."
                )
        if self.encoder_seq_lens is not None:
            enc = tuple(int(n) for n in self.encoder_seq_lens)
            object.__setattr__(self, "encoder_seq_lens", enc)
            if len(enc) != len(self.query_lens) or min(enc) < 1:
                raise ValueError(
                    f"{api}: encoder_seq_lens needs one length >= 1 per request (got {enc})."
                )
        if self.common_prefix_len < 0 or self.common_prefix_len > min(self.context_lens):
            raise ValueError(
                f"{api}: common_prefix_len must lie in [0, shortest context] (got "
                f"{self.common_prefix_len}, shortest context {min(self.context_lens)})."
            )

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """Query tokens of the step (the flat token dimension)."""
        return sum(self.query_lens)

    @property
    def context_lens(self) -> tuple[int, ...]:
        """Tokens already in the cache before this step, per request."""
        return tuple(s - q for q, s in zip(self.query_lens, self.seq_lens, strict=True))

    @property
    def is_first_step(self) -> tuple[bool, ...]:
        """Per request: no decoder context yet (cross attention writes encoder K/V now)."""
        return tuple(c == 0 for c in self.context_lens)

    def decodes_first_order(self, decode_threshold: int | None) -> list[int]:
        """Request indices in the order an engine runs them for a builder whose
        `reorder_batch_threshold` is `decode_threshold`: decodes first, by the fewest swaps
        (`anyattn.metadata.reorder_batch_to_split_decodes_and_prefills`); as listed for None."""
        order = list(range(self.num_reqs))
        if decode_threshold is not None:
            swaps = reorder_batch_to_split_decodes_and_prefills(self.query_lens, decode_threshold)
            apply_swaps(order, swaps)
        return order

    def permuted(self, order: list[int]) -> BatchSpec:
        """The same batch with request `order[i]` placed at position i."""
        enc = self.encoder_seq_lens
        return replace(
            self,
            query_lens=tuple(self.query_lens[i] for i in order),
            seq_lens=tuple(self.seq_lens[i] for i in order),
            encoder_seq_lens=None if enc is None else tuple(enc[i] for i in order),
        )


def _cascade(name: str, num_reqs: int, prefix_len: int) -> BatchSpec:
    # Mostly decodes with a few short prefill chunks, each with a distinct suffix after the
    # shared prefix so that no two requests read the same keys past it.
    query_lens = tuple(1 if r % 4 else 2 + r % 7 for r in range(num_reqs))
    suffixes = tuple(q + 1 + (r * 7) % 23 for r, q in enumerate(query_lens))
    seq_lens = tuple(prefix_len + s for s in suffixes)
    return BatchSpec(name, query_lens, seq_lens, common_prefix_len=prefix_len)


# Requests are deliberately interleaved (decodes between prefills) so that a builder asking for
# decodes first really gets its batch reordered, and one that does not sees a mixed order.
CATALOGUE: tuple[BatchSpec, ...] = (
    BatchSpec("single_decode", (1,), (97,)),
    BatchSpec("many_decodes", (1,) * 8, (1, 7, 16, 17, 33, 64, 97, 200)),
    BatchSpec("long_prefill", (1025,), (1025,)),
    BatchSpec("mixed", (1, 17, 1, 5, 33, 1), (40, 17, 1, 70, 33, 129)),
    BatchSpec("chunked_prefill", (64, 1, 31), (700, 50, 159)),
    BatchSpec("odd_lengths", (1, 3, 97, 33), (1, 7, 97, 1025)),
    BatchSpec("encoder", (7, 1, 97, 16), (7, 1, 97, 16)),
    BatchSpec("encoder_decoder", (1, 5, 1, 2), (1, 5, 9, 40), encoder_seq_lens=(7, 97, 16, 1)),
    # Encoders longer than 1024 keys behind decodes, first steps and a chunk.
    BatchSpec(
        "cross_attention_long",
        (1, 1, 1, 20),
        (201, 1, 1, 220),
        encoder_seq_lens=(1100, 1027, 434, 1026),
    ),
    _cascade("cascade", 16, 512),
)
"""The full catalogue, used by `check_backend(..., quick=False)`."""

QUICK_CATALOGUE: tuple[BatchSpec, ...] = (
    BatchSpec("single_decode", (1,), (33,)),
    BatchSpec("many_decodes", (1,) * 5, (1, 7, 16, 17, 33)),
    BatchSpec("long_prefill", (65,), (65,)),
    BatchSpec("mixed", (1, 17, 1, 5), (40, 17, 1, 21)),
    BatchSpec("chunked_prefill", (16, 1, 7), (80, 9, 40)),
    BatchSpec("odd_lengths", (1, 3, 33, 9), (1, 7, 33, 65)),
    BatchSpec("encoder", (7, 1, 17), (7, 1, 17)),
    BatchSpec("encoder_decoder", (1, 5, 1, 2), (1, 5, 9, 40), encoder_seq_lens=(7, 17, 16, 1)),
    BatchSpec(
        "cross_attention_long", (1, 1, 1, 5), (21, 1, 1, 25), encoder_seq_lens=(70, 67, 34, 66)
    ),
    _cascade("cascade", 4, 64),
)
"""Small versions of the same shapes, for slow kernels (e.g. the Triton interpreter)."""


def get_spec(name: str, quick: bool = False) -> BatchSpec:
    """The catalogue entry called `name` (from `QUICK_CATALOGUE` when `quick`).

    Raises:
        KeyError: no entry has that name.
    """
    for spec in QUICK_CATALOGUE if quick else CATALOGUE:
        if spec.name == name:
            return spec
    names = ", ".join(s.name for s in CATALOGUE)
    raise KeyError(f"get_spec: no catalogue entry {name!r} (expected one of {names}).")
