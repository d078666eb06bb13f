"""DecodeLayouts on the CPU (the PyTorch path of paged_kv_layout; the kernel and its bound
launch are tested in tests/ops/test_paged_kv_layout.py): every layout equal to the plain-Python
reference, eager layouts taking the ring's buffers in turn and going stale when the ring comes
round or a buffer is grown, CUDA-graph layouts made in their size's fixed buffers, and the
rejected inputs."""

from __future__ import annotations

import pytest
import torch

from anyattn.backends.flashinfer_layouts import RING, DecodeLayouts
from anyattn.ops.paged_kv_layout import paged_kv_layout_ref

BLOCK = 16
TABLE = torch.randperm(400, generator=torch.Generator().manual_seed(0))[:320].int().view(8, 40)


def layouts(max_num_reqs: int = 8, max_pages: int = 40) -> DecodeLayouts:
    return DecodeLayouts(torch.device("cpu"), BLOCK, max_num_reqs, max_pages)


def check(layout, seq_lens: list[int], rows: int | None = None) -> None:
    """`layout` is the reference's for `seq_lens` (padded to `rows`)."""
    n = len(seq_lens)
    rows = n if rows is None else rows
    seq = torch.tensor(seq_lens + [0] * (8 - n), dtype=torch.int32)
    indptr, last, pages = paged_kv_layout_ref(TABLE, seq, rows, block_size=BLOCK, num_reqs=n)
    assert layout.indptr.tolist() == indptr and layout.last_page_len.tolist() == last
    assert layout.indices[: len(pages)].tolist() == pages
    assert layout.num_reqs == rows and layout.max_seq_len == max(seq_lens, default=0)


def make(maker: DecodeLayouts, seq_lens: list[int], generation: int, **kwargs):
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return maker.make(TABLE, seq, len(seq_lens), max(seq_lens), generation, **kwargs)


def test_eager_layouts_take_the_ring_in_turn() -> None:
    maker = layouts()
    batches = [[40 + 16 * i, 3, 70, 17] for i in range(RING + 2)]
    made = [make(maker, lens, generation) for generation, lens in enumerate(batches, 1)]
    assert [layout.home for layout in made] == [("eager", i % RING) for i in range(RING + 2)]
    assert [maker.is_current(layout) for layout in made] == [False] * 2 + [True] * RING
    for layout, lens in list(zip(made, batches, strict=True))[2:]:
        check(layout, lens)


def test_a_batch_past_a_ring_buffer_grows_it_and_the_buffers_older_layout_goes_stale() -> None:
    maker = layouts(max_num_reqs=2)
    small = make(maker, [17, 3], 1)
    for generation in range(2, RING + 1):
        make(maker, [17, 3], generation)
    lens = [600, 30, 80, 17, 5, 9]  # more requests and pages than ring buffer 0 holds
    grown = make(maker, lens, RING + 1)
    assert grown.home == small.home and not maker.is_current(small)
    check(grown, lens)
    check(small, [17, 3])  # its memory is its own still (only the ring moved on)


def test_graph_layouts_are_made_in_their_sizes_fixed_buffers() -> None:
    maker = layouts()
    buffers = maker.graph_buffers(6)
    assert maker.graph_buffers(6)[0] is buffers[0]
    assert buffers[0].tolist() == [0] * 7 and buffers[1].tolist() == [1] * 6
    assert buffers[2].shape == (6 * 40,)
    first = make(maker, [40, 3, 70], 1, cudagraph_size=6)
    assert (first.indptr, first.last_page_len, first.indices) == buffers
    check(first, [40, 3, 70], rows=6)  # three padding requests: no pages, last page 1
    second = make(maker, [5, 600], 2, cudagraph_size=6)
    assert not maker.is_current(first) and maker.is_current(second)
    check(second, [5, 600], rows=6)


def test_own_memory_is_never_taken_by_a_later_layout() -> None:
    maker = layouts()
    own = make(maker, [40, 3], 1, own_memory=True)
    for generation in range(2, 2 + 2 * RING):
        make(maker, [17, 50, 9], generation)
    assert own.home is None and maker.is_current(own)
    check(own, [40, 3])


@pytest.mark.parametrize(
    ("seq_lens", "match"),
    [
        (torch.tensor([3, 4], dtype=torch.int64), "seq_lens must be int32 \\[num_reqs\\]"),
        (torch.tensor([[3, 4]], dtype=torch.int32), "seq_lens must be int32 \\[num_reqs\\]"),
        (torch.tensor([3], dtype=torch.int32), "seq_lens must be int32 \\[num_reqs\\]"),
    ],
    ids=["int64", "2-D", "too short"],
)
def test_rejected_lengths_write_nothing(seq_lens, match) -> None:
    maker = layouts()
    before = [b.clone() for b in maker.graph_buffers(4)]
    with pytest.raises(ValueError, match="^FlashInferMetadataBuilder.build: " + match):
        maker.make(TABLE, seq_lens, 2, 4, 1, cudagraph_size=4)
    assert all(torch.equal(b, a) for b, a in zip(maker.graph_buffers(4), before, strict=True))


def test_a_graph_step_longer_than_its_buffers_hold_is_refused() -> None:
    maker = layouts(max_pages=4)
    with pytest.raises(ValueError, match="more pages per request than max_model_len allows"):
        make(maker, [5, 4 * BLOCK + 1], 1, cudagraph_size=2)
