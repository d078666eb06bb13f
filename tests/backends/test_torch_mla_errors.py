"""MLA's refusals: each names the argument, what was given and what is accepted, and a refused
layer call writes nothing into the cache."""

from __future__ import annotations

import pytest
import torch
from mla_case import HEADS, LIMITS, SCALE, SIZES, STEP1, Schedule, make_layer, rope

from anyattn import AttentionSelectorConfig, DeviceInfo, MLAAttention
from anyattn.backends.torch_mla import TorchMLABackend, TorchMLAImpl, TorchMLAMetadataBuilder
from anyattn.config import AttentionSpec, MLAAttentionSpec
from anyattn.metadata import make_common_attn_metadata

L, R, P, VD = (SIZES[k] for k in SIZES)
CPU = DeviceInfo.cpu()


class SplitBackend(TorchMLABackend):
    """An MLA backend that takes only DeepSeek's 512 + 64 split."""

    @staticmethod
    def get_name() -> str:
        return "SPLIT_MLA"

    @classmethod
    def get_supported_mla_splits(cls) -> list[tuple[int, int]]:
        return [(512, 64)]


class SplitImpl(TorchMLAImpl):
    backend = SplitBackend


def _spec(**changes):
    return MLAAttentionSpec(**{"block_size": 4, "dtype": torch.float32, **SIZES, **changes})


def test_forward_on_an_mla_impl_is_refused():
    impl = TorchMLAImpl(HEADS, SCALE, **SIZES)
    with pytest.raises(
        TypeError,
        match=r"^TorchMLAImpl.forward: an MLA impl has no forward .*"
        r"expected forward_mqa for decode rows and forward_mha for prefill rows",
    ):
        impl.forward(None, None, None, None, None, None, None)  # fmt: skip


def test_a_split_the_backend_does_not_declare():
    impl = SplitImpl(HEADS, SCALE, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=P,
                     v_head_dim=VD)  # fmt: skip
    assert impl.head_size == 576
    with pytest.raises(
        ValueError,
        match=r"^SPLIT_MLA impl: latent split not supported \(got "
        r"kv_lora_rank=448, qk_rope_head_dim=128, expected one of 512\+64\)",
    ):
        SplitImpl(HEADS, SCALE, kv_lora_rank=448, qk_rope_head_dim=128, qk_nope_head_dim=P,
                  v_head_dim=VD)  # fmt: skip
    config = AttentionSelectorConfig(576, "bfloat16", use_mla=True, qk_rope_head_dim=128)
    assert SplitBackend.validate_configuration(config, CPU) == [
        "MLA latent split 448+128 not supported (supported kv_lora_rank+qk_rope_head_dim: 512+64)"
    ]
    unknown = SplitBackend.validate_configuration(config.replace(qk_rope_head_dim=None), CPU)
    assert unknown == [
        "MLA latent split of head_size 576 unknown (qk_rope_head_dim not given; supported "
        "kv_lora_rank+qk_rope_head_dim: 512+64)"
    ]
    assert SplitBackend.validate_configuration(config.replace(qk_rope_head_dim=64), CPU) == []
    assert SplitBackend.describe()["mla_splits"] == "512+64"


def test_impl_arguments():
    with pytest.raises(
        ValueError,
        match=r"^TORCH_MLA impl: v_head_dim must be a positive int "
        r"\(got 0\)",
    ):
        TorchMLAImpl(HEADS, SCALE, **{**SIZES, "v_head_dim": 0})  # fmt: skip
    with pytest.raises(ValueError, match=r"^TORCH_MLA impl: scale must be a positive finite"):
        TorchMLAImpl(HEADS, -1.0, **SIZES)

    class NotMLA(TorchMLAImpl):
        from anyattn.backends.torch_attn import TorchAttentionBackend as backend

    with pytest.raises(
        TypeError,
        match=r"^TORCH impl: an MLA impl needs an MLA backend \(got "
        r"TORCH, which declares is_mla\(\) False\)",
    ):
        NotMLA(HEADS, SCALE, **SIZES)  # fmt: skip


