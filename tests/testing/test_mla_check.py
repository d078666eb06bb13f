"""check_backend on MLA backends: TORCH_MLA conforms at every split and dtype; broken MLA
backends are caught; a context read in several workspace chunks gives the unchunked result."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from anyattn.registry import get_backend_class
from anyattn.testing import (
    MLA_SHAPES,
    KitMLALayer,
    MLACase,
    build_mla_batch,
    check_backend,
    error_bound,
    get_spec,
    judge_mla_step,
    max_abs_error,
    mla_oracle,
    mla_step,
    plan_cases,
    run_mla_step,
)

torch_mla = pytest.importorskip("anyattn.backends.torch_mla")
TorchMLABackend, TorchMLAImpl = torch_mla.TorchMLABackend, torch_mla.TorchMLAImpl

SPLITS = ("512+64", "320+64", "64+16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_torch_mla_conforms_at_every_split(dtype: torch.dtype) -> None:
    report = check_backend(TorchMLABackend, "cpu", dtype, quick=True)
    report.assert_passed()
    # TORCH_MLA declares any split, fp8 and LSE: nothing may be left out.
    assert report.not_declared == [], report.summary()
    names = {c.name for c in report.cases}
    for split in SPLITS:
        assert {f"{split}/many_decodes", f"{split}/long_prefill", f"{split}/chunked_prefill"} <= (
            names
        )
    assert {"context_chunks", "fp8/fp8_e4m3", "fp8/fp8_e5m2", "mixed_lse.lse"} <= names


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_mla_conforms_on_cuda(dtype: torch.dtype) -> None:
    check_backend(TorchMLABackend, "cuda", dtype).assert_passed()


def test_torch_mla_conforms_on_the_full_catalogue() -> None:
    report = check_backend(TorchMLABackend, "cpu", torch.float32, features=["mixed", "odd_lengths"])
    report.assert_passed()
    assert len(report.cases) == 2 * len(SPLITS)


def _register_impl(register, name: str, impl_cls: type) -> type:
    backend = type(
        f"{name}Backend",
        (TorchMLABackend,),
        {"get_name": staticmethod(lambda: name), "get_impl_cls": staticmethod(lambda: impl_cls)},
    )
    register(name, backend)
    return get_backend_class(name)


def _has_decode_over_several_keys(case) -> bool:
    spec = case.spec
    return any(q == 1 and s > 1 for q, s in zip(spec.query_lens, spec.seq_lens, strict=True))


def test_decode_ignoring_q_pe_is_caught(register) -> None:
    class NoRopeDecode(TorchMLAImpl):
        def forward_mqa(self, layer, q_latent, q_pe, *args, **kwargs):
            super().forward_mqa(layer, q_latent, torch.zeros_like(q_pe), *args, **kwargs)

    backend = _register_impl(register, "TEST_MLA_NO_ROPE_DECODE", NoRopeDecode)
    report = check_backend(backend, "cpu", torch.float32, quick=True)
    cases, _ = plan_cases(backend, "cpu", torch.float32, quick=True)
    # Every case with a decode over more than one key fails; prefill-only ones still pass.
    expected = {c.name for c in cases if _has_decode_over_several_keys(c)}
    assert {c.name.removesuffix(".lse") for c in report.failures} == expected
    assert {f"{s}/long_prefill" for s in SPLITS} <= {c.name for c in report.cases if c.passed}
    assert all("error above bound" in c.detail for c in report.failures)


def test_prefill_dropping_a_context_chunk_is_caught(register) -> None:
    class DropsLastChunk(TorchMLAImpl):
        def forward_mha(self, layer, q, kv_c, k_pe, kv_cache, md, output):
            if md.prefill is not None and len(md.prefill.chunks) > 1:
                prefill = dataclasses.replace(md.prefill, chunks=md.prefill.chunks[:-1])
                md = dataclasses.replace(md, prefill=prefill)
            super().forward_mha(layer, q, kv_c, k_pe, kv_cache, md, output)

    backend = _register_impl(register, "TEST_MLA_DROPS_CHUNK", DropsLastChunk)
    report = check_backend(backend, "cpu", torch.float32, quick=True)
    assert [c.name for c in report.failures] == ["context_chunks"]


def test_unwritten_cache_and_unchunked_context_are_caught(register) -> None:
    class Careless(TorchMLAImpl):
        def __init__(self, *args, workspace_tokens=None, **kwargs):
            # Ignores the layer's workspace: the context is read in one piece.
            super().__init__(*args, **kwargs)

        def do_kv_cache_update(self, layer, kv_c_normed, k_pe, kv_cache, slot_mapping, md=None):
            # Writes the latent but not the rope key.
            super().do_kv_cache_update(
                layer, kv_c_normed, torch.zeros_like(k_pe), kv_cache, slot_mapping, md
            )

    backend = _register_impl(register, "TEST_MLA_CARELESS", Careless)
    report = check_backend(backend, "cpu", torch.float32, features=["mixed", "context_chunks"])
    failures = {c.name: c.detail for c in report.failures}
    assert set(failures) == {f"{s}/mixed" for s in SPLITS} | {"context_chunks"}
    assert all("KV cache differs from the expected writes" in d for d in failures.values())
    assert "context not read in >= 3 chunks of <= 32 rows" in failures["context_chunks"]


def test_new_tokens_up_projected_request_by_request_pass(register) -> None:
    """New tokens may be up-projected in any number of calls of any size: only the context
    rows of each call count as a chunk."""

    class PerRequest(TorchMLAImpl):
        new_token_loc: tuple[int, ...] = ()

        def forward_mha(self, layer, q, kv_c, k_pe, kv_cache, md, output):
            self.new_token_loc = (
                tuple(md.prefill.query_start_loc_cpu.tolist()) if md.prefill else ()
            )
            super().forward_mha(layer, q, kv_c, k_pe, kv_cache, md, output)

        def _up_project(self, api, layer, c_kv, k_pe):
            loc = self.new_token_loc
            if not loc or c_kv.shape[0] != loc[-1]:  # a context chunk
                return super()._up_project(api, layer, c_kv, k_pe)
            # The new tokens, one request per call (each more rows than the workspace here).
            parts = [
                super(PerRequest, self)._up_project(api, layer, c_kv[a:b], k_pe[a:b])
                for a, b in itertools.pairwise(loc)
            ]
            return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])

    backend = _register_impl(register, "TEST_MLA_PER_REQUEST", PerRequest)
    report = check_backend(backend, "cpu", torch.float32, features=["context_chunks"])
    report.assert_passed()


def test_dequantising_with_v_scale_is_caught(register) -> None:
    """The fp8 latent cache has one scale, k_scale; a backend that reads v_scale fails."""

    class ReadsVScale(TorchMLAImpl):
        def dequantize_latent(self, api, layer, rows, dtype):
            return (rows.float() * layer.v_scale).to(dtype)

    backend = _register_impl(register, "TEST_MLA_V_SCALE", ReadsVScale)
    report = check_backend(backend, "cpu", torch.float32, features=["fp8"])
    names = {c.name for c in report.cases}
    assert {"fp8/fp8", "fp8/fp8_e4m3", "fp8/fp8_e5m2"} <= names
    assert {c.name for c in report.failures} == names
    assert all("error above bound" in c.detail for c in report.failures)


def _run(case, workspace_tokens: int | None):
    """One step of `case`'s batch (same seed, same data) with the given workspace."""
    shape = case.shape
    kwargs = {} if workspace_tokens is None else {"workspace_tokens": workspace_tokens}
    impl = TorchMLAImpl(
        case.num_heads,
        case.scale,
        kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        v_head_dim=shape.v_head_dim,
        **kwargs,
    )
    batch = build_mla_batch(
        TorchMLABackend,
        case.spec,
        shape=shape,
        num_heads=case.num_heads,
        dtype=torch.float32,
        layers={"layer.0": impl.layer_params()},
    )
    layer = KitMLALayer("layer.0", batch.k_scale, batch.k_scale, batch.w_uk, batch.w_uv)
    return batch, layer, mla_step(impl, layer, batch)


