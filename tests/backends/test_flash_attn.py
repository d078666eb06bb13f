"""FLASH_ATTN on the CPU: version detection from signatures, declarations and selection for
sm80/sm90/sm100 with each version present or absent, and the builder + impl run through the
conformance kit over CPU stand-ins with the real entry points' signatures (`fa_fakes`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from fa_fakes import (
    fa2,
    fa3,
    fa3_varlen_upstream,
    fa4,
    fa4_forward,
    fa4_through_forward,
    fa4_varlen,
    install,
)

from anyattn.backends import flash_attn_builder
from anyattn.backends import flash_attn_versions as versions
from anyattn.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from anyattn.backends.flash_attn_entry_point import (
    PIP_COMMAND,
    FlashAttnInterface,
    FlashAttnRequest,
    FlashAttnVersion,
    interface_from_function,
    reference_fa4_interface,
)
from anyattn.backends.flash_attn_plan import contiguous_key_rows
from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.layer import Attention
from anyattn.metadata import make_common_attn_metadata
from anyattn.registry import AttentionBackendEnum
from anyattn.selector import NoBackendError, explain, select_backend
from anyattn.testing import assign_blocks, layer_records, plan_cases, run_case
from anyattn.types import AttentionCGSupport, AttentionType, DeviceInfo, MultipleOf

SM80, SM90, SM100, SM120 = (DeviceInfo.parse(s) for s in ("sm80", "sm90", "sm100", "sm120"))
FV = FlashAttnVersion


def _config(**changes) -> AttentionSelectorConfig:
    fields = dict(head_size=128, dtype=torch.bfloat16, block_size=16, num_heads=8, num_kv_heads=2)
    return AttentionSelectorConfig(**{**fields, **changes})


def _reasons(device: DeviceInfo, **changes) -> list[str]:
    return FlashAttentionBackend.validate_configuration(_config(**changes), device)


# --- detection ---------------------------------------------------------------------------------


def test_the_registry_names_the_backend():
    assert AttentionBackendEnum.FLASH_ATTN.get_class() is FlashAttentionBackend


def test_signatures_are_read_at_run_time():
    fa4_ = fa4()
    assert fa4_.params == reference_fa4_interface().params
    assert (fa4_.page_table_arg, fa4_.seq_lens_arg, fa4_.sink_arg, fa4_.lse_arg) == (
        "page_table", "seqused_k", "learnable_sink", "return_lse",
    )  # fmt: skip
    assert fa4_.has_softcap and fa4_.has_window and fa4_.has_cu_seqlens_k
    assert not (fa4_.has_alibi or fa4_.has_descales or fa4_.has_out)
    fa2_ = fa2()
    assert (fa2_.page_table_arg, fa2_.seq_lens_arg, fa2_.lse_arg) == (
        "block_table", None, "return_attn_probs",
    )  # fmt: skip
    assert fa2_.has_alibi and fa2_.sink_arg is None and not fa2_.has_descales
    fa3_ = fa3()
    assert (fa3_.page_table_arg, fa3_.seq_lens_arg, fa3_.lse_arg) == (
        "page_table", "cache_seqlens", "return_softmax_lse",
    )  # fmt: skip
    assert fa3_.has_descales and fa3_.takes_cache_as_k_cache and not fa3_.has_cu_seqlens_k


def test_an_entry_point_without_a_page_table_is_not_usable(monkeypatch):
    upstream = interface_from_function(
        FV.FA3, "flash_attn_interface", "flash_attn_varlen_func", fa3_varlen_upstream
    )
    assert upstream.missing_essentials() == ["no page table argument (page_table / block_table)"]
    install(monkeypatch, upstream)
    assert versions.installed_interfaces() == ()
    reason = FlashAttentionBackend.get_unavailable_reason()
    assert "no page table argument" in reason and PIP_COMMAND in reason


def test_arguments_map_to_each_versions_names():
    common = dict(q=1, k=2, v=3, cu_seqlens_q=4, max_seqlen_q=5, max_seqlen_k=6, page_table=7,
                  softmax_scale=0.5, causal=True, window=8, softcap=None,
                  return_lse=True)  # fmt: skip
    assert fa4().map_arguments(**common, seq_lens=9, sinks=10) == dict(
        q=1, k=2, v=3, cu_seqlens_q=4, max_seqlen_q=5, max_seqlen_k=6, page_table=7,
        softmax_scale=0.5, causal=True, window_size=(7, 0), return_lse=True, seqused_k=9,
        learnable_sink=10,
    )  # fmt: skip
    mapped = fa2().map_arguments(**common, cu_seqlens_k=11, alibi_slopes=12)
    assert (mapped["block_table"], mapped["cu_seqlens_k"], mapped["alibi_slopes"]) == (7, 11, 12)
    assert mapped["return_attn_probs"] is True
    mapped = fa3().map_arguments(**common, seq_lens=9)
    assert (mapped["k_cache"], mapped["v_cache"], mapped["cache_seqlens"]) == (2, 3, 9)
    assert "k" not in mapped and "max_seqlen_k" not in mapped  # with_kvcache takes no bound
    with pytest.raises(TypeError, match="declaration bug"):
        fa4().map_arguments(**common, alibi_slopes=12)


# --- declarations and selection ----------------------------------------------------------------

# FA4 on sm90: what passed every run of the declaration sweep on an H200.
FA4_SM90_HEAD_SIZES = [*range(16, 129, 16), 144, 176, 192, 256]


@pytest.mark.parametrize("head_size", FA4_SM90_HEAD_SIZES)
@pytest.mark.parametrize("attn", ["cross", "non_causal", "causal", "encoder"])
def test_fa4_takes_every_declared_head_size_for_every_attention_type_on_sm90(
    monkeypatch, head_size, attn
):
    # (where FA4's paged bidirectional kernel is wrong, the builder reads keys contiguously)
    install(monkeypatch, fa4())
    changes = {
        "cross": {"attn_type": AttentionType.ENCODER_DECODER},
        "non_causal": {"use_non_causal": True},
        "causal": {},
        "encoder": {"attn_type": AttentionType.ENCODER},
    }[attn]
    assert _reasons(SM90, head_size=head_size, **changes) == []


def test_contiguous_key_rows_follow_each_requests_pages():
    table = torch.tensor([[5, 2, 7], [1, 0, 0], [3, 4, 6]], dtype=torch.int32)
    lens = torch.tensor([35, 0, 17])
    blocks, offsets = contiguous_key_rows(table, lens, 16)
    expected = [(table[r, p // 16].item(), p % 16) for r in range(3) for p in range(lens[r])]
    assert list(zip(blocks.tolist(), offsets.tolist(), strict=True)) == expected
    assert blocks.dtype == offsets.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keys_read_contiguously_where_the_paged_bidirectional_kernel_is_wrong(monkeypatch, dtype):
    """With FA4's paged bidirectional kernel marked faulty, cross and non-causal passes reach it
    with contiguous keys (no page table) and still match the oracle; causal ones stay paged."""
    install(monkeypatch, fa4())
    monkeypatch.setattr(flash_attn_builder, "paged_bidirectional_is_faulty", lambda *args: True)
    calls = []
    real_call = FlashAttnInterface.call

    def spy(self, **kwargs):
        calls.append((kwargs["causal"], kwargs["page_table"] is None))
        return real_call(self, **kwargs)

    monkeypatch.setattr(FlashAttnInterface, "call", spy)
    features = ["non_causal", "encoder_decoder", "mixed", "cascade"]
    cases, _ = _kit_cases(monkeypatch, dtype, features)
    assert {c.feature for c in cases} == set(features)
    _assert_cases_pass(cases, dtype)
    bidirectional_paged = [c for c in calls if not c[0] and not c[1]]
    assert not bidirectional_paged, "a bidirectional pass read paged keys"
    assert (True, False) in calls and (False, True) in calls


def test_fa4_declarations(monkeypatch):
    install(monkeypatch, fa4())
    b = FlashAttentionBackend
    assert b.get_unavailable_reason() is None
    assert b.supported_dtypes == (torch.float16, torch.bfloat16)
    assert b.supported_kv_cache_dtypes == ("auto", "float16", "bfloat16")
    assert b.get_supported_head_sizes() == FA4_SM90_HEAD_SIZES
    assert b.get_supported_kernel_block_sizes() == [MultipleOf(16)]
    assert [str(x) for x in b.supported_kv_cache_layouts()] == ["NHD", "HND"]
    assert b.supported_attn_types == tuple(AttentionType)
    assert b.min_compute_capability == (9, 0)
    features = b.describe()["features"]
    assert features == dict(sink=True, sliding_window=True, alibi=False, logits_soft_cap=True,
                            non_causal=True, per_head_quant_scales=False, batch_invariance=False,
                            lse=True, cascade=True, mla=False, sparse=False)  # fmt: skip
    assert b.get_cudagraph_support() == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert b.get_kv_cache_shape(10, 32, 2, 128) == (10, 2, 32, 2, 128)
    with pytest.raises(ValueError, match="block_size not supported"):
        b.get_kv_cache_shape(10, 8, 2, 128)


def test_fa4_selection_by_device(monkeypatch):
    install(monkeypatch, fa4())
    assert _reasons(SM90) == [] and _reasons(SM100) == []
    assert _reasons(SM90, head_size=256, has_sink=True, needs_lse=True) == []
    assert _reasons(SM80) == ["compute capability sm80 not supported (needs sm90 or newer)"]
    (reason,) = _reasons(SM120)
    assert "FA4 (flash_attn.cute.flash_attn_varlen_func): compute capability sm120" in reason
    (reason,) = _reasons(SM100, head_size=192)
    assert "head_size 192 not supported" in reason
    assert _reasons(SM90, head_size=192) == []
    assert _reasons(SM90, head_size=72) == [
        "head_size 72 not supported (supported: " + ", ".join(map(str, FA4_SM90_HEAD_SIZES)) + ")"
    ]
    # Sizes whose paged results were wrong in the declaration sweep on an H200 are not declared.
    for head_size in (160, 208, 224, 240):
        assert _reasons(SM90, head_size=head_size) != []
    assert _reasons(SM100, head_size=160) != []
    assert _reasons(SM90, dtype=torch.float32) == [
        "dtype float32 not supported (supported: float16, bfloat16)"
    ]
    assert _reasons(SM90, has_alibi=True) == ["ALiBi (has_alibi) not supported"]
    assert _reasons(SM90, kv_cache_dtype="fp8") == [
        "kv_cache_dtype fp8 not supported (supported: auto, float16, bfloat16)"
    ]
    assert _reasons(SM90, has_sliding_window=True, use_non_causal=True) == [
        "sliding window with non-causal or encoder attention not supported"
    ]
    assert _reasons(SM90, dtype=torch.float16, kv_cache_dtype="bfloat16") == [
        "kv_cache_dtype bfloat16 with dtype float16 not supported (the kernels take queries and "
        "keys of one dtype)"
    ]
    assert _reasons(DeviceInfo.cpu())[0].startswith("device cpu not supported")


def test_fa2_declarations_and_selection(monkeypatch):
    install(monkeypatch, fa2())
    b = FlashAttentionBackend
    assert b.get_supported_kernel_block_sizes() == [MultipleOf(256)]
    assert b.min_compute_capability == (8, 0)
    assert b.supports_alibi() and not b.supports_sink() and b.supports_lse()
    assert _reasons(SM80, block_size=256, has_alibi=True) == []
    assert _reasons(SM80, block_size=16) == [
        "block_size 16 not supported (kernel block sizes: multiple of 256)"
    ]
    assert _reasons(SM80, block_size=256, has_sink=True) == [
        "attention sinks (has_sink) not supported"
    ]
    (reason,) = _reasons(SM90, block_size=256, has_alibi=True, use_non_causal=True)
    assert "ALiBi with bidirectional attention not supported" in reason


def test_fa3_declarations_and_selection(monkeypatch):
    install(monkeypatch, fa3())
    b = FlashAttentionBackend
    assert b.supported_kv_cache_dtypes == ("auto", "float16", "bfloat16")
    assert b.supported_attn_types == (AttentionType.DECODER, AttentionType.ENCODER_DECODER)
    assert not (b.supports_per_head_quant_scales() or b.supports_sink())
    assert _reasons(SM90, kv_cache_dtype="fp8_e4m3", use_per_head_quant_scales=True) == [
        "kv_cache_dtype fp8_e4m3 not supported (supported: auto, float16, bfloat16)",
        "per-head quant scales (use_per_head_quant_scales) not supported",
    ]
    assert _reasons(SM80) == ["compute capability sm80 not supported (needs sm90 or newer)"]
    (reason,) = _reasons(SM100)
    assert "FA3 (flash_attn_interface.flash_attn_with_kvcache): compute capability sm100" in reason
    assert _reasons(SM90, attn_type="encoder") == [
        "attn_type encoder not supported (supported: decoder, encoder_decoder)"
    ]


def test_with_two_versions_the_layer_decides(monkeypatch):
    install(monkeypatch, fa4(), fa2())
    b = FlashAttentionBackend
    assert b.get_supported_kernel_block_sizes() == [MultipleOf(16)]
    assert b.supports_alibi() and b.supports_sink()
    request = FlashAttnRequest(head_size=128, capability=(8, 0), block_size=256)
    assert versions.choose_interface(versions.installed_interfaces(), request)[0].version == FV.FA2
    request = FlashAttnRequest(head_size=128, capability=(9, 0), block_size=256)
    assert versions.choose_interface(versions.installed_interfaces(), request)[0].version == FV.FA4
    assert _reasons(SM90, block_size=256, has_alibi=True) == []  # FA2 takes it
    assert _reasons(SM80, block_size=16) != []  # FA4 has no sm80 paged path, FA2 wants 256
    (reason,) = _reasons(SM90, block_size=256, has_alibi=True, has_sink=True)
    assert "FA4" in reason and "ALiBi" in reason and "FA2" in reason and "sinks" in reason


def test_absent_flash_attention_declares_fa4_and_names_the_pip_command(monkeypatch):
    install(monkeypatch)
    b = FlashAttentionBackend
    reason = b.get_unavailable_reason()
    assert reason.endswith("Install it with: pip install 'anyattn[flash-attn]'")
    assert _reasons(SM90) == []  # capabilities are FA4's, availability is separate
    assert b.get_supported_head_sizes() == FA4_SM90_HEAD_SIZES
    verdicts = {v.name: v for v in explain(_config(), SM90).verdicts}
    assert verdicts["FLASH_ATTN"].reasons == () and "anyattn[flash-attn]" in (
        verdicts["FLASH_ATTN"].unavailable
    )
    with pytest.raises(ImportError, match=r"pip install 'anyattn\[flash-attn\]'"):
        FlashAttentionImpl(8, 128, 0.1, 2)


_SM80_TOO_OLD = "compute capability sm80 not supported (needs sm90 or newer)"
_SM80_TOO_OLD_FOR_THE_EXTRA = (
    f"{_SM80_TOO_OLD}: FA4, which pip install 'anyattn[flash-attn]' installs, runs on sm90+; "
    "FlashAttention 2 runs on sm80+ (pip install flash-attn)"
)
_FA3_NOT_ON_SM100 = (
    "no FlashAttention version takes this combination (FA3 (flash_attn_interface."
    "flash_attn_with_kvcache): compute capability sm100 not supported (runs on sm90 only))"
)
_NOT_INSTALLED = (
    "no usable FlashAttention here (flash_attn.cute: not installed). Install it with: "
    "pip install 'anyattn[flash-attn]'"
)
# installed, device, FLASH_ATTN's capability reasons there, its availability reason here.
_SELECTIONS = [
    ("FA4", SM80, (_SM80_TOO_OLD,), None),
    ("FA4", SM90, (), None),
    ("FA4", SM100, (), None),
    ("FA3", SM80, (_SM80_TOO_OLD,), None),
    ("FA3", SM90, (), None),
    ("FA3", SM100, (_FA3_NOT_ON_SM100,), None),
    ("FA2", SM80, (), None),
    ("FA2", SM90, (), None),
    ("FA2", SM100, (), None),
    ("none", SM80, (_SM80_TOO_OLD_FOR_THE_EXTRA,), _NOT_INSTALLED),
    ("none", SM90, (), _NOT_INSTALLED),
    ("none", SM100, (), _NOT_INSTALLED),
]


def test_with_nothing_installed_an_older_gpu_is_told_no_version_serves_it(monkeypatch):
    install(monkeypatch)  # no FlashAttention at all
    (reason,) = _reasons(DeviceInfo.parse("sm75"))
    assert reason == "compute capability sm75 not supported (needs sm90 or newer)"
    assert _reasons(SM80) == [_SM80_TOO_OLD_FOR_THE_EXTRA]  # FA2 would serve sm80


@pytest.mark.parametrize(
    ("installed", "device", "reasons", "unavailable"),
    [pytest.param(*row, id=f"{row[0]}-{str(row[1]).split()[-1]}") for row in _SELECTIONS],
)
def test_the_selector_judges_flash_attn_by_version_and_device(
    monkeypatch, installed, device, reasons, unavailable
):
    """The real selector over the real registry, for a plain bf16 decoder (head_size 128, the
    backend's preferred block size): FLASH_ATTN's verdict follows the installed FlashAttention
    and the device, and an explicit request for it fails with the same reasons."""
    install(monkeypatch, *{"FA4": [fa4()], "FA3": [fa3()], "FA2": [fa2()], "none": []}[installed])
    config = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16)
    result = explain(config, device)
    verdicts = {v.name: v for v in result.verdicts}
    flash = verdicts["FLASH_ATTN"]
    assert (flash.reasons, flash.unavailable) == (reasons, unavailable)
    if flash.fits:
        # Only a backend ahead of it may win: none on sm80/sm90 (FLASH_ATTN comes first), on
        # sm100 FLASHINFER where it is installed.
        assert result.chosen == "FLASH_ATTN" or verdicts[result.chosen].priority < flash.priority
        assert select_backend(config, device, backend="FLASH_ATTN") is FlashAttentionBackend
        return
    assert result.chosen != "FLASH_ATTN"
    with pytest.raises(NoBackendError) as raised:
        select_backend(config, device, backend="FLASH_ATTN")
    why = [*reasons, *([f"not available here: {unavailable}"] if unavailable else [])]
    assert str(raised.value).startswith(
        f"select_backend: requested backend FLASH_ATTN (from argument) cannot serve this config "
        f"on {device}: {'; '.join(why)}. Remove the request"
    )


def test_impl_rejects_what_the_installed_version_does_not_take(monkeypatch):
    install(monkeypatch, fa4())
    with pytest.raises(NotImplementedError, match="ALiBi"):
        FlashAttentionImpl(4, 64, 0.1, 2, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
    with pytest.raises(NotImplementedError, match="sliding window"):
        FlashAttentionImpl(4, 64, 0.1, 2, sliding_window=8, attn_type="encoder")
    with pytest.raises(ValueError, match="head_size"):
        FlashAttentionImpl(4, 72, 0.1, 2)
    install(monkeypatch, fa2())
    with pytest.raises(NotImplementedError, match="sinks"):
        FlashAttentionImpl(4, 64, 0.1, 2, sinks=torch.zeros(4))


# --- the conformance kit over CPU stand-ins ----------------------------------------------------


def _kit_cases(monkeypatch, dtype, features=None):
    # The stand-ins run on the CPU; the backend declares CUDA only.
    monkeypatch.setattr(FlashAttentionBackend, "supported_device_types", ("cpu", "cuda"))
    cases, not_declared = plan_cases(FlashAttentionBackend, "cpu", dtype, features, quick=True)
    assert cases, not_declared
    return cases, not_declared


def _assert_cases_pass(cases, dtype):
    for case in cases:
        failed = [r for r in run_case(FlashAttentionBackend, case, "cpu", dtype) if not r.passed]
        assert not failed, [(r.name, r.max_error, r.bound, r.detail) for r in failed]


def test_fa4_path_passes_the_kit_on_cpu(monkeypatch):
    install(monkeypatch, fa4())
    cases, not_declared = _kit_cases(monkeypatch, torch.float16)
    assert sorted(n.split(":")[0] for n in not_declared) == ["alibi", "fp8", "per_head_scales"]
    assert {c.feature for c in cases} >= {"cascade", "sinks", "encoder_decoder", "layouts"}
    _assert_cases_pass(cases, torch.float16)


def test_fa4_forward_path_passes_the_kit_on_cpu(monkeypatch):
    install(monkeypatch, fa4_through_forward())
    features = ["mixed", "sliding_window", "soft_cap", "sinks", "lse", "cascade", "encoder"]
    cases, _ = _kit_cases(monkeypatch, torch.float16, features)
    _assert_cases_pass(cases, torch.float16)


def test_fa4_forward_writes_the_layer_output_in_place(monkeypatch):
    """No copy: the output rows handed to FA4's forward are the layer's own."""
    seen = []

    def forward(**kwargs):
        seen.append(kwargs)
        return fa4_forward(**kwargs)

    layer, md, q, k, cache = _small_step(monkeypatch)
    install(monkeypatch, versions.fa4_forward_interface(fa4(), forward))
    layer.impl.do_kv_cache_update(layer, k, k.clone(), cache, md.slot_mapping)
    output = torch.full_like(q, math.nan)
    layer.impl.forward(layer, q, k, k.clone(), cache, md, output)
    (call,) = seen
    assert call["out"].data_ptr() == output.data_ptr() and call["out"].shape == q.shape
    assert (call["window_size_left"], call["window_size_right"]) == (None, None)
    assert "window_size" not in call and not output.isnan().any()


def test_fa4_forward_gets_no_out_it_could_not_write(monkeypatch):
    """An output view FA4's forward would reject (not 16-byte aligned) is filled by a copy."""
    seen = []

    def forward(**kwargs):
        seen.append(kwargs.get("out"))
        return fa4_forward(**kwargs)

    layer, md, q, k, cache = _small_step(monkeypatch)
    install(monkeypatch, versions.fa4_forward_interface(fa4(), forward))
    layer.impl.do_kv_cache_update(layer, k, k.clone(), cache, md.slot_mapping)
    aligned = torch.full_like(q, math.nan)
    layer.impl.forward(layer, q, k, k.clone(), cache, md, aligned)
    storage = torch.full((q.numel() + 1,), math.nan, dtype=q.dtype)
    shifted = storage[1:].view(q.shape)  # 2 bytes past an aligned start
    layer.impl.forward(layer, q, k, k.clone(), cache, md, shifted)
    assert seen[0] is not None and seen[1] is None
    assert torch.equal(shifted, aligned)


@pytest.mark.parametrize("forward_params", ["complete", "no_out", "missing"])
def test_fa4_detection_prefers_the_forward_that_takes_out(monkeypatch, forward_params):
    import types

    def no_out(q, k, v, window_size_left=None, window_size_right=None):
        raise AssertionError("never called")

    cute = types.SimpleNamespace(flash_attn_varlen_func=fa4_varlen)
    interface = types.SimpleNamespace(
        **({"complete": {"_flash_attn_fwd": fa4_forward}, "no_out": {"_flash_attn_fwd": no_out}}
           .get(forward_params, {}))
    )  # fmt: skip
    modules = {"flash_attn.cute": cute, "flash_attn.cute.interface": interface}

    def import_module(name):
        if name not in modules:
            raise ModuleNotFoundError(name)
        return modules[name]

    monkeypatch.setattr(versions.importlib, "import_module", import_module)
    found = versions._detect_version(FV.FA4)
    assert found.params >= reference_fa4_interface().params
    if forward_params == "complete":
        assert found.has_out and found.entry == "_flash_attn_fwd"
    else:
        assert not found.has_out and found.fn is fa4_varlen


def test_fa2_path_passes_the_kit_on_cpu(monkeypatch):
    install(monkeypatch, fa2())
    features = ["mixed", "alibi", "sliding_window", "lse", "encoder"]
    cases, _ = _kit_cases(monkeypatch, torch.float16, features)
    assert {c.block_size for c in cases} == {256}
    _assert_cases_pass(cases, torch.float16)


def test_fa3_path_passes_the_kit_on_cpu(monkeypatch):
    install(monkeypatch, fa3())
    features = ["decode", "mixed", "chunked", "lse", "cascade", "encoder_decoder", "soft_cap"]
    cases, _ = _kit_cases(monkeypatch, torch.bfloat16, features)
    _assert_cases_pass(cases, torch.bfloat16)


def test_fa3_declares_no_fp8_cache_and_says_why(monkeypatch):
    """FA3's fp8 kernels take q, k and v in e4m3: the query's rounding alone misses the kit's
    bound, so fp8 caches are not declared, and the version's reason says why."""
    install(monkeypatch, fa3())
    _, not_declared = _kit_cases(monkeypatch, torch.bfloat16)
    assert {"fp8", "per_head_scales"} <= {n.split(":")[0] for n in not_declared}
    request = FlashAttnRequest(head_size=128, capability=(9, 0), kv_cache_dtype="fp8")
    chosen, why = versions.choose_interface(versions.installed_interfaces(), request)
    assert chosen is None
    assert why == [
        "FA3 (flash_attn_interface.flash_attn_with_kvcache): kv_cache_dtype fp8 not supported "
        "(takes auto, float16, bfloat16; its fp8 kernels round the query to e4m3, past the "
        "error bound)"
    ]


# --- cascade, counted --------------------------------------------------------------------------


HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 64, 16


def _shared_prefix_step(num_reqs=16, prefix=512, seed=0, block_size=BLOCK):
    gen = torch.Generator().manual_seed(seed)
    query_lens = [1 if r % 4 else 3 for r in range(num_reqs)]
    seq_lens = [prefix + 5 + 3 * r + q for r, q in enumerate(query_lens)]
    table, num_blocks = assign_blocks(seq_lens, block_size, common_prefix_len=prefix, generator=gen)
    cm = make_common_attn_metadata(query_lens, seq_lens, table, block_size)
    return cm, num_blocks, gen


@pytest.mark.parametrize(("interface", "block_size"), [(fa4, 16), (fa2, 256)])
def test_cascade_runs_a_prefix_pass_and_matches_the_plain_path(monkeypatch, interface, block_size):
    install(monkeypatch, interface())
    cm, num_blocks, gen = _shared_prefix_step(block_size=block_size)
    spec = AttentionSpec(block_size, KV_HEADS, HEAD_SIZE, torch.float16)
    builder = FlashAttentionMetadataBuilder(
        spec, layer_records(spec, ["layer.0"]), BatchLimits(16, 256, 1024), "cpu"
    )
    query_lens = cm.query_lens_cpu.numpy()
    assert builder.use_cascade_attention(512, query_lens, 32, 8, False, False, 132)
    calls = []
    original = FlashAttentionImpl._attend

    def counting(self, interface, q, k, v, pass_, *args, **kwargs):
        calls.append((pass_.page_table.shape[0], pass_.causal, pass_.max_seqlen_k))
        return original(self, interface, q, k, v, pass_, *args, **kwargs)

    monkeypatch.setattr(FlashAttentionImpl, "_attend", counting)
    layer = Attention(HEADS, HEAD_SIZE, 0.125, KV_HEADS, dtype=torch.float16, device="sm90",
                      backend=FlashAttentionBackend, layer_name="layer.0")  # fmt: skip
    cache = allocate_kv_cache(FlashAttentionBackend, num_blocks, block_size, KV_HEADS, HEAD_SIZE,
                              torch.float16)  # fmt: skip
    cache.copy_(torch.randn(cache.shape, generator=gen).half())
    n = cm.num_actual_tokens
    q = torch.randn(n, HEADS, HEAD_SIZE, generator=gen).half()
    lse_plain, lse_cascade = torch.empty(HEADS, n), torch.empty(HEADS, n)
    plain = layer(q, None, None, cache, builder.build(0, cm), output_lse=lse_plain)
    assert calls == [(16, True, cm.max_seq_len)]
    cascade = layer(q, None, None, cache, builder.build(512, cm), output_lse=lse_cascade)
    assert calls[1:] == [(1, False, 512), (16, True, cm.max_seq_len - 512)]
    torch.testing.assert_close(cascade, plain, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse_cascade, lse_plain, atol=1e-5, rtol=1e-5)


# --- rejected calls ----------------------------------------------------------------------------


def _small_step(monkeypatch):
    install(monkeypatch, fa4())
    spec = AttentionSpec(BLOCK, KV_HEADS, HEAD_SIZE, torch.float16)
    builder = FlashAttentionMetadataBuilder(
        spec, layer_records(spec, ["layer.0"]), BatchLimits(4, 64, 64), "cpu"
    )
    cm = make_common_attn_metadata([1, 5], [9, 5], torch.tensor([[3], [7]], dtype=torch.int32),
                                   BLOCK)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, HEADS, HEAD_SIZE, generator=gen).half()
    k = torch.randn(6, KV_HEADS, HEAD_SIZE, generator=gen).half()
    cache = allocate_kv_cache(FlashAttentionBackend, 10, BLOCK, KV_HEADS, HEAD_SIZE, torch.float16)
    layer = Attention(HEADS, HEAD_SIZE, 0.125, KV_HEADS, dtype=torch.float16, device="sm90",
                      backend=FlashAttentionBackend, layer_name="layer.0")  # fmt: skip
    return layer, builder.build(0, cm), q, k, cache


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [("fp32_query", ValueError, "query dtype"), ("cache_dtype", ValueError, "kv_cache dtype"),
     ("lse_shape", ValueError, "output_lse"), ("key_tokens", ValueError, "differ in tokens")],
)  # fmt: skip
def test_rejected_call_leaves_the_cache_unchanged(monkeypatch, case, error, match):
    layer, md, q, k, cache = _small_step(monkeypatch)
    v, lse = k.clone(), None
    if case == "fp32_query":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "cache_dtype":
        cache = cache.bfloat16()
    elif case == "lse_shape":
        lse = torch.empty(HEADS + 1, 6)
    elif case == "key_tokens":
        k, v = k[:5], v[:5]
    before = cache.clone()
    with pytest.raises(error, match=match):
        layer(q, k, v, cache, md, output_lse=lse)
    assert torch.equal(cache, before)