def test_builder_refusals():
    params = {"mla": TorchMLAImpl(HEADS, SCALE, **SIZES, workspace_tokens=3).layer_params()}
    with pytest.raises(
        ValueError,
        match=r"^TorchMLAMetadataBuilder: workspace_tokens too small "
        r"for one context chunk \(got 3, expected >= block_size 4",
    ):
        TorchMLAMetadataBuilder(_spec(), params, LIMITS, "cpu")  # fmt: skip
    standard = AttentionSpec(block_size=4, num_kv_heads=1, head_size=L + R, dtype=torch.float32)
    with pytest.raises(
        TypeError,
        match=r"kv_cache_spec must be an MLAAttentionSpec \(got "
        r"AttentionSpec\)",
    ):
        TorchMLAMetadataBuilder(standard, params, LIMITS, "cpu")  # fmt: skip
    ok = {"mla": TorchMLAImpl(HEADS, SCALE, **SIZES).layer_params()}
    with pytest.raises(
        ValueError,
        match=r"layer 'mla' has v_head_dim=10, but the KV-cache spec "
        r"says 6",
    ):
        TorchMLAMetadataBuilder(_spec(v_head_dim=6), ok, LIMITS, "cpu")  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"^MLAAttention\(mla\): workspace_tokens too small for "
        r"one context chunk \(got 2, expected >= block_size 4\)",
    ):
        make_layer(torch.float32, workspace=2)  # fmt: skip


def test_a_standard_backend_cannot_serve_an_mla_layer():
    with pytest.raises(
        ValueError,
        match=r"^MLAAttention\(attn\): backend TORCH cannot serve this "
        r"layer: .*MLA \(use_mla\) not supported",
    ):
        from anyattn.backends.torch_attn import TorchAttentionBackend

        MLAAttention(32, HEADS, **SIZES, scale=SCALE, backend=TorchAttentionBackend, device="cpu")


def _refused(schedule, md, hidden, kv_cache, error, message, layer=None):
    before = schedule.kv_cache.clone()
    positions = torch.arange(hidden.shape[0])
    with pytest.raises(error, match=message):
        (layer or schedule.layer)(hidden, rope(positions), kv_cache, md)
    assert torch.equal(schedule.kv_cache, before)  # nothing written


def test_refused_layer_calls_write_nothing():
    schedule = Schedule(make_layer(torch.float32), torch.float32)
    md = schedule.metadata(STEP1)
    n = md.num_actual_tokens
    hidden = torch.randn(n, 32)
    cache = schedule.kv_cache
    standard = torch.zeros(cache.shape[0], 2, 4, 1, L + R)
    _refused(schedule, md, hidden, standard, ValueError,
             r"kv_cache must be an MLA latent cache \['num_blocks', 4, 24\] .*\(got "
             r"\(\d+, 2, 4, 1, 24\)\)")  # fmt: skip
    _refused(schedule, md, hidden, cache.half(), ValueError,
             r"kv_cache dtype does not match kv_cache_dtype 'auto' \(got torch.float16, "
             r"expected torch.float32\)")  # fmt: skip
    _refused(schedule, md, hidden[:3], cache, ValueError,
             rf"hidden must be \[num_tokens, hidden_size\] with num_tokens >= the metadata's "
             rf"{n} tokens \(got \(3, 32\)\)")  # fmt: skip
    _refused(schedule, md.common_attn_metadata, hidden, cache, TypeError,
             r"attn_metadata must come from MLAMetadataBuilder.build \(got "
             r"CommonAttentionMetadata\)")  # fmt: skip
    small = cache[:3]
    _refused(schedule, md, hidden, small, ValueError,
             r"slot_mapping has a slot outside the cache")  # fmt: skip
    other = make_layer(torch.float32)
    other.layer_name = "other"
    _refused(schedule, md, hidden, cache, ValueError,
             r"layer 'other' is not one of the layers the metadata builder was made for",
             layer=other)  # fmt: skip
    fp8 = make_layer(torch.float32, kv_cache_dtype="fp8")
    fp8_schedule = Schedule(fp8, torch.float32)
    fp8.k_scale = torch.tensor([1.0, 2.0])
    _refused(fp8_schedule, fp8_schedule.metadata(STEP1), hidden, fp8_schedule.kv_cache,
             ValueError, r"layer.k_scale must be a float32 tensor of shape \[\] or \[1\] for an "
             r"fp8 KV cache \(got \(2,\)\)")  # fmt: skip


