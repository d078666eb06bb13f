"""Every MLA backend refuses a bad block id before anything is written: a negative id, one at
the cache's end and one far past it, in a column the step only reads (cached context), through
`MLAAttention.forward`; the latent cache stays bit-identical. The standard backends' version of
this test is in `test_validation.py`; the message comes from `anyattn.validation`."""

from __future__ import annotations

import pytest
import torch

from anyattn import BatchLimits, MLAAttention
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.registry import get_backend_class

# DeepSeek-V2/V3's split (the one every MLA backend takes), few heads, a small hidden size.
SIZES = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
HIDDEN, HEADS, BLOCK = 64, 16, 16
LIMITS = BatchLimits(max_num_reqs=4, max_num_tokens=64, max_model_len=256)
# Two decodes and a chunk of 5 new tokens after 40 cached ones: its columns 0-2 are only read.
QUERY_LENS, SEQ_LENS = [1, 1, 5], [20, 33, 45]

_PARAMS = [
    pytest.param("TORCH_MLA", "cpu", torch.float32, id="TORCH_MLA-cpu"),
    pytest.param("TRITON_MLA", "cuda", torch.bfloat16, id="TRITON_MLA-cuda", marks=pytest.mark.gpu),
    pytest.param(
        "FLASHINFER_MLA", "cuda", torch.bfloat16, id="FLASHINFER_MLA-cuda", marks=pytest.mark.gpu
    ),
]


@pytest.mark.parametrize("bad", [-3, "num_blocks", 10**6])
@pytest.mark.parametrize(("name", "device", "dtype"), _PARAMS)
def test_a_bad_block_id_in_a_read_only_column_is_refused_before_any_write(name, device, dtype, bad):
    backend = get_backend_class(name)
    if (reason := backend.get_unavailable_reason()) is not None:
        pytest.skip(f"{name}: {reason}")
    layer = MLAAttention(
        HIDDEN, HEADS, **SIZES, scale=0.1, dtype=dtype, layer_name="mla", block_size=BLOCK,
        backend=name, device=device,
    )  # fmt: skip
    num_blocks = 16  # more than the 12 entries of the table
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks - 1, generator=gen)[: 3 * 4].view(3, 4).int() + 1
    bad = num_blocks if bad == "num_blocks" else bad
    table[2, 1] = bad  # request 2's 40 cached keys fill columns 0-2
    cache = allocate_kv_cache(
        layer.backend, num_blocks, BLOCK, 1, SIZES["kv_lora_rank"] + SIZES["qk_rope_head_dim"],
        dtype, "auto", device=device,
    )  # fmt: skip
    cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    builder = layer.backend.get_builder_cls()(
        layer.kv_cache_spec(), {"mla": layer.impl.layer_params()}, LIMITS, torch.device(device)
    )
    md = builder.build(0, make_common_attn_metadata(QUERY_LENS, SEQ_LENS, table, BLOCK, device))
    hidden = torch.randn(sum(QUERY_LENS), HIDDEN, generator=gen).to(dtype=dtype, device=device)
    before = cache.clone()

    def rope(q_pe: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q_pe, k_pe

    with pytest.raises(
        ValueError,
        match=rf"block_table_tensor has a block outside the cache for request 2, column 1 "
        rf"\(got {bad}, expected 0 <= block < num_blocks = {num_blocks}",
    ):
        layer(hidden, rope, cache, md)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
