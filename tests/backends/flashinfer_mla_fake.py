"""A CPU stand-in for `flashinfer.mla` (the part FLASHINFER_MLA calls), computing what FlashInfer
documents, so that the builder's `plan()` arguments and the impl's calls can be checked on the
CPU; installed beside `flashinfer_fake` (whose ragged prefill wrapper FLASHINFER_MLA's prefill
uses).

`MLAPlanMetadata.csr` keeps the four CSR tensors. `BatchMLAPagedAttentionWrapper.plan()` checks
what FlashInfer's docstrings require (int32 CSR, page ids on the wrapper's device, the rest on
the CPU or that device) and keeps copies; `run(query=(q_nope, q_pe), kv_cache=packed)` attends
in float64: request i's keys are the first `kv_len[i]` rows of its pages `kv_indices[kv_indptr[i]
: kv_indptr[i + 1]]` of the packed cache `[num_pages, page_size, ckv + kpe]`, scores
`(q_nope . ckv + q_pe . kpe) * sm_scale`, values the ckv part; the LSE in natural base when
`return_lse_base_on_e`, else base 2, shape `[rows, heads]`.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass

import flashinfer_fake
import torch

plans: list[dict] = []
runs: list[str] = []


@dataclass(frozen=True)
class MLAPlanMetadata:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr) -> MLAPlanMetadata:
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto") -> None:
        assert float_workspace_buffer.dtype == torch.uint8
        self.device = float_workspace_buffer.device
        self.args: dict | None = None

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
             sm_scale, q_data_type, kv_data_type, query_layout="packed",
             kv_cache_layout="packed", lse_mode="none") -> None:  # fmt: skip
        m = metadata
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"):
            x = getattr(m, name)
            assert x.dtype == torch.int32 and x.device.type in ("cpu", self.device.type), name
        assert m.kv_indices.device == self.device
        rows = len(m.kv_len_arr)
        assert len(m.qo_indptr) == len(m.kv_indptr) == rows + 1
        assert int(m.kv_indptr[-1]) == len(m.kv_indices)
        pages = m.kv_indptr[1:] - m.kv_indptr[:-1]
        assert bool((m.kv_len_arr.cpu() <= pages * page_size).all())
        assert bool((m.kv_len_arr.cpu() > (pages - 1) * page_size).all())
        assert query_layout in ("packed", "split") and kv_cache_layout in ("packed", "split")
        assert lse_mode in ("none", "base2", "basee")
        self.args = dict(
            qo=m.qo_indptr.cpu().clone(), indptr=m.kv_indptr.cpu().clone(),
            indices=m.kv_indices.clone(), kv_len=m.kv_len_arr.cpu().clone(), heads=num_heads,
            ckv=head_dim_ckv, kpe=head_dim_kpe, page_size=page_size, causal=causal,
            scale=sm_scale, dtypes=(q_data_type, kv_data_type), query_layout=query_layout,
            kv_cache_layout=kv_cache_layout, lse_mode=lse_mode,
        )  # fmt: skip
        plans.append(self.args)

    def run(self, *, query, kv_cache, out=None, lse=None, return_lse=False,
            return_lse_base_on_e=False):  # fmt: skip
        a = self.args
        assert a is not None, "run() before plan()"
        if a["query_layout"] == "split":
            q_nope, q_pe = query
        else:
            q_nope, q_pe = query[..., : a["ckv"]], query[..., a["ckv"] :]
        assert a["kv_cache_layout"] == "packed" and kv_cache.shape[-1] == a["ckv"] + a["kpe"]
        assert kv_cache.shape[1] == a["page_size"] and kv_cache.dtype == a["dtypes"][1]
        assert q_nope.dtype == q_pe.dtype == a["dtypes"][0]
        assert q_nope.shape[1:] == (a["heads"], a["ckv"]) and q_pe.shape[1:] == (
            a["heads"],
            a["kpe"],
        )
        assert len(q_nope) == int(a["qo"][-1])
        if return_lse:
            assert a["lse_mode"] == ("basee" if return_lse_base_on_e else "base2")
        runs.append("mla")
        cache = kv_cache.double()
        result = torch.zeros(q_nope.shape, dtype=torch.float64)
        row_lse = torch.full(q_nope.shape[:2], -math.inf, dtype=torch.float64)
        for i in range(len(a["kv_len"])):
            rows = slice(int(a["qo"][i]), int(a["qo"][i + 1]))
            pages = a["indices"][int(a["indptr"][i]) : int(a["indptr"][i + 1])].long()
            latent = cache[pages].reshape(-1, cache.shape[-1])[: int(a["kv_len"][i])]
            ckv, kpe = latent[:, : a["ckv"]], latent[:, a["ckv"] :]
            scores = torch.einsum("qhl,kl->hqk", q_nope[rows].double(), ckv)
            scores = (scores + torch.einsum("qhr,kr->hqk", q_pe[rows].double(), kpe)) * a["scale"]
            assert not a["causal"] or rows.stop - rows.start == 1
            lse_e = torch.logsumexp(scores, dim=-1)  # [H, q]
            result[rows] = torch.einsum("hqk,kl->qhl", torch.exp(scores - lse_e[..., None]), ckv)
            row_lse[rows] = lse_e.t()
        if out is None:
            out = q_nope.new_empty(q_nope.shape)
        assert out.shape == q_nope.shape and out.dtype == q_nope.dtype
        out.copy_(result)
        if not return_lse:
            return out
        if lse is None:
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32)
        assert lse.shape == q_nope.shape[:2] and lse.is_contiguous()
        lse.copy_(row_lse if return_lse_base_on_e else row_lse / math.log(2.0))
        return out, lse


def install(monkeypatch) -> types.ModuleType:
    """`flashinfer_fake.install` plus this `flashinfer.mla`, logs cleared; see there."""
    from anyattn.backends import flashinfer_mla

    module = flashinfer_fake.install(monkeypatch)
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    mla.MLAPlanMetadata = MLAPlanMetadata
    module.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(flashinfer_mla, "installed_flashinfer", lambda: (True, "0.7.2.post1"))
    plans.clear()
    runs.clear()
    return module
