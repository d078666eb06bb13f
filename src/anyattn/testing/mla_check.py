"""Run one MLA conformance case and judge it against the float64 MLA oracle.

The kit plays the model's `MLAAttention` layer with its own weights and arithmetic, so that
nothing of the backend under test judges it; docs/mla.md ("Conformance") states how (which
rows go to `forward_mqa` and `forward_mha`, strides, the exact checks, context chunks, and
`v_scale = 4 * k_scale` to catch a backend that reads it). Outputs start as NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from anyattn.backend import AttentionBackend
from anyattn.mla_impl import MLAAttentionImpl
from anyattn.testing.mla_batch import MLABatch, build_mla_batch
from anyattn.testing.mla_cases import MLACase
from anyattn.testing.oracle import mla_oracle
from anyattn.testing.tolerance import CaseResult, cache_problems, judge_against_oracle, judge_lse

__all__ = [
    "KitMLALayer", "MLAStepResult", "judge_mla_step", "mla_step", "run_mla_case", "run_mla_step",
]  # fmt: skip


@dataclass
class KitMLALayer:
    """The `layer` argument the kit passes to an MLA impl.

    Attributes:
        layer_name: the layer's name.
        k_scale: float32 `[]`, the per-layer fp8 cache scale (1.0 otherwise).
        v_scale: float32 `[]`, unused by MLA (docs/mla.md); the kit gives it another value
            than `k_scale` so that a backend that reads it is caught.
        w_uk: `[num_heads, P, L]`, w_uv: `[num_heads, Vd, L]`, model dtype.
        up_project_rows: the number of rows of every `up_project` call, in order.
        new_latents: `[T, L]`, the step's new latents as given to the impl, or None.
        up_project_context_rows: per `up_project` call, in order, its rows that are not bit
            for bit one of `new_latents` (all of them when `new_latents` is None): the
            cached context rows it up-projected.
    """

    layer_name: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    up_project_rows: list[int] = field(default_factory=list)
    new_latents: torch.Tensor | None = None
    up_project_context_rows: list[int] = field(default_factory=list)

    def up_project(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`c_kv [N, L]` -> `(k_nope [N, num_heads, P], v [N, num_heads, Vd])`, as the layer's
        `kv_b_proj` gives them, all in the model dtype (else a ValueError)."""
        rank, dtype = self.w_uk.shape[-1], self.w_uk.dtype
        if c_kv.dim() != 2 or c_kv.shape[1] != rank or c_kv.dtype != dtype:
            raise ValueError(
                f"up_project: c_kv must be [N, {rank}] in {dtype} (got {tuple(c_kv.shape)} in "
                f"{c_kv.dtype})."
            )
        self.up_project_rows.append(c_kv.shape[0])
        self.up_project_context_rows.append(c_kv.shape[0] - self._num_new_rows(c_kv))
        k_nope = torch.einsum("nl,hpl->nhp", c_kv, self.w_uk)
        v = torch.einsum("nl,hvl->nhv", c_kv, self.w_uv)
        return k_nope, v

    def _num_new_rows(self, c_kv: torch.Tensor) -> int:
        """How many rows of `c_kv` are, bit for bit, one of `new_latents`."""
        if self.new_latents is None or c_kv.shape[0] == 0:
            return 0

        def rows(x: torch.Tensor) -> list[bytes]:  # via bytes: bfloat16 has no numpy dtype
            return [bytes(r) for r in x.detach().contiguous().view(torch.uint8).cpu().numpy()]

        new = set(rows(self.new_latents))
        return sum(row in new for row in rows(c_kv))


@dataclass
class MLAStepResult:
    """What one step through an MLA impl gave.

    Attributes:
        output: `[num_tokens + num_padding_tokens, num_heads, Vd]`, model dtype (NaN rows
            past `num_actual_tokens`).
        output_lse: float32 `[num_heads, num_decode_tokens]` as the impl returned it, or None.
        num_decodes, num_decode_tokens: the metadata's decode requests and rows.
        lse_base_on_e: the impl's LSE base (False: log2).
    """

    output: torch.Tensor
    output_lse: torch.Tensor | None
    num_decodes: int
    num_decode_tokens: int
    lse_base_on_e: bool


