"""Re-planning FlashInfer's tensor-core decode wrapper for a new batch, in a few microseconds.

`BatchDecodeWithPagedKVCacheWrapper.plan()` re-derives on every call what depends only on the
layer (dtypes, backend choice, compiled-module lookup, checks), converts its inputs with host
copies, and only then runs the C++ planner. For a decode wrapper that `plan()` has already set up
for a layer signature, a new step changes only the batch: the index buffers the kernel reads,
the host arrays the C++ planner reads, and the plan info that planner returns. `replan_decode`
does exactly that part of FlashInfer 0.7.2.post1's `plan()` (the fa2 tensor-core branch of
`flashinfer/decode.py`, which is what FLASHINFER's decode wrappers use), the way FlashInfer's
own `fast_decode_plan` does for speculative decoding, but with host arrays from the builder so
nothing is read back from the device.

It depends on that version's private wrapper fields; `can_replan` checks them and the installed
version, and the builder falls back to `plan()` whenever it says no.
"""

from __future__ import annotations

from typing import Any

import torch

from anyattn.backends.flashinfer_layouts import DecodeLayout
from anyattn.backends.flashinfer_plan import PagedArrays

__all__ = [
    "REPLAN_VERSION",
    "can_replan",
    "keep_schedule",
    "planner_arguments",
    "replan_decode",
    "schedule_is_fixed",
]

# The FlashInfer release whose `plan()` internals `replan_decode` reproduces.
REPLAN_VERSION = "0.7.2.post1"


def can_replan(wrapper: Any, installed_version: str | None) -> bool:
    """Whether `wrapper` is a decode wrapper that FlashInfer's `plan()` has set up on the fa2
    tensor-core path of the version `replan_decode` reproduces."""
    try:
        return (
            installed_version == REPLAN_VERSION
            and wrapper.use_tensor_cores
            and wrapper._backend == "fa2"
            and not wrapper._uses_cudnn
            and wrapper._jit_module is None
            and getattr(wrapper, "_cached_module", None) is not None
            and getattr(wrapper, "_plan_info", None) is not None
            and getattr(wrapper, "_q_len_per_req", 1) == 1
        )
    except AttributeError:
        return False


