"""anyattn.selector: priority per platform, explicit requests, errors, hints, cache."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from anyattn import registry, selector
from anyattn.config import AttentionSelectorConfig
from anyattn.selector import NoBackendError, clear_cache, explain, priority_list, select_backend
from anyattn.types import AttentionType, DeviceInfo

CPU = DeviceInfo.cpu()
SM80 = DeviceInfo.cuda(8, 0)
SM90 = DeviceInfo.cuda(9, 0)
SM100 = DeviceInfo.cuda(10, 0)
SM120 = DeviceInfo.cuda(12, 0)

CUDA_ORDER = ["FLASH_ATTN", "FLASHINFER", "TRITON", "FLEX_ATTENTION", "TORCH"]
BLACKWELL_ORDER = ["FLASHINFER", "FLASH_ATTN", "TRITON", "FLEX_ATTENTION", "TORCH"]
# sm90: FLASHINFER first, as measured on the H200 (benchmarks/RESULTS.md).
HOPPER_ORDER = BLACKWELL_ORDER
CPU_ORDER = ["TORCH", "FLEX_ATTENTION"]
# Which fakes run where, as the real backends do: TORCH and FLEX_ATTENTION also on the CPU.
DEVICES = {
    "FLASH_ATTN": ("cuda",),
    "FLASHINFER": ("cuda",),
    "TRITON": ("cuda",),
    "FLEX_ATTENTION": ("cpu", "cuda"),
    "TORCH": ("cpu", "cuda"),
}


def builtin_priority(name: str) -> dict[str, int]:
    """The rank per platform the built-in backend `name` declares in its own module."""
    module, _, cls = registry.AttentionBackendEnum[name].value.partition(":")
    return dict(getattr(importlib.import_module(module), cls).priority)


def config(**changes) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(**{"head_size": 128, "dtype": torch.bfloat16, **changes})


@pytest.fixture
def platform(make_backend, register):
    """Fakes under the five platform names, ranked as the built-in backends declare;
    `platform(unavailable=[...])` re-registers them."""

    def install(unavailable=(), **declarations):
        fakes = {}
        for name, devices in DEVICES.items():
            reason = f"pip install {name.lower()}" if name in unavailable else None
            fakes[name] = make_backend(
                name,
                devices=devices,
                unavailable=reason,
                priority=builtin_priority(name),
                **declarations,
            )
            register(name, fakes[name])
        return fakes

    return install


# --- priority --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "order"),
    [(CPU, CPU_ORDER), (SM80, CUDA_ORDER), (SM90, HOPPER_ORDER), (SM100, BLACKWELL_ORDER),
     (SM120, BLACKWELL_ORDER)],
)  # fmt: skip
def test_priority_order(platform, device, order):
    platform()
    names = priority_list(device)
    assert names[: len(order)] == order
    assert sorted(names) == sorted(registry.backend_names())
    # Walk down the list: with the first k unavailable here, the next one is chosen.
    for k, expected in enumerate(order):
        fakes = platform(unavailable=order[:k])
        assert select_backend(config(), device) is fakes[expected]
        result = explain(config(), device)
        assert result.chosen == expected
        assert [v.name for v in result.verdicts[: len(order)]] == order
        assert [v.priority for v in result.verdicts] == list(range(len(result.verdicts)))


def test_order_comes_from_each_backends_priority(platform, make_backend, register):
    platform()
    # A backend ranks itself: first on the CPU, absent (request only) on CUDA.
    register("MINE", make_backend("MINE", priority={"cpu": -1}))
    assert priority_list(CPU)[:3] == ["MINE", "TORCH", "FLEX_ATTENTION"]
    assert explain(config(), CPU).chosen == "MINE"
    assert priority_list(SM90)[-1] == "MINE"
    verdict = explain(config(), SM90).verdicts[-1]
    assert verdict.name == "MINE" and verdict.fits
    assert verdict.not_automatic == "declares no priority for hopper"
    assert explain(config(), SM90).chosen == "FLASHINFER"
    assert select_backend(config(), SM90, backend="MINE").get_name() == "MINE"


def test_backend_not_chosen_automatically_is_skipped_but_can_be_requested(
    platform, make_backend, register
):
    platform()
    only_for_encoders = classmethod(
        lambda cls, config, device: config.attn_type is not AttentionType.DECODER
    )
    fake = make_backend(
        "TORCH",
        priority=builtin_priority("TORCH"),
        chosen_automatically=only_for_encoders,
        supported_attn_types=tuple(AttentionType),
    )
    register("TORCH", fake)
    result = explain(config(), CPU)
    torch_verdict = next(v for v in result.verdicts if v.name == "TORCH")
    assert torch_verdict.fits
    assert torch_verdict.not_automatic == "not chosen automatically for this config"
    assert result.chosen == "FLEX_ATTENTION"
    assert "TORCH: fits, taken only on request (not chosen automatically" in (
        result.format_reasons()
    )
    assert result.to_dict()["backends"][0]["not_automatic"] == torch_verdict.not_automatic
    # An explicit request ignores it; an encoder config lets the selector take it.
    assert select_backend(config(), CPU, backend="TORCH") is fake
    assert explain(config(attn_type=AttentionType.ENCODER), CPU).chosen == "TORCH"
    # Nothing else fits: the hints name the request that would.
    flex = make_backend("FLEX_ATTENTION", unavailable="pip install flex",
                        priority=builtin_priority("FLEX_ATTENTION"))  # fmt: skip
    register("FLEX_ATTENTION", flex)
    with pytest.raises(NoBackendError) as raised:
        select_backend(config(), CPU)
    assert (
        "TORCH fits this config when requested explicitly (not chosen automatically for this "
        "config)" in raised.value.explanation.hints
    )


def test_cpu_skips_cuda_only_backends(platform):
    platform(unavailable=CPU_ORDER)
    with pytest.raises(NoBackendError) as raised:
        select_backend(config(), CPU)
    verdicts = {v.name: v for v in raised.value.explanation.verdicts}
    for name in ("FLASH_ATTN", "FLASHINFER", "TRITON"):
        assert verdicts[name].reasons == ("device cpu not supported (supported: cuda)",)


def test_capability_not_availability_decides_the_order(platform, make_backend, register):
    platform()
    # FLASH_ATTN needs sm90: on sm80 it is skipped for a capability reason.
    register(
        "FLASH_ATTN",
        make_backend(
            "FLASH_ATTN",
            devices=("cuda",),
            min_compute_capability=(9, 0),
            priority=builtin_priority("FLASH_ATTN"),
        ),
    )
    on_sm90 = explain(config(), SM90)
    assert next(v for v in on_sm90.verdicts if v.name == "FLASH_ATTN").fits
    result = explain(config(), SM80)
    assert result.chosen == "FLASHINFER"
    assert result.verdicts[0].reasons == (
        "compute capability sm80 not supported (needs sm90 or newer)",
    )


# --- explicit requests -----------------------------------------------------------------------


def test_request_by_argument(platform):
    fakes = platform()
    assert select_backend(config(), CPU) is fakes["TORCH"]
    assert select_backend(config(), CPU, backend="FLEX_ATTENTION") is fakes["FLEX_ATTENTION"]
    assert select_backend(config(), SM90, backend="triton") is fakes["TRITON"]
    result = explain(config(), CPU, backend="flex_attention")
    assert (result.chosen, result.requested, result.requested_by) == (
        "FLEX_ATTENTION",
        "FLEX_ATTENTION",
        "argument",
    )


def test_request_by_environment(platform, monkeypatch):
    fakes = platform()
    monkeypatch.setenv("ANYATTN_BACKEND", " flex_attention ")
    assert select_backend(config(), CPU) is fakes["FLEX_ATTENTION"]
    result = explain(config(), CPU)
    assert (result.requested, result.requested_by) == ("FLEX_ATTENTION", "ANYATTN_BACKEND")
    # The argument beats the environment.
    assert select_backend(config(), CPU, backend="TORCH") is fakes["TORCH"]
    monkeypatch.setenv("ANYATTN_BACKEND", "")
    assert explain(config(), CPU).requested is None


def test_requested_but_unfit_is_an_error_never_a_fallback(platform):
    platform()
    with pytest.raises(NoBackendError) as raised:
        select_backend(config(), CPU, backend="FLASH_ATTN")
    message = str(raised.value)
    assert message.startswith(
        "select_backend: requested backend FLASH_ATTN (from argument) cannot serve this config "
        "on cpu: device cpu not supported (supported: cuda). Remove the request"
    )
    assert "\nAll backends:\n" in message
    assert "  TORCH: fits" in message.splitlines()
    assert raised.value.explanation.chosen is None
    assert raised.value.explanation.requested == "FLASH_ATTN"


def test_requested_by_environment_but_unavailable(platform, monkeypatch):
    platform(unavailable=["FLASHINFER"])
    monkeypatch.setenv("ANYATTN_BACKEND", "FLASHINFER")
    with pytest.raises(NoBackendError) as raised:
        select_backend(config(), SM90)
    assert str(raised.value).startswith(
        "select_backend: requested backend FLASHINFER (from ANYATTN_BACKEND) cannot serve this "
        "config on cuda sm90: not available here: pip install flashinfer."
    )


def test_unknown_request_lists_valid_names(platform, monkeypatch):
    platform()
    with pytest.raises(ValueError) as raised:
        select_backend(config(), CPU, backend="FLASH_ATTN_9")
    assert not isinstance(raised.value, NoBackendError)
    assert "unknown backend name (got 'FLASH_ATTN_9', expected one of TORCH" in str(raised.value)
    for name in DEVICES:
        assert name in str(raised.value)
    monkeypatch.setenv("ANYATTN_BACKEND", "nope")
    with pytest.raises(ValueError, match=r"unknown backend name \(got 'nope'"):
        explain(config(), CPU)


# --- nothing fits ----------------------------------------------------------------------------


def test_nothing_fits_lists_every_backend_and_a_hint(platform):
    platform(features=["alibi"])
    with pytest.raises(NoBackendError) as raised:
        select_backend(config(has_alibi=True, use_mla=True), CPU)
    lines = str(raised.value).splitlines()
    assert lines[0] == "select_backend: no backend fits this config on cpu."
    backend_lines = lines[1 : 1 + len(registry.backend_names())]
    # An MLA config lists the MLA order: MLA backends first.
    assert [line.split(":")[0].strip() for line in backend_lines] == priority_list(CPU, True)
    assert backend_lines[0] == "  TORCH_MLA: ALiBi (has_alibi) not supported"
    assert "  TORCH: MLA (use_mla) not supported" in lines
    assert (
        "  FLASH_ATTN: device cpu not supported (supported: cuda); MLA (use_mla) not supported"
        in lines
    )
    assert lines[lines.index("Hints:") + 1 :] == [
        "  with has_alibi=False, TORCH_MLA would fit",
        "  with use_mla=False, TORCH would fit",
    ]


def test_hint_for_a_fitting_backend_missing_here(platform):
    platform(unavailable=CPU_ORDER)
    result = explain(config(), CPU)
    assert result.chosen is None
    assert result.hints == (
        "TORCH fits this config but is not available here: pip install torch",
        "FLEX_ATTENTION fits this config but is not available here: pip install flex_attention",
    )


def test_hints_name_single_setting_changes(platform, make_backend, register):
    platform()
    register("TORCH", make_backend("TORCH", kv_cache_dtypes=("auto",)))
    register(
        "FLEX_ATTENTION",
        make_backend("FLEX_ATTENTION", dtypes=(torch.float32,), kv_cache_dtypes=("auto", "fp8")),
    )
    result = explain(config(kv_cache_dtype="fp8"), CPU)
    assert result.chosen is None
    assert result.verdicts[0].reasons == ("kv_cache_dtype fp8 not supported (supported: auto)",)
    assert result.verdicts[1].reasons == ("dtype bfloat16 not supported (supported: float32)",)
    assert result.hints == (
        "with kv_cache_dtype='auto', TORCH would fit",
        "with dtype=float32, FLEX_ATTENTION would fit",
    )


def test_no_single_change_hint(platform):
    platform()
    result = explain(config(use_mla=True, use_sparse=True, has_alibi=True), CPU)
    assert result.chosen is None
    assert result.hints == ("no single setting change makes a backend fit; see the reasons above",)


# --- capability vs availability --------------------------------------------------------------


def test_capability_and_availability_are_marked_apart(platform):
    platform(unavailable=["FLASH_ATTN"])
    # A hypothetical sm80 asked about from this machine: capability judged for sm80.
    result = explain(config(), SM80)
    flash = result.verdicts[0]
    assert flash.name == "FLASH_ATTN"
    assert flash.reasons == () and flash.unavailable == "pip install flash_attn"
    assert not flash.fits
    assert result.chosen == "FLASHINFER"
    data = result.to_dict()
    assert data["backends"][0] == {
        "name": "FLASH_ATTN",
        "priority": 0,
        "fits": False,
        "reasons": [],
        "unavailable": "pip install flash_attn",
        "not_automatic": None,
    }
    json.dumps(data)


def test_unloadable_backend_is_unavailable_not_rejected(platform, register):
    platform()
    register("BROKEN", "anyattn_no_such_module:Backend")
    result = explain(config(), CPU)
    broken = next(v for v in result.verdicts if v.name == "BROKEN")
    assert broken.reasons == ()
    assert broken.unavailable.startswith("cannot be loaded: backend BROKEN: cannot import its")
    assert result.chosen == "TORCH"
    # Nothing is known about what it would accept, so no hint claims that it fits.
    nothing = explain(config(use_mla=True), CPU)
    assert not [h for h in nothing.hints if "BROKEN" in h]


def test_explanation_to_dict(platform):
    platform()
    data = explain(config(num_heads=8, num_kv_heads=2, kv_cache_dtype="float16"), SM90).to_dict()
    assert data["device"] == "cuda sm90"
    assert data["chosen"] == "FLASHINFER"
    assert data["config"]["dtype"] == "bfloat16"
    assert data["config"]["attn_type"] == "decoder"
    assert data["config"]["kv_cache_dtype"] == "float16"
    assert json.loads(json.dumps(data)) == data


def test_explain_rejects_non_configs():
    with pytest.raises(TypeError, match=r"config must be an AttentionSelectorConfig \(got dict\)"):
        explain({"head_size": 64})  # type: ignore[arg-type]


def test_default_device_is_this_machine():
    assert explain(config()).device == DeviceInfo.current()


# --- cache -----------------------------------------------------------------------------------


def test_results_are_cached_on_the_config(platform):
    fakes = platform()
    first = explain(config(), CPU)
    # An equal config built separately hits the same entry.
    assert explain(config(), CPU) is first
    assert select_backend(config(), CPU) is fakes["TORCH"]
    assert select_backend(config(), CPU) is select_backend(config(), CPU)
    assert explain(config(), SM90) is not first
    clear_cache()
    assert explain(config(), CPU) is not first


def test_register_backend_clears_the_cache(platform, make_backend, register):
    platform()
    first = explain(config(), CPU)
    replacement = make_backend("TORCH", priority=builtin_priority("TORCH"))
    register("TORCH", replacement)
    assert explain(config(), CPU) is not first
    assert select_backend(config(), CPU) is replacement


def test_environment_is_read_on_every_call(platform, monkeypatch):
    fakes = platform()
    assert select_backend(config(), CPU) is fakes["TORCH"]
    monkeypatch.setenv(selector.ENV_VAR, "FLEX_ATTENTION")
    # No clear_cache(): the variable is part of the lookup, not of the cached value.
    assert select_backend(config(), CPU) is fakes["FLEX_ATTENTION"]