def test_refused_hidden_and_rope_outputs_write_nothing():
    schedule = Schedule(make_layer(torch.float32), torch.float32)
    md = schedule.metadata(STEP1)
    n, cache = md.num_actual_tokens, schedule.kv_cache
    _refused(schedule, md, torch.randn(n, 31), cache, ValueError,
             rf"hidden must have the layer's hidden_size columns \(got \({n}, 31\), expected "
             r"\[num_tokens, 32\]\)")  # fmt: skip
    _refused(schedule, md, torch.randn(n, 32, dtype=torch.bfloat16), cache, ValueError,
             r"hidden must be in the layer's dtype \(got torch.bfloat16, expected "
             r"torch.float32\)")  # fmt: skip
    hidden = torch.randn(n, 32)
    expected = (
        rf"rope must return \(q_pe \[{n}, 4, 8\], k_pe \[{n}, 1, 8\]\) in torch.float32 on cpu"
    )
    bad_ropes = {
        rf"{expected} \(got q_pe \[{n}, 4, 8\] torch.float32 on cpu, k_pe \[{n}, 8\] ": (
            lambda q_pe, k_pe: (q_pe, k_pe[:, 0])
        ),
        rf"{expected} \(got q_pe \[{n}, 4, 8\] torch.float64 on cpu": (
            lambda q_pe, k_pe: (q_pe.double(), k_pe)
        ),
    }
    before = cache.clone()
    for message, bad_rope in bad_ropes.items():
        with pytest.raises(ValueError, match=message):
            schedule.layer(hidden, bad_rope, cache, md)
    with pytest.raises(TypeError, match=rf"{expected} \(got Tensor\)"):
        schedule.layer(hidden, lambda q_pe, k_pe: q_pe, cache, md)
    assert torch.equal(cache, before)  # nothing written


def test_the_layer_builds_no_autograd_graph():
    layer = MLAAttention(32, HEADS, **SIZES, scale=SCALE, block_size=4, device="cpu",
                         layer_name="mla", workspace_tokens=8)  # fmt: skip
    assert not any(p.requires_grad for p in layer.parameters())
    schedule = Schedule(layer, torch.float32)
    _, out = schedule.run(STEP1)
    assert all(rows.grad_fn is None and not rows.requires_grad for rows in out.values())


def test_entry_points_check_their_tensors():
    schedule = Schedule(make_layer(torch.float32), torch.float32)
    md = schedule.metadata({"A": 1, "E": 1})  # two decodes
    impl, layer, cache = schedule.layer.impl, schedule.layer, schedule.kv_cache
    q_latent, q_pe = torch.randn(2, HEADS, L), torch.randn(2, HEADS, R)
    with pytest.raises(
        ValueError,
        match=r"^TORCH_MLA forward_mqa: q_latent must be \[2, 4, 16\] "
        r"\(got \[2, 4, 24\]\)",
    ):
        impl.forward_mqa(layer, torch.randn(2, HEADS, L + R), q_pe, cache, md, q_latent.clone())
    with pytest.raises(
        ValueError,
        match=r"output_lse must be float32 \[4, >= 2\] on cpu \(got "
        r"torch.float32 \(2, 4\) on cpu\)",
    ):
        impl.forward_mqa(layer, q_latent, q_pe, cache, md, q_latent.clone(), torch.empty(2, 4))
    with pytest.raises(ValueError, match=r"^TORCH_MLA forward_mha: q must be \[0, 4, 20\]"):
        impl.forward_mha(layer, q_latent, q_latent[:, 0], q_pe[:, 0], cache, md, q_latent)
    with pytest.raises(
        ValueError,
        match=r"^TorchMLAImpl.do_kv_cache_update: kv_cache must be an "
        r"MLA latent cache",
    ):
        impl.do_kv_cache_update(layer, torch.randn(2, L), torch.randn(2, R), cache[..., :8],
                                md.slot_mapping, md)  # fmt: skip


