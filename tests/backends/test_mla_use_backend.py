"""`MLAAttention.use_backend`: a DeepSeek-style layer (low-rank query) moves from TORCH_MLA to
a registered test MLA backend and back, keeps its weights, and gives the same output, which
matches the float64 MLA reference of mla_case.py; backends that cannot serve it are refused
and leave the layer as it was."""

from __future__ import annotations

import pytest
import torch
from mla_case import STEP1, STEP2, Schedule, bound, make_layer, reference

from anyattn.backends.torch_attn import TorchAttentionBackend
from anyattn.backends.torch_mla import TorchMLABackend, TorchMLAImpl

DTYPE = torch.float32


class CountingMLAImpl(TorchMLAImpl):
    """TORCH_MLA's arithmetic under another impl class, counting its entry-point calls."""

    calls = 0

    def forward_mqa(self, *args, **kwargs):
        type(self).calls += 1
        super().forward_mqa(*args, **kwargs)

    def forward_mha(self, *args, **kwargs):
        type(self).calls += 1
        super().forward_mha(*args, **kwargs)


def _outputs(layer) -> dict[tuple[int, str], torch.Tensor]:
    """The layer's output rows for the two-step schedule over a fresh cache."""
    schedule = Schedule(layer, DTYPE)
    rows = {}
    for step_index, step in enumerate((STEP1, STEP2)):
        _, out = schedule.run(step)
        rows.update({(step_index, request): r for request, r in out.items()})
    return rows


def _check_against_reference(layer, outputs) -> None:
    schedule = Schedule(layer, DTYPE)  # only for the drawn hidden states (same seed)
    done: dict[str, int] = {}
    for step_index, step in enumerate((STEP1, STEP2)):
        for request, count in step.items():
            start = done.get(request, 0)
            done[request] = start + count
            x = schedule.hidden[request][: done[request]]
            ref64 = reference(layer, x, torch.float64)[start:]
            ref_lowp = reference(layer, x, DTYPE)[start:]
            error = (outputs[step_index, request].double() - ref64).abs().max().item()
            assert error <= bound(ref64, ref_lowp, DTYPE), (step_index, request, error)


def test_layer_switches_backend_keeps_weights_and_gives_the_same_output(register_mla_variant):
    test_backend = register_mla_variant("TEST_MLA", CountingMLAImpl)
    layer = make_layer(DTYPE, q_lora_rank=24)
    assert layer.backend is TorchMLABackend
    weights = {name: (p, p.clone()) for name, p in layer.named_parameters()}
    record = layer.impl.layer_params()
    on_torch = _outputs(layer)

    CountingMLAImpl.calls = 0
    layer.use_backend(test_backend)
    assert layer.backend is test_backend and type(layer.impl) is CountingMLAImpl
    assert layer.impl.layer_params() == record
    on_test = _outputs(layer)
    assert CountingMLAImpl.calls == 4  # decode and prefill rows in each of the two steps
    for name, p in layer.named_parameters():
        assert p is weights[name][0] and torch.equal(p, weights[name][1])
    assert on_test.keys() == on_torch.keys()
    for key, rows in on_test.items():
        assert torch.equal(rows, on_torch[key]), key
    _check_against_reference(layer, on_test)

    layer.use_backend(TorchMLABackend, prefill_backend=TorchMLABackend)
    assert layer.backend is TorchMLABackend and type(layer.impl) is TorchMLAImpl
    assert all(torch.equal(rows, on_torch[key]) for key, rows in _outputs(layer).items())


def test_backends_that_cannot_serve_the_layer_are_refused_and_change_nothing(
    register_mla_variant,
):
    test_backend = register_mla_variant("TEST_MLA", CountingMLAImpl)
    layer = make_layer(DTYPE, q_lora_rank=24)
    backend, impl = layer.backend, layer.impl
    with pytest.raises(
        ValueError,
        match=r"^MLAAttention\(mla\): backend TORCH cannot serve this layer: .*"
        r"MLA \(use_mla\) not supported",
    ):
        layer.use_backend(TorchAttentionBackend)
    with pytest.raises(ValueError, match=r"prefill_backend TEST_MLA differs from backend "):
        layer.use_backend(TorchMLABackend, prefill_backend=test_backend)
    with pytest.raises(TypeError, match=r"backend must be an AttentionBackend class \(got "):
        layer.use_backend("TEST_MLA")  # type: ignore[arg-type]
    assert layer.backend is backend and layer.impl is impl
