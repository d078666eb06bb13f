"""anyattn.validation: a layer call is checked once, on the host, before the cache is written.

For every backend: a block id outside the cache (negative, or >= num_blocks) in a column a step
only reads is refused with an error naming the request, the column, the value and the range,
before any write (the cache keeps every byte), through the layer and through the impl's entry
points called directly; the caller's tensors are left unchanged, with no attribute added;
columns past a request's keys and rows past the batch may hold anything. TORCH and
FLEX_ATTENTION run here; TRITON runs in a subprocess with `TRITON_INTERPRET=1` (this file run
as a script); every backend runs on the GPU (`-m gpu`), where a layer call is also shown to
read nothing back from the device.
"""

from __future__ import annotations

import dataclasses
import io
import sys
from collections.abc import Callable

import pytest
import torch

from anyattn import validation
from anyattn.backend import AttentionBackend
from anyattn.backends.flex_attention import FlexAttentionBackend
from anyattn.backends.torch_attn import TorchAttentionBackend
from anyattn.backends.triton_attn import TritonAttentionBackend
from anyattn.layer import Attention
from anyattn.registry import get_backend_class
from anyattn.testing import BatchSpec, PagedBatch, build_batch
from anyattn.types import AttentionType

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 128, 16
# A decode over 40 tokens of context (columns 0 and 1 only read, column 2 written) and a chunked
# prefill of 5 tokens after 20 (column 0 only read, column 1 written); the tables get 4 columns.
SPEC = BatchSpec("bad_entries", query_lens=(1, 5), seq_lens=(41, 25))
# Cross attention: encoder keys of 20 (2 columns) and 30 tokens, decoders of 40 and 3 positions.
SPEC_CROSS = BatchSpec("cross", query_lens=(1, 3), seq_lens=(40, 3), encoder_seq_lens=(20, 30))


class InterpretedTriton(TritonAttentionBackend):
    """TRITON's kernels on the CPU through the interpreter (tests only)."""

    supported_device_types = ("cpu", "cuda")


def _step(
    backend: type[AttentionBackend],
    device: str,
    dtype: torch.dtype,
    spec: BatchSpec = SPEC,
    attn_type: AttentionType = AttentionType.DECODER,
) -> tuple[Attention, PagedBatch]:
    """A layer of `backend` and one step for it (the kit's batch: shuffled blocks, context
    written), its block table one column wider than any request reads (that column 0)."""
    layer = Attention(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS, dtype=dtype, block_size=BLOCK,
                      backend=backend, device=device, attn_type=attn_type)  # fmt: skip
    batch = build_batch(backend, spec, num_heads=HEADS, num_kv_heads=KV_HEADS,
                        head_size=HEAD_SIZE, dtype=dtype, device=device, block_size=BLOCK,
                        layers={layer.layer_name: layer.impl.layer_params()},
                        attn_type=attn_type, seed=3)  # fmt: skip
    table = batch.common_attn_metadata.block_table_cpu
    wider = torch.cat([table, torch.zeros(table.shape[0], 1, dtype=table.dtype)], dim=1)
    return layer, _with_table(batch, wider)


def _with_table(batch: PagedBatch, table: torch.Tensor) -> PagedBatch:
    """`batch` built again over `table` (a CPU table; its device copy made here)."""
    common = dataclasses.replace(
        batch.common_attn_metadata,
        block_table_tensor=table.to(batch.kv_cache.device),
        block_table_cpu=table,
    )
    md = batch.builder.build(0, common)
    return dataclasses.replace(batch, common_attn_metadata=common, attn_metadata=md)


def _call(entry: str, layer: Attention, batch: PagedBatch) -> torch.Tensor:
    """One layer call: through the layer, or the impl's entry points called directly."""
    md = batch.attn_metadata
    args = (batch.query, batch.key, batch.value, batch.kv_cache)
    if entry == "layer":
        return layer(*args, md)
    output = torch.empty_like(batch.query)
    if entry == "direct" and batch.key is not None:
        slots = batch.common_attn_metadata.slot_mapping
        layer.impl.do_kv_cache_update(layer, batch.key, batch.value, batch.kv_cache, slots, md)
    return layer.impl.forward(layer, *args, md, output)


