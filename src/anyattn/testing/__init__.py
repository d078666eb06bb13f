"""anyattn.testing: a conformance kit for attention backends.

Anyone writing a backend can check it, from their own pytest suite, against a float64 oracle
written from docs/semantics.md alone::

    from anyattn.testing import check_backend

    def test_my_backend_conforms():
        check_backend(MyBackend, "cuda", torch.bfloat16).assert_passed()

The pieces: `BatchSpec` and the curated `CATALOGUE`; `build_batch` (inputs, a shuffled paged
cache with a null block, the backend's own metadata); `attention_oracle` and the tolerance rule
(`error_bound`); `plan_cases` / `run_case` / `check_backend` and their `ConformanceReport`;
`declaration_cases` (every declared value, once each). MLA backends go through the same entry
points with `MLACase`s, judged against `mla_oracle` (`build_mla_batch`, `KitMLALayer`,
`run_mla_step` and `judge_mla_step` are their pieces).
"""

from anyattn.testing.batch_spec import CATALOGUE, QUICK_CATALOGUE, BatchSpec, get_spec
from anyattn.testing.blocks import assign_blocks
from anyattn.testing.cache_io import (
    dequantize_kv,
    quantize_kv,
    read_kv,
    read_latents,
    write_kv,
    write_latents,
)
from anyattn.testing.cases import FEATURES, Case, plan_cases
from anyattn.testing.check import ConformanceReport, KitLayer, check_backend, run_case
from anyattn.testing.mla_batch import MLABatch, build_mla_batch
from anyattn.testing.mla_cases import MLA_FEATURES, MLA_SHAPES, MLACase, MLAShape, plan_mla_cases
from anyattn.testing.mla_check import (
    KitMLALayer,
    MLAStepResult,
    judge_mla_step,
    mla_step,
    run_mla_case,
    run_mla_step,
)
from anyattn.testing.oracle import attention_oracle, mla_oracle, mla_up_project
from anyattn.testing.paged import PagedBatch, build_batch, layer_records
from anyattn.testing.sweep import SweepCase, declaration_cases, sweep_spec
from anyattn.testing.tolerance import CaseResult, error_bound, max_abs_error

__all__ = [
    "CATALOGUE", "FEATURES", "MLA_FEATURES", "MLA_SHAPES", "QUICK_CATALOGUE", "BatchSpec", "Case",
    "CaseResult", "ConformanceReport", "KitLayer", "KitMLALayer", "MLABatch", "MLACase", "MLAShape",
    "MLAStepResult", "PagedBatch", "SweepCase", "assign_blocks", "attention_oracle", "build_batch",
    "build_mla_batch", "check_backend", "declaration_cases", "dequantize_kv", "error_bound",
    "get_spec", "judge_mla_step", "layer_records", "max_abs_error", "mla_oracle", "mla_step",
    "mla_up_project", "plan_cases", "plan_mla_cases", "quantize_kv", "read_kv", "read_latents",
    "run_case", "run_mla_case", "run_mla_step", "sweep_spec", "write_kv", "write_latents",
]  # fmt: skip