def test_three_or_more_context_chunks_give_the_unchunked_result() -> None:
    (case,), _ = plan_cases(TorchMLABackend, features=["context_chunks"])
    workspace = case.workspace_tokens
    chunked_batch, chunked_layer, chunked = _run(case, workspace)
    whole_batch, whole_layer, whole = _run(case, None)

    # Every prefill context is longer than the workspace; the plan has >= 3 chunks.
    num_decodes = chunked.num_decodes
    contexts = chunked_batch.spec.context_lens[num_decodes:]
    assert min(contexts) > workspace
    chunks = chunked_batch.attn_metadata.prefill.chunks
    assert len(chunks) >= 3 and all(c.num_tokens <= workspace for c in chunks)
    assert len(whole_batch.attn_metadata.prefill.chunks) == 1
    # The layer saw one up-projection per chunk, after the new tokens'.
    num_new = chunked_batch.num_actual_tokens - chunked.num_decode_tokens
    assert chunked_layer.up_project_rows == [num_new, *(c.num_tokens for c in chunks)]
    assert whole_layer.up_project_rows == [num_new, sum(contexts)]

    # Same data, same result: merging the chunks by LSE only reorders float32 sums.
    torch.testing.assert_close(chunked.output, whole.output, rtol=1e-5, atol=1e-6, equal_nan=True)
    n = chunked_batch.num_actual_tokens
    kv_c, k_pe = chunked_batch.oracle_latents(num_decodes)
    inputs = (chunked_batch.q_nope[:n], chunked_batch.q_pe[:n], kv_c, k_pe)
    weights = (chunked_batch.w_uk, chunked_batch.w_uv)
    lengths = (chunked_batch.spec.query_lens, chunked_batch.spec.seq_lens)
    ref64, _ = mla_oracle(*inputs, *weights, *lengths, scale=case.scale)
    ref32, _ = mla_oracle(
        *inputs, *weights, *lengths, scale=case.scale, compute_dtype=torch.float32
    )
    assert max_abs_error(chunked.output[:n], ref64) <= error_bound(ref64, ref32, torch.float32)


