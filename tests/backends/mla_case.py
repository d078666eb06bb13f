"""MLA test set-up shared by the TORCH_MLA tests: tiny sizes, a layer with drawn weights, a NeoX
rope, a two-step schedule over a shuffled paged cache, and a float64 MLA reference written from
the definitions in docs/mla.md (keys and values up-projected per head, no absorption).
"""

from __future__ import annotations

import torch

from anyattn import BatchLimits, MLAAttention
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing.blocks import assign_blocks

HIDDEN, HEADS = 32, 4
SIZES = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10}
L, R, P, VD = (SIZES[k] for k in SIZES)
SCALE = (P + R) ** -0.5
EPS = 1e-6
LIMITS = BatchLimits(max_num_reqs=8, max_num_tokens=128, max_model_len=64)

# The two-step schedule: request -> (tokens in step 1, tokens in step 2). Step 1 runs fresh
# prefills (a one-token request is a decode of a one-token sequence); step 2 decodes A and E,
# continues B and C over their cached context (22 rows: 3 chunks of a workspace of 8) and runs
# D fresh. Decodes lead each step.
STEP1 = {"E": 1, "A": 6, "B": 13, "C": 9}
STEP2 = {"A": 1, "E": 1, "B": 5, "C": 3, "D": 7}
TOTAL = {r: STEP1.get(r, 0) + STEP2.get(r, 0) for r in ("A", "E", "B", "C", "D")}


def make_layer(dtype, *, q_lora_rank=None, kv_cache_dtype="auto", block_size=4, workspace=8):
    """A TORCH_MLA `MLAAttention` with weights drawn from a fixed seed (fan-in scaled)."""
    layer = MLAAttention(
        HIDDEN, HEADS, **SIZES, q_lora_rank=q_lora_rank, scale=SCALE, rms_norm_eps=EPS,
        dtype=dtype, layer_name="mla", block_size=block_size, backend="TORCH_MLA",
        device="cpu", kv_cache_dtype=kv_cache_dtype, workspace_tokens=workspace,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("layernorm.weight"):
                value = 1 + 0.1 * torch.randn(param.shape, generator=gen)
            else:
                value = torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5
            param.copy_(value)
    return layer.requires_grad_(False)


def rope(positions: torch.Tensor):
    """NeoX rotary embedding at `positions [T]`: `rope(q_pe [T, H, R], k_pe [T, 1, R])`."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    angles = positions.double()[:, None] * inv_freq  # [T, R / 2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        cos = angles.cos()[:, None].to(x.dtype)
        sin = angles.sin()[:, None].to(x.dtype)
        x1, x2 = x[..., : R // 2], x[..., R // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return lambda q_pe, k_pe: (rotate(q_pe), rotate(k_pe))


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def reference(layer: MLAAttention, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MLA of one request's whole sequence `x [S, hidden]` (positions 0..S-1), computed in
    `dtype` from the definitions: `[S, hidden]`."""

    def w(module: torch.nn.Module) -> torch.Tensor:
        return module.weight.detach().to(dtype)

    x = x.to(dtype)
    seq = x.shape[0]
    if layer.q_lora_rank is None:
        q = x @ w(layer.q_proj).T
    else:
        q = _rms(x @ w(layer.q_a_proj).T, w(layer.q_a_layernorm)) @ w(layer.q_b_proj).T
    q_nope, q_pe = q.view(seq, HEADS, P + R).split([P, R], dim=-1)
    c_kv, k_pe = (x @ w(layer.kv_a_proj_with_mqa).T).split([L, R], dim=-1)
    c_kv = _rms(c_kv, w(layer.kv_a_layernorm))
    q_pe, k_pe = rope(torch.arange(seq))(q_pe, k_pe[:, None])
    kv_b = w(layer.kv_b_proj).view(HEADS, P + VD, L)
    k_nope = torch.einsum("sl,hpl->shp", c_kv, kv_b[:, :P])
    v = torch.einsum("sl,hvl->shv", c_kv, kv_b[:, P:])
    scores = torch.einsum("thp,shp->hts", q_nope, k_nope)
    scores = (scores + torch.einsum("thr,sr->hts", q_pe, k_pe[:, 0])) * SCALE
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("hts,shv->thv", probs, v)
    return out.flatten(1) @ w(layer.o_proj).T


class Schedule:
    """Requests with drawn hidden states over one shuffled paged cache, run step by step."""

    def __init__(self, layer: MLAAttention, dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.layer = layer
        self.hidden = {r: torch.randn(n, HIDDEN, generator=gen).to(dtype) for r, n in TOTAL.items()}
        block_size = layer.block_size
        self.rows = {r: i for i, r in enumerate(TOTAL)}
        self.block_table, num_blocks = assign_blocks(
            list(TOTAL.values()), block_size, generator=gen
        )
        self.kv_cache = allocate_kv_cache(
            layer.backend, num_blocks, block_size, 1, L + R, dtype, layer.config.kv_cache_dtype
        )
        spec = layer.kv_cache_spec()
        self.builder = layer.backend.get_builder_cls()(
            spec, {layer.layer_name: layer.impl.layer_params()}, LIMITS, torch.device("cpu")
        )
        self.done = dict.fromkeys(TOTAL, 0)

    def metadata(self, step: dict[str, int]):
        """The step's metadata (requests in `step`'s order)."""
        table = self.block_table[[self.rows[r] for r in step]]
        seq_lens = [self.done[r] + n for r, n in step.items()]
        cm = make_common_attn_metadata(list(step.values()), seq_lens, table, self.layer.block_size)
        return self.builder.build(0, cm)

    def run(self, step: dict[str, int]):
        """Run one step; returns `(metadata, {request: output rows})`."""
        md = self.metadata(step)
        hidden = torch.cat(
            [self.hidden[r][self.done[r] : self.done[r] + n] for r, n in step.items()]
        )
        positions = torch.cat(
            [torch.arange(self.done[r], self.done[r] + n) for r, n in step.items()]
        )
        out = self.layer(hidden, rope(positions), self.kv_cache, md)
        rows, start = {}, 0
        for r, n in step.items():
            rows[r] = out[start : start + n]
            start += n
            self.done[r] += n
        return md, rows


def bound(ref64: torch.Tensor, ref_lowp: torch.Tensor, dtype: torch.dtype) -> float:
    """docs/semantics.md's tolerance: `2 * max|ref_lowp - ref64| + floor`, floor the rounding
    noise of `dtype` at the reference's magnitude."""
    noise = ((ref64.to(dtype) + 0.3) - 0.3).double() - ref64
    return 2 * (ref_lowp.double() - ref64).abs().max().item() + 2 * noise.abs().max().item()
