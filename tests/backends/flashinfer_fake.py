"""A CPU stand-in for the part of FlashInfer's public API FLASHINFER calls, computing what
FlashInfer documents, so that the builder's `plan()` arguments can be checked on the CPU.

`BatchDecodeWithPagedKVCacheWrapper` / `BatchPrefillWithPagedKVCacheWrapper` /
`BatchPrefillWithRaggedKVCacheWrapper` (over contiguous K/V): `plan()` keeps
copies of its arguments (checking what FlashInfer's docstrings require: int32 CSR page lists,
offsets and last-page lengths on the host, page ids on the wrapper's device, the CUDA-graph
wrapper's fixed batch size); `run()` attends in float64 over the paged cache as those arguments
describe it (FlashInfer's "KV-Cache Layout" page): request i's keys are the first
`(pages - 1) * page_size + last_page_len[i]` tokens of its pages, a query row r of q_len sits at
position `kv_len - q_len + r`, `window_left` keeps keys at or after `position - window_left`,
the soft cap is `cap * tanh(x / cap)` of the scaled logits, `k_scale` folds into the scale and
`v_scale` into the output, LSEs are base 2. `decode.xqa_batch_decode_with_kv_cache` likewise
over a page table and lengths. `plans` logs every plan made, `runs` every run.
"""

from __future__ import annotations

import math
import sys
import types

import torch

plans: list[tuple[str, object]] = []
runs: list[str] = []


def attend(query, keys, values, *, scale, causal, window_left, soft_cap):
    """float64 attention of `query` `[q, H, D]` over `keys` / `values` `[k, KVH, D]`, the query
    rows at the last q positions: (`[q, H, D]`, base-2 LSE `[q, H]`)."""
    q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos = torch.arange(kv_len - q_len, kv_len).view(-1, 1)
    key_pos = torch.arange(kv_len).view(1, -1)
    hidden = torch.zeros(q_len, kv_len, dtype=torch.bool)
    if causal:
        hidden |= key_pos > pos
    if window_left >= 0:
        hidden |= key_pos < pos - window_left
    scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [H, q]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, (lse / math.log(2.0)).t()


def _paged_kv(cache, pages, kv_len):
    """`[kv_len, KVH, D]` keys and values of one request from the logical cache view."""
    kv = cache[pages.long()]  # [pages, 2, block, KVH, D]
    keys = kv[:, 0].reshape(-1, *kv.shape[-2:])[:kv_len]
    values = kv[:, 1].reshape(-1, *kv.shape[-2:])[:kv_len]
    return keys, values