@pytest.mark.parametrize("bad", [-3, "num_blocks", 10**6])
def test_a_bad_block_id_in_a_column_only_read_is_refused_before_any_write(bad):
    """Request B's first column holds context the step only reads: a negative id or one at or
    past the cache's end there is refused by name, and the cache is left bit-identical."""
    schedule = Schedule(make_layer(torch.float32), torch.float32)
    schedule.run(STEP1)
    step = {"A": 1, "E": 1, "B": 5, "C": 3, "D": 7}
    num_blocks = schedule.kv_cache.shape[0]
    bad = num_blocks if bad == "num_blocks" else bad
    table = schedule.block_table[[schedule.rows[r] for r in step]].clone()
    table[2, 0] = bad  # B: 13 cached tokens in columns 0-3, this step's 5 in columns 3-4
    seq_lens = [schedule.done[r] + n for r, n in step.items()]
    common = make_common_attn_metadata(list(step.values()), seq_lens, table, 4)
    md = schedule.builder.build(0, common)
    hidden = torch.randn(md.num_actual_tokens, 32)
    message = (
        rf"block_table_tensor has a block outside the cache for request 2, column 0 "
        rf"\(got {bad}, expected 0 <= block < num_blocks = {num_blocks} in the 5 columns"
    )
    _refused(schedule, md, hidden, schedule.kv_cache, ValueError, message)


def test_a_layer_call_checks_the_cache_and_step_once(monkeypatch):
    """`MLAAttention.forward` checks the cache, the step and the write once; its impl's entry
    points skip those checks inside the call, and check them again when called directly."""
    import anyattn.validation_mla as validation_mla

    schedule = Schedule(make_layer(torch.float32), torch.float32)
    schedule.run(STEP1)
    calls = {"step": 0, "write": 0}
    step_check = validation_mla.check_step_against_cache
    write_check = validation_mla.check_mla_write_args

    def count(name, check):
        def counted(*args, **kwargs):
            calls[name] += 1
            return check(*args, **kwargs)

        return counted

    monkeypatch.setattr(validation_mla, "check_step_against_cache", count("step", step_check))
    monkeypatch.setattr(validation_mla, "check_mla_write_args", count("write", write_check))
    md, _ = schedule.run({"A": 1, "E": 1, "B": 5})  # decodes and a prefill: every entry point
    assert calls == {"step": 1, "write": 1}  # the write's own rows: shapes only
    with pytest.raises(ValueError, match=r"^TorchMLAImpl.do_kv_cache_update: kv_cache must be"):
        schedule.layer.impl.do_kv_cache_update(
            schedule.layer, torch.randn(2, L), torch.randn(2, R), schedule.kv_cache[..., :8],
            md.slot_mapping, md,
        )  # fmt: skip


def test_rows_past_the_steps_slots_are_refused_by_name():
    """`hidden` may hold padding rows past the step's tokens only when the slot mapping covers
    them (-1): a step whose slots stop at its tokens is refused before the write."""
    schedule = Schedule(make_layer(torch.float32), torch.float32)
    md = schedule.metadata(STEP1)
    hidden = torch.randn(md.num_actual_tokens + 2, 32)
    message = r"do_kv_cache_update: slot_mapping must be 1-D with at least num_tokens entries"
    _refused(schedule, md, hidden, schedule.kv_cache, ValueError, message)
