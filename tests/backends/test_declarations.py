"""Every value each shipped backend declares, run at least once against the float64 oracle.

The cases come from `anyattn.testing.sweep.declaration_cases` (every head size with every dtype,
every dtype with every KV-cache dtype, each attention type, block size, layout and feature).
Test ids read `<BACKEND>-<device>-<axis>-<value>...`, so the sweep runs in slices:
`pytest -m gpu tests/backends/test_declarations.py -k "FLASHINFER and head_size"`.
CUDA cases carry the `gpu` marker; CPU cases are `slow`.
"""

from __future__ import annotations

import pytest
import torch

from anyattn.registry import AttentionBackendEnum, get_backend_class
from anyattn.testing import run_case
from anyattn.testing.sweep import declaration_cases

_SHIPPED = [member.name for member in AttentionBackendEnum]


def _params() -> list:
    params = []
    for name in _SHIPPED:
        backend = get_backend_class(name)
        for device in backend.supported_device_types:
            mark = pytest.mark.gpu if device == "cuda" else pytest.mark.slow
            skip = backend.get_unavailable_reason()
            if device == "cuda" and not torch.cuda.is_available():
                skip = "no CUDA device"
            if skip is not None:
                marks = [mark, pytest.mark.skip(reason=f"{name}: {skip}")]
                params.append(pytest.param(name, device, None, id=f"{name}-{device}", marks=marks))
                continue
            for sweep_case in declaration_cases(backend, device)[0]:
                case_id = f"{name}-{device}-{sweep_case.id}"
                params.append(pytest.param(name, device, sweep_case, id=case_id, marks=mark))
    return params


@pytest.mark.parametrize(("name", "device", "sweep_case"), _params())
def test_declared_value_matches_the_oracle(name, device, sweep_case):
    backend = get_backend_class(name)
    results = run_case(backend, sweep_case.case, device, sweep_case.dtype)
    failures = [r for r in results if not r.passed]
    assert not failures, "; ".join(
        f"{r.name}: {r.detail} (error {r.max_error:.3g}, bound {r.bound:.3g})" for r in failures
    )