def schedule_is_fixed(num_reqs: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether the fa2 planner gives an eager (not CUDA-graph) batch of `num_reqs`
    single-token decodes the same schedule whatever the requests' lengths, so that a wrapper
    planned for one such batch needs no planner for the next of the same size.

    FlashInfer 0.7.2.post1's `PrefillPlan` allows `M = 2 * num_sms // num_kv_heads` work units
    per KV head for a split batch, takes the shortest KV chunk that keeps the units within `M`
    and splits only if that chunk is shorter than the longest request. With `num_reqs >= M`,
    any chunk shorter than the longest request gives more than `M` units, so the batch is never
    split (with a sliding window too: the search runs on the windowed lengths). Each request
    then gets one unit per query tile, and the query tile is fixed by the wrapper (its GQA
    group, head size and cache dtype), so the schedule (unit indices, output offsets, grid
    size) depends on the batch size alone. The chunk size the planner also writes (the
    longest request's) is read by the kernel only for a split batch.
    """
    return num_reqs >= (2 * num_sms) // num_kv_heads


def keep_schedule(wrapper: Any, layout: DecodeLayout) -> bool:
    """`replan_decode(wrapper, layout, None, run_planner=False, ...)` at the cost of a few
    attribute writes, for a wrapper `replan_decode` may plan (`can_replan`) whose last plan was
    for a batch of this size with a schedule that depends on the size alone (see
    `run_planner`): an eager wrapper is pointed at the layout (its query offsets, one row per
    request, are already those of this size); a CUDA-graph wrapper whose fixed buffers the
    layout was made in needs nothing but the longest length. Returns False, changing nothing,
    for a CUDA-graph wrapper whose buffers do not hold the layout (`replan_decode` copies it
    in)."""
    if wrapper.is_cuda_graph_enabled:
        if (
            layout.indptr is not wrapper._paged_kv_indptr_buf
            or layout.last_page_len is not wrapper._paged_kv_last_page_len_buf
            or layout.indices is not wrapper._paged_kv_indices_buf
        ):
            return False
    else:
        wrapper._paged_kv_indptr_buf = layout.indptr
        wrapper._paged_kv_last_page_len_buf = layout.last_page_len
        wrapper._paged_kv_indices_buf = layout.indices
    wrapper._max_kv_len = layout.max_seq_len
    return True


def replan_decode(
    wrapper: Any,
    layout: DecodeLayout,
    arrays: PagedArrays | None,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_size: int,
    page_size: int,
    window_left: int,
    qo_indptr_host: torch.Tensor,
    qo_indptr_device: torch.Tensor,
    run_planner: bool = True,
    disable_split_kv: bool = False,
) -> None:
    """Plan `wrapper` (see `can_replan`) for a new batch of single-token decodes.

    Args:
        wrapper: a `BatchDecodeWithPagedKVCacheWrapper` planned before by its `plan()` with the
            same heads, head size, page size, window, soft cap, scale and dtypes.
        layout: the batch on the wrapper's device, what its kernel reads.
        arrays: the same batch's host arrays (`flashinfer_plan.plan_step`'s decode part), which
            the C++ planner reads: int32 `paged_kv_indptr [B + 1]` and `seq_lens [B]` (passed
            as its key counts). Only needed with `run_planner`.
        num_qo_heads, num_kv_heads, head_size, page_size, window_left: as given to `plan()`.
        qo_indptr_host, qo_indptr_device: int32 `[0, 1, ..., B]` (one query row per request), on
            the host and on the wrapper's device; the caller keeps them for later steps.
        run_planner: False keeps the schedule of the wrapper's last plan (its C++ planner is
            not run and its page-locked buffer not written): only for a wrapper last planned
            for a batch of this size whose schedule depends on the size alone (an eager one
            for which `schedule_is_fixed` holds, a CUDA-graph one planned with
            `disable_split_kv`).
        disable_split_kv: the planner's `disable_split_kv` (every request's keys in one
            chunk, no merge pass).

    Raises:
        ValueError: a CUDA-graph wrapper's fixed batch size or page capacity does not fit,
            `run_planner` is False for a wrapper last planned for another batch size, or
            `arrays` is missing or of another batch size where the planner runs.
    """
    batch = layout.num_reqs
    if qo_indptr_host.shape[0] != batch + 1 or qo_indptr_device.shape[0] != batch + 1:
        raise ValueError(
            f"replan_decode: qo_indptr_host / qo_indptr_device must have {batch + 1} entries "
            f"(got {qo_indptr_host.shape[0]} and {qo_indptr_device.shape[0]})."
        )
    if not run_planner and batch != wrapper._batch_size:
        raise ValueError(
            "replan_decode: run_planner=False keeps the last schedule, which only a wrapper "
            f"planned for the same batch size can do (got {batch} requests for a wrapper last "
            f"planned for {wrapper._batch_size})."
        )
    if run_planner and (arrays is None or arrays.num_reqs != batch):
        raise ValueError(
            "replan_decode: the C++ planner needs the batch's host arrays (got "
            f"{'none' if arrays is None else f'{arrays.num_reqs} requests'} for a layout of "
            f"{batch})."
        )
    pages = layout.indices
    if wrapper.is_cuda_graph_enabled:
        if (
            batch != wrapper._fixed_batch_size
            or pages.shape[0] > wrapper._paged_kv_indices_buf.shape[0]
        ):
            raise ValueError(
                "replan_decode: the batch does not fit this CUDA-graph wrapper (got "
                f"{batch} requests and {pages.shape[0]} pages, expected "
                f"{wrapper._fixed_batch_size} requests and <= "
                f"{wrapper._paged_kv_indices_buf.shape[0]} pages)."
            )
        # The captured kernels read these buffers: write into them, never replace them (a
        # layout made in them already needs no copy).
        for buffer, made in (
            (wrapper._paged_kv_indptr_buf, layout.indptr),
            (wrapper._paged_kv_last_page_len_buf, layout.last_page_len),
            (wrapper._paged_kv_indices_buf, pages),
        ):
            if made is not buffer:
                buffer[: made.shape[0]].copy_(made, non_blocking=True)
    else:
        wrapper._paged_kv_indptr_buf = layout.indptr
        wrapper._paged_kv_last_page_len_buf = layout.last_page_len
        wrapper._paged_kv_indices_buf = pages
        wrapper._qo_indptr_buf = qo_indptr_device
    if run_planner:
        wrapper._plan_info = wrapper._cached_module.plan(
            *planner_arguments(
                wrapper,
                arrays,
                num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                page_size=page_size,
                window_left=window_left,
                qo_indptr_host=qo_indptr_host,
                disable_split_kv=disable_split_kv,
            )
        )
    wrapper._batch_size = batch
    wrapper._max_kv_len = layout.max_seq_len


def planner_arguments(
    wrapper: Any,
    arrays: PagedArrays,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_size: int,
    page_size: int,
    window_left: int,
    qo_indptr_host: torch.Tensor,
    disable_split_kv: bool = False,
) -> list[Any]:
    """The fa2 C++ planner's arguments for a batch of single-token decodes, in the order
    FlashInfer 0.7.2.post1's `plan()` passes them (see `replan_decode` for the arguments).

    The key counts are `arrays.seq_lens` (0 for CUDA-graph padding requests, where `plan()`
    derives 1 from the last-page length); that version's fa2 planner takes them but splits the
    work by `paged_kv_indptr` alone (`BatchPrefillWithKVCachePlan` never reads `kv_len_arr`)."""
    batch = arrays.num_reqs
    return [
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
        qo_indptr_host,
        torch.from_numpy(arrays.paged_kv_indptr),
        torch.from_numpy(arrays.seq_lens),  # kv_len_arr
        batch,  # total query rows
        batch,
        num_qo_heads,
        num_kv_heads,
        page_size,
        wrapper.is_cuda_graph_enabled,
        head_size,  # head_dim_qk
        head_size,  # head_dim_vo
        False,  # causal: one query token sees every key
        window_left,
        -1,  # fixed_split_size: the planner's choice
        disable_split_kv,
        0,  # num_colocated_ctas
        0,  # uniform_q_len (only for several query tokens per request)
    ]
