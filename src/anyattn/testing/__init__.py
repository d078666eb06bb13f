"""anyattn.testing: a conformance kit for attention backends.

Anyone writing a backend can check it, from their own pytest suite, against a float64 oracle
written from docs/semantics.md alone::

    from anyattn.testing import check_backend

    def test_my_backend_conforms():
        check_backend(MyBackend, "cuda", torch.bfloat16).assert_passed()

The pieces: `BatchSpec` and the curated `CATALOGUE` (decodes, long prefill, mixed, chunked
prefill over long contexts, odd lengths 1/7/97/1025, encoder, cross attention, cascade);
`build_batch` (inputs, a shuffled paged cache with a null block, the backend's own metadata)
and `layer_records` (plain records of a KV-cache group's layers, for a builder);
`attention_oracle` (dense, per-request loops, any dtype); the tolerance rule (`error_bound`);
`plan_cases` / `run_case` / `check_backend` and the `ConformanceReport` they fill;
`declaration_cases` (the sweep: every value a backend declares, once each).
"""

from anyattn.testing.batch_spec import CATALOGUE, QUICK_CATALOGUE, BatchSpec, get_spec
from anyattn.testing.blocks import assign_blocks
from anyattn.testing.cache_io import dequantize_kv, quantize_kv, read_kv, write_kv
from anyattn.testing.cases import FEATURES, Case, plan_cases
from anyattn.testing.check import KitLayer, check_backend, run_case
from anyattn.testing.mla_oracle import mla_oracle, mla_up_project
from anyattn.testing.oracle import attention_oracle
from anyattn.testing.paged import PagedBatch, build_batch, layer_records
from anyattn.testing.report import CaseResult, ConformanceReport
from anyattn.testing.sweep import SweepCase, declaration_cases, sweep_spec
from anyattn.testing.tolerance import error_bound, max_abs_error

__all__ = [
    "CATALOGUE",
    "FEATURES",
    "QUICK_CATALOGUE",
    "BatchSpec",
    "Case",
    "CaseResult",
    "ConformanceReport",
    "KitLayer",
    "PagedBatch",
    "SweepCase",
    "assign_blocks",
    "attention_oracle",
    "build_batch",
    "check_backend",
    "declaration_cases",
    "dequantize_kv",
    "error_bound",
    "get_spec",
    "layer_records",
    "max_abs_error",
    "mla_oracle",
    "mla_up_project",
    "plan_cases",
    "quantize_kv",
    "read_kv",
    "run_case",
    "sweep_spec",
    "write_kv",
]