def test_judging_by_phase_names_the_wrong_path(register) -> None:
    """`judge_mla_step(by_phase=True)`: one result per path and one for the exact checks."""

    class WrongPrefill(TorchMLAImpl):
        def forward_mha(self, layer, q, kv_c, k_pe, kv_cache, md, output):
            super().forward_mha(layer, q, kv_c, k_pe, kv_cache, md, output)
            output.mul_(1.05)

    class NoRopeWrite(TorchMLAImpl):
        def do_kv_cache_update(self, layer, kv_c_normed, k_pe, kv_cache, slot_mapping, md=None):
            super().do_kv_cache_update(
                layer, kv_c_normed, torch.zeros_like(k_pe), kv_cache, slot_mapping, md
            )

    case = MLACase("m", "mixed", get_spec("mixed", quick=True), shape=MLA_SHAPES[2])
    cpu = torch.device("cpu")

    def failed(backend) -> dict[str, str]:
        step = run_mla_step(backend, case, cpu, torch.float32, seed=0)
        results = judge_mla_step(case, *step, torch.float32, by_phase=True)
        assert [r.name for r in results] == ["m.decode", "m.prefill", "m.exact"]
        return {r.name: r.detail for r in results if not r.passed}

    assert failed(TorchMLABackend) == {}
    assert failed(_register_impl(register, "TEST_MLA_WRONG_PREFILL", WrongPrefill)) == {
        "m.prefill": "error above bound"
    }
    careless = failed(_register_impl(register, "TEST_MLA_NO_ROPE_WRITE", NoRopeWrite))
    assert set(careless) == {"m.decode", "m.exact"}
    assert careless["m.exact"].startswith("KV cache differs from the expected writes")