def _make_impl(backend: type[AttentionBackend], case: MLACase) -> MLAAttentionImpl:
    shape = case.shape
    # The layer's default workspace unless the case sets one.
    workspace = {} if case.workspace_tokens is None else {"workspace_tokens": case.workspace_tokens}
    return backend.get_impl_cls()(
        case.num_heads, case.scale, kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim, qk_nope_head_dim=shape.qk_nope_head_dim,
        v_head_dim=shape.v_head_dim, kv_cache_dtype=case.kv_cache_dtype, **workspace,
    )  # fmt: skip


def mla_step(
    impl: MLAAttentionImpl, layer: KitMLALayer, batch: MLABatch, want_lse: bool = False
) -> MLAStepResult:
    """Run one step through an MLA impl as the layer would (see the module docstring): write
    the step's latents, absorb and run the decode rows, run the prefill rows.

    Args:
        impl: an `MLAAttentionImpl` whose builder built `batch.attn_metadata`.
        layer: the kit's layer, with `batch`'s weights and cache scale.
        want_lse: pass an `output_lse` to `forward_mqa`.
    """
    md = batch.attn_metadata
    num_heads, rank = batch.w_uk.shape[0], batch.shape.kv_lora_rank
    # As the layer's: k_pe a column slice of the [T, L + R] latent projection (row stride L + R).
    k_pe = torch.cat([batch.kv_c, batch.k_pe], dim=-1)[:, rank:]
    impl.do_kv_cache_update(
        layer, batch.kv_c, k_pe, batch.kv_cache, batch.common_attn_metadata.slot_mapping, md
    )
    n = batch.num_actual_tokens
    # The decode split every MLA builder's metadata states (docs/mla.md).
    num_decodes = getattr(md, "num_decodes", None)
    num_decode_tokens = getattr(md, "num_decode_tokens", None)
    if not isinstance(num_decodes, int) or not isinstance(num_decode_tokens, int):
        raise TypeError(
            f"MLA metadata must say its decode split as int num_decodes and num_decode_tokens "
            f"(got {type(md).__name__} with {num_decodes!r} and {num_decode_tokens!r})."
        )
    dtype, device = batch.q_nope.dtype, batch.q_nope.device
    # NaN everywhere: rows the backend forgets to write show up as NaN errors.
    output_shape = (batch.q_nope.shape[0], num_heads, batch.shape.v_head_dim)
    output = torch.full(output_shape, math.nan, dtype=dtype, device=device)
    output_lse = None
    if num_decode_tokens:
        d = num_decode_tokens
        # q_latent: [d, num_heads, L]; latent output likewise, values up-projected after.
        q_latent = torch.einsum("thp,hpl->thl", batch.q_nope[:d], batch.w_uk).contiguous()
        latent_output = torch.full((d, num_heads, rank), math.nan, dtype=dtype, device=device)
        if want_lse:
            output_lse = torch.full((num_heads, d), math.nan, dtype=torch.float32, device=device)
        impl.forward_mqa(
            layer, q_latent, batch.q_pe[:d], batch.kv_cache, md, latent_output, output_lse
        )
        output[:d] = torch.einsum("thl,hvl->thv", latent_output, batch.w_uv)
    if n > num_decode_tokens:
        rows = slice(num_decode_tokens, n)
        query = torch.cat([batch.q_nope[rows], batch.q_pe[rows]], dim=-1)
        impl.forward_mha(
            layer, query, batch.kv_c[rows], k_pe[rows], batch.kv_cache, md, output[rows]
        )
    base_on_e = getattr(impl, "lse_base_on_e", True)
    return MLAStepResult(output, output_lse, num_decodes, num_decode_tokens, base_on_e)


def _exact_problems(
    case: MLACase, batch: MLABatch, layer: KitMLALayer, outcome: MLAStepResult
) -> list[str]:
    problems = cache_problems(batch.kv_cache, batch.expected_kv_cache)
    decode_rows = sum(batch.spec.query_lens[: outcome.num_decodes])
    if outcome.num_decode_tokens != decode_rows:
        problems.append(
            f"metadata: num_decode_tokens {outcome.num_decode_tokens} is not the "
            f"{decode_rows} rows of its {outcome.num_decodes} decode requests"
        )
    if case.min_context_chunks:
        workspace = case.workspace_tokens or 0
        # New tokens may be up-projected in any calls; each call's context rows are a chunk.
        chunks = [rows for rows in layer.up_project_context_rows if rows]
        if len(chunks) < case.min_context_chunks or max(chunks, default=0) > workspace:
            problems.append(
                f"context not read in >= {case.min_context_chunks} chunks of <= {workspace} "
                f"rows (up_project calls of {layer.up_project_rows} rows, of which "
                f"{layer.up_project_context_rows} context rows)"
            )
    return problems