def _callers_tensors(batch: PagedBatch) -> dict[str, torch.Tensor]:
    common = batch.common_attn_metadata
    names = ("slot_mapping", "slot_mapping_cpu", "block_table_tensor", "block_table_cpu",
             "query_start_loc", "seq_lens", "seq_lens_cpu")  # fmt: skip
    tensors = {name: getattr(common, name) for name in names}
    tensors |= {"query": batch.query, "key": batch.key, "value": batch.value}
    return {name: t for name, t in tensors.items() if t is not None}


def _assert_left_alone(tensors: dict[str, torch.Tensor], copies: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        assert torch.equal(tensor, copies[name]), f"{name} changed"
        assert vars(tensor) == {}, f"{name} got attributes {sorted(vars(tensor))}"
        buffer = io.BytesIO()
        torch.save(tensor, buffer)  # and torch.load's default (weights_only) takes it back
        buffer.seek(0)
        assert torch.equal(torch.load(buffer, weights_only=True), copies[name]), name


def _cache_bytes(kv_cache: torch.Tensor) -> bytes:
    return kv_cache.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def check_refuses_bad_entries(backend: type[AttentionBackend], device: str, dtype: torch.dtype):
    """A negative block id and one >= num_blocks, in a column only read (of the decode and of
    the chunked prefill), through every entry point: refused, nothing written."""
    layer, batch = _step(backend, device, dtype)
    order = batch.spec.query_lens
    decode, prefill = order.index(1), order.index(5)
    num_blocks = batch.kv_cache.shape[0]
    for entry in ("layer", "direct", "forward"):
        for row, column in ((decode, 0), (decode, 1), (prefill, 0)):
            for bad in (-1, num_blocks, num_blocks + 1000):
                table = batch.common_attn_metadata.block_table_cpu.clone()
                table[row, column] = bad
                bad_batch = _with_table(batch, table)
                tensors = _callers_tensors(bad_batch)
                copies = {name: t.clone() for name, t in tensors.items()}
                before = _cache_bytes(bad_batch.kv_cache)
                expected = (
                    rf"block_table_tensor has a block outside the cache for request {row}, "
                    rf"column {column} \(got {bad}, expected 0 <= block < num_blocks = "
                    rf"{num_blocks} in the \d+ columns its \d+ keys read at block_size"
                )
                with pytest.raises(ValueError, match=expected):
                    _call(entry, layer, bad_batch)
                assert _cache_bytes(bad_batch.kv_cache) == before, (entry, row, column, bad)
                _assert_left_alone(tensors, copies)


def check_accepts_anything_where_nothing_is_read(
    backend: type[AttentionBackend], device: str, dtype: torch.dtype
) -> None:
    """Columns past each request's keys and rows past the batch hold garbage: the call runs,
    writes what the kit expects and outputs what it does over a clean table."""
    layer, batch = _step(backend, device, dtype)
    clean = _call("layer", layer, batch)
    table = batch.common_attn_metadata.block_table_cpu
    garbage = torch.cat([table, torch.full((1, table.shape[1]), -7, dtype=table.dtype)])
    garbage[:, -1] = 10**6  # read by no request
    garbage[batch.spec.query_lens.index(5), 2] = -5  # past the chunked prefill's 25 keys
    for entry in ("layer", "direct"):
        layer, fresh = _step(backend, device, dtype)  # the context only, nothing of the step yet
        fresh = _with_table(fresh, garbage)
        output = _call(entry, layer, fresh)
        n = fresh.num_actual_tokens
        assert torch.equal(output[:n], clean[:n]), entry
        assert _cache_bytes(fresh.kv_cache) == _cache_bytes(fresh.expected_kv_cache), entry


# --- TORCH and FLEX_ATTENTION here, TRITON through the interpreter ------------------------------

CPU_BACKENDS = [TorchAttentionBackend, FlexAttentionBackend]


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=lambda b: b.get_name())
def test_bad_block_ids_in_read_columns_are_refused_before_any_write(backend) -> None:
    check_refuses_bad_entries(backend, "cpu", torch.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=lambda b: b.get_name())