def test_output_rows_past_the_real_tokens_are_untouched(monkeypatch):
    layer, md, q, _, cache = _small_step(monkeypatch)
    output = torch.full((8, HEADS, HEAD_SIZE), math.nan, dtype=torch.float16)
    q8 = torch.cat([q, q[:2]])
    layer.impl.forward(layer, q8, None, None, cache, md, output)
    assert not output[:6].isnan().any() and output[6:].isnan().all()


def test_forward_refuses_a_layer_the_builder_was_not_given(monkeypatch):
    layer, md, q, _, cache = _small_step(monkeypatch)
    layer.layer_name = "layer.3"
    with pytest.raises(ValueError, match=r"FLASH_ATTN forward: layer 'layer\.3' is not one of"):
        layer.impl.forward(layer, q, None, None, cache, md, torch.empty_like(q))


def test_metadata_is_frozen(monkeypatch):
    _, md, *_ = _small_step(monkeypatch)
    assert md.layer_names == frozenset({"layer.0"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.num_reqs = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.main.causal = False


def test_fa4_stand_in_matches_its_signature():
    """The stand-in must keep FA4's parameter list, or the tests above test nothing real."""
    import inspect

    assert frozenset(inspect.signature(fa4_varlen).parameters) == (reference_fa4_interface().params)
