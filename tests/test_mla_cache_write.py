"""concat_and_cache_mla: exact bytes against its reference and against the standard write of the
same rows (fp8 rounding shared), padding skipped, other slots untouched, inputs unchanged, and
every refused call writes nothing."""

from __future__ import annotations

import pytest
import torch

from anyattn.ops.concat_and_cache_mla import concat_and_cache_mla, concat_and_cache_mla_ref
from anyattn.ops.reshape_and_cache import reshape_and_cache
from anyattn.types import cache_torch_dtype, is_fp8_cache

CACHE_DTYPES = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
L, R, BLOCK, NUM_BLOCKS = 16, 8, 4, 9


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _inputs(dtype, cache_dtype, num_tokens=11, num_padding=3, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Values spanning fp8's range, out of it, and exact ties of e4m3 (1 + 1/16 lies halfway).
    kv_c = (torch.randn(num_tokens, L, generator=gen) * 30).to(dtype)
    k_pe = torch.randn(num_tokens, R, generator=gen).to(dtype)
    kv_c[0, :4] = torch.tensor([1e6, -1e6, 1 + 1 / 16, 0.0]).to(dtype)
    # Slots in shuffled blocks 1.. (block 0 is the null block), tokens shuffled, some padding.
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1
    token = torch.randperm(num_tokens, generator=gen)
    slots = blocks[token // BLOCK] * BLOCK + token % BLOCK
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    cache = torch.randn(NUM_BLOCKS, BLOCK, L + R, generator=gen)
    cache = cache.to(cache_torch_dtype(cache_dtype, dtype))
    scale = torch.tensor(0.5) if is_fp8_cache(cache_dtype) else None
    return [t.to(device) if t is not None else None for t in (kv_c, k_pe, cache, slots, scale)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_write_is_exact(dtype, cache_dtype):
    kv_c, k_pe, cache, slots, scale = _inputs(dtype, cache_dtype)
    before = cache.clone()
    inputs = [kv_c.clone(), k_pe.clone(), slots.clone()]
    expected = cache.clone()
    concat_and_cache_mla_ref(kv_c, k_pe, expected, slots, cache_dtype, scale)
    concat_and_cache_mla(kv_c, k_pe, cache, slots, cache_dtype, scale)
    assert torch.equal(_bits(cache), _bits(expected))
    for given, kept in zip((kv_c, k_pe, slots), inputs, strict=True):
        assert torch.equal(given, kept)  # the caller's tensors are not modified
    # Only the real tokens' slots changed; each holds [kv_c, k_pe] as the standard write (one
    # KV head) stores the same row.
    real = slots >= 0
    written = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    written[slots[real]] = True
    flat, flat_before = _bits(cache).reshape(-1, L + R), _bits(before).reshape(-1, L + R)
    assert torch.equal(flat[~written], flat_before[~written])
    rows = torch.cat([kv_c, k_pe], -1)[real][:, None]  # [n, 1, L + R]
    standard = torch.zeros(NUM_BLOCKS, 2, BLOCK, 1, L + R, dtype=cache.dtype)
    scales = (scale, scale) if scale is not None else (None, None)
    reshape_and_cache(rows, rows, standard, slots[real], cache_dtype, *scales, impl="torch")
    stored = _bits(cache)[slots[real] // BLOCK, slots[real] % BLOCK]
    assert torch.equal(stored, _bits(standard[:, 0]).reshape(-1, L + R)[slots[real]])
    if scale is not None:  # and in range, by the rule `(x.float() / scale).to(fp8)` itself
        values = torch.cat([kv_c, k_pe], -1)[real].float() / scale
        in_range = values.abs() <= torch.finfo(cache.dtype).max
        assert torch.equal(stored[in_range], _bits(values.to(cache.dtype))[in_range])


def _call(kv_c, k_pe, cache, slots, cache_dtype="auto", scale=None):
    concat_and_cache_mla(kv_c, k_pe, cache, slots, cache_dtype, scale)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda a: a.update(slots=a["slots"].clone().fill_(5)), ValueError,
         r"slot_mapping gives the same slot to two tokens \(got slot 5 twice"),
        (lambda a: a["slots"].__setitem__(0, NUM_BLOCKS * BLOCK), ValueError,
         r"slot_mapping has a slot out of range at entry 0 \(got 36, expected -1 for padding "
         r"or 0 <= slot"),
        (lambda a: a.update(cache=torch.zeros(NUM_BLOCKS, 2, BLOCK, 1, L + R)), ValueError,
         r"kv_cache must be an MLA latent cache \(num_blocks, block_size, kv_lora_rank \+ "
         r"qk_rope_head_dim = 24\) \(got \[9, 2, 4, 1, 24\]\)"),
        (lambda a: a.update(k_pe=a["k_pe"][:, :4]), ValueError,
         r"kv_cache must be an MLA latent cache .* = 20\) \(got \[9, 4, 24\]\)"),
        (lambda a: a.update(k_pe=a["k_pe"][None]), ValueError,
         r"kv_c must be \[num_tokens, kv_lora_rank\] and k_pe \[num_tokens, "
         r"qk_rope_head_dim\] \(got \[11, 16\] and \[1, 11, 8\]\)"),
        (lambda a: a.update(k_pe=a["k_pe"].half()), TypeError,
         r"kv_c and k_pe must share one dtype .* \(got torch.float32 and torch.float16\)"),
        (lambda a: a.update(cache_dtype="fp8", cache=a["cache"].to(torch.float8_e4m3fn)),
         ValueError, r"scale is required for an fp8 cache \(got None"),
        (lambda a: a.update(cache_dtype="fp8", cache=a["cache"].to(torch.float8_e4m3fn),
                            scale=torch.tensor(0.0)), ValueError,
         r"scale has a bad value for an fp8 cache"),
        (lambda a: a.update(scale=torch.tensor(2.0)), ValueError,
         r"scale is not 1 for a non-fp8 cache"),
        (lambda a: a.update(scale=torch.tensor([1.0, 1.0])), ValueError,
         r"scale has the wrong shape \(got \[2\], expected \[\] per tensor or \[1\]"),
        (lambda a: a.update(cache_dtype="bfloat16"), TypeError,
         r"kv_cache has the wrong dtype for kv_cache_dtype='bfloat16' \(got torch.float32, "
         r"expected torch.bfloat16\)"),
        (lambda a: a.update(slots=a["slots"].int()), TypeError,
         r"slot_mapping has the wrong dtype \(got torch.int32, expected torch.int64\)"),
    ],
)  # fmt: skip
def test_refused_calls_write_nothing(change, error, message):
    kv_c, k_pe, cache, slots, _ = _inputs(torch.float32, "auto")
    args = {"kv_c": kv_c, "k_pe": k_pe, "cache": cache, "slots": slots, "cache_dtype": "auto",
            "scale": None}  # fmt: skip
    change(args)
    before = args["cache"].clone()
    with pytest.raises(error, match=r"^concat_and_cache_mla: " + message):
        _call(args["kv_c"], args["k_pe"], args["cache"], args["slots"], args["cache_dtype"],
              args["scale"])  # fmt: skip
    assert torch.equal(_bits(args["cache"]), _bits(before))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_e4m3"])
def test_write_on_cuda_matches_reference(cache_dtype):
    for num_padding in (0, 3, 11):  # padding skipped without a host sync, even all padding
        kv_c, k_pe, cache, slots, scale = _inputs(torch.bfloat16, cache_dtype, device="cuda",
                                                  num_padding=num_padding)  # fmt: skip
        expected = cache.cpu()
        concat_and_cache_mla_ref(kv_c.cpu(), k_pe.cpu(), expected, slots.cpu(), cache_dtype,
                                 None if scale is None else scale.cpu())  # fmt: skip
        concat_and_cache_mla(kv_c, k_pe, cache, slots, cache_dtype, scale)
        assert torch.equal(_bits(cache.cpu()), _bits(expected))