def test_columns_and_rows_nothing_reads_may_hold_anything(backend) -> None:
    check_accepts_anything_where_nothing_is_read(backend, "cpu", torch.float32)


def test_triton_under_the_interpreter(triton_interpreter: Callable[..., str]) -> None:
    assert "TRITON: 2 checks passed" in triton_interpreter(__file__)


def test_a_slot_outside_the_cache_names_its_token_and_request() -> None:
    layer, batch = _step(TorchAttentionBackend, "cpu", torch.float32)
    common = batch.common_attn_metadata
    num_slots = batch.kv_cache.shape[0] * BLOCK
    slots = common.slot_mapping_cpu.clone()
    slots[3] = num_slots + 2  # the prefill's third token (the decode is token 0)
    common = dataclasses.replace(common, slot_mapping=slots, slot_mapping_cpu=slots)
    bad = dataclasses.replace(batch, common_attn_metadata=common,
                              attn_metadata=batch.builder.build(0, common))  # fmt: skip
    before = _cache_bytes(bad.kv_cache)
    for entry in ("layer", "direct"):
        with pytest.raises(ValueError) as raised:
            _call(entry, layer, bad)
        assert (
            f"slot_mapping has a slot outside the cache at token 3 (request 1) (got "
            f"{num_slots + 2}, expected -1 or 0 <= slot < num_blocks * block_size = "
            f"{num_slots // BLOCK} * {BLOCK})"
        ) in str(raised.value)
        assert _cache_bytes(bad.kv_cache) == before


def test_cross_attention_reads_the_encoder_columns_only() -> None:
    """Cross attention reads `ceil(encoder_len / block_size)` columns: a bad id in one of them
    is refused, one past them (where the decoder's positions reach) is not read."""
    layer, batch = _step(
        TorchAttentionBackend, "cpu", torch.float32, SPEC_CROSS, AttentionType.ENCODER_DECODER
    )
    row = batch.spec.encoder_seq_lens.index(20)  # 2 columns read of a table of 4
    for column, is_read in ((1, True), (2, False)):
        table = batch.common_attn_metadata.block_table_cpu.clone()
        table[row, column] = -3
        bad = _with_table(batch, table)
        if is_read:
            with pytest.raises(ValueError, match=f"request {row}, column 1 \\(got -3"):
                _call("layer", layer, bad)
        else:
            _call("layer", layer, bad)


# --- once per layer call, remembered per step and cache -----------------------------------------