def judge_mla_step(
    case: MLACase, batch: MLABatch, layer: KitMLALayer, outcome: MLAStepResult, dtype: torch.dtype,
    *, by_phase: bool = False,
) -> list[CaseResult]:  # fmt: skip
    """Judge a step `run_mla_step` ran against `mla_oracle` and the exact checks.

    Args:
        by_phase: judge the decode rows (`<name>.decode`) and the prefill rows
            (`<name>.prefill`) as two results, each against its own rows' bound, and the exact
            checks as a third (`<name>.exact`), so that a failure says which path is wrong;
            default: one result for the whole output, the exact checks folded in.

    Returns:
        The output's result(s), plus `<name>.lse` when the case checks the decode LSE.
    """
    n, d = batch.num_actual_tokens, outcome.num_decode_tokens
    kv_c, k_pe = batch.oracle_latents(outcome.num_decodes)
    inputs = (batch.q_nope[:n], batch.q_pe[:n], kv_c, k_pe, batch.w_uk, batch.w_uv)
    lengths = (batch.spec.query_lens, batch.spec.seq_lens)
    ref64, lse64 = mla_oracle(*inputs, *lengths, scale=case.scale)
    ref_lowp, lse_lowp = mla_oracle(*inputs, *lengths, scale=case.scale, compute_dtype=dtype)
    problems = _exact_problems(case, batch, layer, outcome)
    output = outcome.output[:n]
    if by_phase:
        phases = {"decode": slice(0, d), "prefill": slice(d, n)}
        results = []
        for phase, rows in phases.items():
            if rows.stop > rows.start:
                name = f"{case.name}.{phase}"
                args = (output[rows], ref64[rows], ref_lowp[rows], dtype, [], case.feature)
                results.append(judge_against_oracle(name, *args))
        detail = "; ".join(problems)
        results.append(
            CaseResult(f"{case.name}.exact", 0.0, 0.0, not problems, detail, case.feature)
        )
    else:
        results = [
            judge_against_oracle(case.name, output, ref64, ref_lowp, dtype, problems, case.feature)
        ]
    if outcome.output_lse is not None:
        lse, base_on_e = outcome.output_lse, outcome.lse_base_on_e
        results.append(
            judge_lse(case.name, lse, base_on_e, lse64[:, :d], lse_lowp[:, :d], case.feature)
        )
    return results


def run_mla_step(
    backend: type[AttentionBackend], case: MLACase, device: torch.device, dtype: torch.dtype,
    seed: int,
) -> tuple[MLABatch, KitMLALayer, MLAStepResult]:  # fmt: skip
    """Build `case`'s batch for a new impl of `backend` and run one step through it
    (`mla_step`); raises what the backend raises. `judge_mla_step` judges what it returns."""
    impl = _make_impl(backend, case)
    # Impl first: the builder learns its layer before it builds, as in the engine.
    params = impl.layer_params()
    batch = build_mla_batch(
        backend, case.spec, shape=case.shape, num_heads=case.num_heads, dtype=dtype,
        device=device, block_size=case.block_size, kv_cache_dtype=case.kv_cache_dtype,
        k_scale=case.k_scale(), num_padding_tokens=case.num_padding_tokens,
        layers={"layer.0": params}, seed=seed,
    )  # fmt: skip
    new_latents = batch.kv_c[: batch.num_actual_tokens]
    # v_scale differs from k_scale so that a backend that reads it (MLA has none) is caught.
    layer = KitMLALayer(
        "layer.0", batch.k_scale, batch.k_scale * 4, batch.w_uk, batch.w_uv,
        new_latents=new_latents,
    )  # fmt: skip
    return batch, layer, mla_step(impl, layer, batch, case.check_lse)


def run_mla_case(
    backend: type[AttentionBackend], case: MLACase, device: torch.device, dtype: torch.dtype,
    seed: int,
) -> list[CaseResult]:  # fmt: skip
    """Run one MLA case (see `anyattn.testing.plan_cases`); raises what the backend raises
    (`anyattn.testing.run_case` turns that into a failed result)."""
    return judge_mla_step(case, *run_mla_step(backend, case, device, dtype, seed), dtype)