class _Wrapper:
    kind = ""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", **kwargs):  # fmt: skip
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.device = float_workspace_buffer.device
        self.use_cuda_graph = use_cuda_graph
        self.backend = backend
        self.fixed = None
        if use_cuda_graph:
            self.fixed = (len(paged_kv_last_page_len_buffer), len(paged_kv_indices_buffer))
            assert len(paged_kv_indptr_buffer) == self.fixed[0] + 1
        self.plan_args = None

    def _plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
              head_dim, page_size, *, causal, window_left=-1, logits_soft_cap=None,
              sm_scale=None, q_data_type=None, kv_data_type=None, o_data_type=None,
              non_blocking=True):  # fmt: skip
        for name, x in (("qo_indptr", qo_indptr), ("indptr", indptr), ("last", last_page_len)):
            assert x.dtype == torch.int32 and x.device.type == "cpu", (name, x)
        assert indices.dtype == torch.int32 and indices.device == self.device
        assert len(indptr) == len(last_page_len) + 1 == len(qo_indptr)
        assert int(indptr[-1]) == len(indices) and bool((indptr[1:] >= indptr[:-1]).all())
        has_pages = indptr[1:] > indptr[:-1]
        assert bool(((last_page_len >= 1) & (last_page_len <= page_size))[has_pages].all())
        if self.fixed is not None:
            assert len(last_page_len) == self.fixed[0] and len(indices) <= self.fixed[1]
        assert num_qo_heads % num_kv_heads == 0 and kv_data_type is not None
        self.plan_args = dict(
            qo_indptr=qo_indptr.clone(), indptr=indptr.clone(), indices=indices.clone(),
            last=last_page_len.clone(), heads=(num_qo_heads, num_kv_heads, head_dim),
            page_size=page_size, causal=causal, window_left=window_left,
            soft_cap=logits_soft_cap or 0.0, scale=sm_scale or head_dim**-0.5,
            dtypes=(q_data_type, kv_data_type, o_data_type),
        )  # fmt: skip
        plans.append((self.kind, self.plan_args))

    def run(self, q, paged_kv_cache, *, k_scale=None, v_scale=None, out=None, return_lse=False):
        a = self.plan_args
        assert a is not None, "run() before plan()"
        assert q.shape[1:] == (a["heads"][0], a["heads"][2]) and q.dtype == a["dtypes"][0]
        assert paged_kv_cache.dtype == a["dtypes"][1]
        assert len(q) == int(a["qo_indptr"][-1]), (len(q), a["qo_indptr"])
        runs.append(self.kind)
        cache = paged_kv_cache.double()
        result = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((len(q), q.shape[1]), -math.inf, dtype=torch.float64)
        for i in range(len(a["last"])):
            rows = slice(int(a["qo_indptr"][i]), int(a["qo_indptr"][i + 1]))
            pages = a["indices"][int(a["indptr"][i]) : int(a["indptr"][i + 1])]
            kv_len = 0 if len(pages) == 0 else (len(pages) - 1) * a["page_size"] + int(a["last"][i])
            if rows.stop == rows.start or kv_len == 0:
                continue
            keys, values = _paged_kv(cache, pages, kv_len)
            o, row_lse = attend(q[rows], keys, values, scale=a["scale"] * (k_scale or 1.0),
                                causal=a["causal"], window_left=a["window_left"],
                                soft_cap=a["soft_cap"])  # fmt: skip
            result[rows], lse[rows] = o * (v_scale or 1.0), row_lse
        out = torch.empty_like(q) if out is None else out
        out.copy_(result)
        return (out, lse.float()) if return_lse else out


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    kind = "decode"

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, **kwargs):  # fmt: skip
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                   head_dim, page_size, causal=True, **kwargs)  # fmt: skip


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    kind = "paged"

    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, causal=False, **kwargs):  # fmt: skip
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                   head_dim_qk, page_size, causal=causal, **kwargs)  # fmt: skip


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    kind = "ragged"

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk,
             head_dim_vo=None, causal=False, window_left=-1, logits_soft_cap=None, sm_scale=None,
             q_data_type=None, kv_data_type=None, o_data_type=None, non_blocking=True):  # fmt: skip
        for x in (qo_indptr, kv_indptr):
            assert x.dtype == torch.int32 and x.device.type == "cpu", x
        assert len(qo_indptr) == len(kv_indptr) and num_qo_heads % num_kv_heads == 0
        assert int(qo_indptr[0]) == int(kv_indptr[0]) == 0
        self.plan_args = dict(
            qo_indptr=qo_indptr.clone(), kv_indptr=kv_indptr.clone(),
            heads=(num_qo_heads, num_kv_heads, head_dim_qk), causal=causal,
            head_dim_vo=head_dim_vo or head_dim_qk,
            window_left=window_left, soft_cap=logits_soft_cap or 0.0,
            scale=sm_scale or head_dim_qk**-0.5, dtypes=(q_data_type, kv_data_type, o_data_type),
        )  # fmt: skip
        plans.append((self.kind, self.plan_args))

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False, lse_base="log2",
            lse_layout="NH"):  # fmt: skip
        a = self.plan_args
        assert q.dtype == a["dtypes"][0] and k.dtype == v.dtype == a["dtypes"][1]
        assert len(q) == int(a["qo_indptr"][-1]) and len(k) == int(a["kv_indptr"][-1])
        assert q.shape[1:] == (a["heads"][0], a["heads"][2]) and k.shape[-1] == a["heads"][2]
        assert v.shape[-1] == a["head_dim_vo"] and len(v) == len(k)
        runs.append(self.kind)
        result = torch.zeros(*q.shape[:2], v.shape[-1], dtype=torch.float64)
        row_lse = torch.full((len(q), q.shape[1]), -math.inf, dtype=torch.float64)
        for i in range(len(a["qo_indptr"]) - 1):
            rows = slice(int(a["qo_indptr"][i]), int(a["qo_indptr"][i + 1]))
            keys = slice(int(a["kv_indptr"][i]), int(a["kv_indptr"][i + 1]))
            result[rows], row_lse[rows] = attend(q[rows], k[keys], v[keys], scale=a["scale"],
                                                 causal=a["causal"], window_left=a["window_left"],
                                                 soft_cap=a["soft_cap"])  # fmt: skip
        if out is None:
            out = q.new_empty(result.shape)
        assert out.shape == result.shape
        out.copy_(result)
        if not return_lse:
            return out
        row_lse = row_lse * (math.log(2.0) if lse_base == "ln" else 1.0)
        row_lse = row_lse.t() if lse_layout == "HN" else row_lse
        if lse is None:
            lse = torch.empty(row_lse.shape, dtype=torch.float32)
        assert lse.shape == row_lse.shape and lse.dtype == torch.float32
        lse.copy_(row_lse)
        return out, lse


def xqa_batch_decode_with_kv_cache(query, kv_cache, workspace_buffer, block_tables, seq_lens,
                                   max_seq_len, bmm1_scale=1.0, bmm2_scale=1.0, window_left=-1,
                                   out=None, kv_layout="NHD", **kwargs):  # fmt: skip
    assert kv_layout == "NHD" and query.is_contiguous() and block_tables.is_contiguous()
    assert block_tables.dtype == seq_lens.dtype == torch.int32
    assert max_seq_len == block_tables.shape[1] * kv_cache.shape[2]
    runs.append("xqa")
    cache = kv_cache.double()
    for i in range(len(query)):
        kv_len = int(seq_lens[i])
        pages = block_tables[i, : -(-kv_len // kv_cache.shape[2])]
        keys, values = _paged_kv(cache, pages, kv_len)
        o, _ = attend(query[i : i + 1], keys, values, scale=bmm1_scale, causal=True,
                      window_left=window_left, soft_cap=0.0)  # fmt: skip
        out[i : i + 1].copy_(o * bmm2_scale)
    return out


def install(monkeypatch, version: str | None = "0.7.2.post1") -> types.ModuleType:
    """Put the fake in `sys.modules` as `flashinfer` (and `flashinfer.decode`), installed at
    `version`, with the logs cleared; undone by `monkeypatch`, except `import_flashinfer`'s
    cache, which the caller clears when done."""
    from anyattn.backends import flashinfer as fi_backend
    from anyattn.backends import flashinfer_version

    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    decode = types.ModuleType("flashinfer.decode")
    decode.xqa_batch_decode_with_kv_cache = xqa_batch_decode_with_kv_cache
    module.decode = decode
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    for target in (flashinfer_version, fi_backend):
        monkeypatch.setattr(target, "installed_flashinfer", lambda: (True, version))
    flashinfer_version.import_flashinfer.cache_clear()  # (the caller clears it again after)
    plans.clear()
    runs.clear()
    return module