def test_a_layer_call_is_checked_once_and_a_step_once_per_cache(monkeypatch) -> None:
    layer, batch = _step(TorchAttentionBackend, "cpu", torch.float32)
    counts = {"validate_inputs": 0, "mirrors": 0, "write arguments": 0}

    def counting(name: str, function: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(layer.impl, "validate_inputs",
                        counting("validate_inputs", layer.impl.validate_inputs))  # fmt: skip
    monkeypatch.setattr(validation, "_check_block_table",
                        counting("mirrors", validation._check_block_table))  # fmt: skip
    write_checks = counting("write arguments", validation.check_kv_write_args)
    monkeypatch.setattr(validation, "check_kv_write_args", write_checks)
    for _ in range(3):  # three layers of one step, one cache size
        _call("layer", layer, batch)
    assert counts == {"validate_inputs": 3, "mirrors": 1, "write arguments": 0}
    # The impl's entry points called directly: each checks what it is given.
    _call("direct", layer, batch)
    assert counts == {"validate_inputs": 4, "mirrors": 1, "write arguments": 1}
    # A cache of another size: the step is checked against it once.
    bigger = torch.cat([batch.kv_cache, batch.kv_cache])
    layer(batch.query, batch.key, batch.value, bigger, batch.attn_metadata)
    layer(batch.query, batch.key, batch.value, bigger, batch.attn_metadata)
    assert counts == {"validate_inputs": 6, "mirrors": 2, "write arguments": 1}


def test_the_checked_call_is_that_call_only() -> None:
    """The record of a layer call serves the impl's entry points with those very tensors: a
    forward with another output, or a write with another key, is checked."""
    layer, batch = _step(TorchAttentionBackend, "cpu", torch.float32)
    md = batch.attn_metadata
    validation.check_layer_call(layer.impl, layer, batch.query, batch.key, batch.value,
                                batch.kv_cache, md, torch.empty_like(batch.query), None,
                                writes_kv=True)  # fmt: skip
    short = batch.key[:2]
    with pytest.raises(ValueError, match="value's shape differs from key's"):
        layer.impl.do_kv_cache_update(layer, short, batch.value, batch.kv_cache,
                                      md.slot_mapping, md)  # fmt: skip
    wrong = torch.empty(batch.query.shape[0], HEADS, HEAD_SIZE + 1)
    with pytest.raises(ValueError, match="output must match query"):
        layer.impl.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, md, wrong)


# --- GPU -----------------------------------------------------------------------------------------

GPU_BACKENDS = ["TORCH", "TRITON", "FLEX_ATTENTION", "FLASH_ATTN", "FLASHINFER"]


def _on_gpu(name: str) -> type[AttentionBackend]:
    backend = get_backend_class(name)
    if backend.get_unavailable_reason():
        pytest.skip(f"{name}: {backend.get_unavailable_reason()}")
    return backend


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_bad_block_ids_are_refused_before_any_write_on_the_gpu(name: str) -> None:
    check_refuses_bad_entries(_on_gpu(name), "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["TRITON", "FLASH_ATTN", "FLASHINFER"])
def test_columns_nothing_reads_may_hold_anything_on_the_gpu(name: str) -> None:
    check_accepts_anything_where_nothing_is_read(_on_gpu(name), "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_a_layer_call_reads_nothing_back_from_the_device(name: str) -> None:
    """A layer call's checks and cache write, twice (two layers of a step), with the sync debug
    mode at "error"; for TRITON and FLASH_ATTN, whose mixed-batch forwards launch kernels only,
    the whole layer call. (The other forwards are not this test's subject.)"""
    backend = _on_gpu(name)
    layer, step = _step(backend, "cuda", torch.bfloat16)
    md = step.attn_metadata
    args = (step.query, step.key, step.value, step.kv_cache)
    is_whole_call = name in ("TRITON", "FLASH_ATTN")

    def layer_call() -> None:
        if is_whole_call:
            layer(*args, md)
            return
        output = torch.empty_like(step.query)
        validation.check_layer_call(layer.impl, layer, *args, md, output, None, writes_kv=True)
        layer.impl.do_kv_cache_update(layer, step.key, step.value, step.kv_cache,
                                      md.slot_mapping, md)  # fmt: skip

    # Warm-up on a cache of one block more (kernels compiled; the step's checks against the
    # real cache's size still to be made, inside the debug mode).
    warm = torch.cat([step.kv_cache, step.kv_cache[:1]])
    if is_whole_call:
        layer(step.query, step.key, step.value, warm, md)
    else:
        layer.impl.do_kv_cache_update(layer, step.key, step.value, warm, md.slot_mapping, md)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer_call()
        layer_call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert _cache_bytes(step.kv_cache) == _cache_bytes(step.expected_kv_cache)


if __name__ == "__main__":
    # Run by test_triton_under_the_interpreter with TRITON_INTERPRET=1.
    checks = (check_refuses_bad_entries, check_accepts_anything_where_nothing_is_read)
    for check in checks:
        check(InterpretedTriton, "cpu", torch.float32)
    print(f"TRITON: {len(checks)} checks passed")
    sys.exit(0)
