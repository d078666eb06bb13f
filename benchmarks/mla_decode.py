"""MLA decode and prefill on the GPU: TRITON_MLA against TORCH_MLA and FlashInfer's MLA kernel.

    python benchmarks/mla_decode.py [--quick] [--device cuda] [--heads 16,128] [--blocks 64,16]

Cases (bf16, latent 512+64, P = Vd = 128, shuffled pages): decode 64 x 4096, 256 x 2048 and
8 x 32768 (requests x context), prefill 4 x 4096 (fresh), each at 16 and 128 heads and block
sizes 64 and 16. Contenders: TRITON_MLA's `forward_mqa` / `forward_mha` through the anyattn
contract (plan made once, outside the timing), TORCH_MLA's (skipped where its float32 scores
would pass 2 GiB), and `flashinfer.mla.BatchMLAPagedAttentionWrapper` called directly (decode,
when importable). Before timing, each contender's output on a slice of rows is checked against
a float64 reference (the tolerance rule of docs/semantics.md; a contender that fails is
reported, not timed). Yardsticks measured in the same run: the device copy rate (bytes read
plus written per second, a 1 GiB copy) and the bf16 matmul rate (8192^3).

Columns: median microseconds; TB/s of latent bytes (each request's cache rows counted once,
`L + R` values each; decode); TFLOP/s (decode: `2 * H * (2L + R)` per key and row; prefill:
the causal up-projected attention, `2 * H * (P + R + Vd)` per query-key pair, up-projection not
counted); and those as a share of the copy and matmul rates. `--device cpu --quick` runs tiny
shapes in float16 (the Triton kernels then need `TRITON_INTERPRET=1`), for the test that keeps
this script working.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from _timing import gpu_times_us, markdown_table, synchronize

from anyattn.backends.flashinfer_mla import FlashInferMLAImpl
from anyattn.backends.torch_mla import TorchMLAImpl
from anyattn.backends.triton_mla import TritonMLAImpl
from anyattn.config import BatchLimits, MLAAttentionSpec
from anyattn.metadata import make_common_attn_metadata
from anyattn.ops.mla_decode import mla_decode_ref
from anyattn.testing import error_bound, max_abs_error

_MAX_SCORE_BYTES = 2 << 30
_IMPLS = {"TRITON_MLA": TritonMLAImpl, "FLASHINFER_MLA": FlashInferMLAImpl,
          "TORCH_MLA": TorchMLAImpl}  # fmt: skip
_CHECK_ROWS = 2  # rows (decode) or queries (prefill) checked against float64


@dataclass(frozen=True)
class Setting:
    """The sizes of one run: latent split, up-projected heads, dtype and the case lists."""

    rank: int
    rope: int
    nope: int
    v_dim: int
    dtype: torch.dtype
    decode: tuple[tuple[int, int], ...]
    prefill: tuple[tuple[int, int], ...]


FULL = Setting(512, 64, 128, 128, torch.bfloat16, ((64, 4096), (256, 2048), (8, 32768)),
               ((4, 4096),))  # fmt: skip
TINY = Setting(64, 16, 32, 32, torch.float16, ((3, 40), (2, 70)), ((2, 24),))


class Layer:
    """What the impls read of a layer: its name, cache scale and up-projection (random kv_b)."""

    def __init__(self, s: Setting, heads: int, device: torch.device, gen: torch.Generator):
        self.layer_name = "mla"
        self.k_scale = torch.tensor(1.0, device=device)
        kv_b = torch.randn(heads, s.nope + s.v_dim, s.rank, generator=gen) / math.sqrt(s.rank)
        self.kv_b = kv_b.to(device=device, dtype=s.dtype)
        self.split = (s.nope, s.v_dim)

    def up_project(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = torch.einsum("nl,hdl->nhd", c_kv, self.kv_b.to(c_kv.dtype))
        return kv.split(self.split, dim=-1)


class Step:
    """One step's inputs over a cache of shuffled pages, and its metadata for each impl."""

    def __init__(self, s: Setting, heads: int, block_size: int, query_lens: list[int],
                 seq_lens: list[int], device: torch.device) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        self.s, self.heads, self.block_size = s, heads, block_size
        self.query_lens, self.seq_lens = query_lens, seq_lens
        blocks = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks) + 1
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
        self.table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
        at = 0
        for r, n in enumerate(blocks):
            self.table[r, :n] = ids[at : at + n]
            at += n
        row = s.rank + s.rope
        cache = torch.empty(num_blocks, block_size, row, dtype=s.dtype, device=device)
        self.kv_cache = cache.normal_(generator=torch.Generator(device).manual_seed(1))
        tokens = sum(query_lens)
        self.q = torch.randn(tokens, heads, row, generator=gen).to(device, s.dtype)
        self.q_mha = torch.randn(tokens, heads, s.nope + s.rope, generator=gen).to(device, s.dtype)
        self.kv_c = torch.randn(tokens, s.rank, generator=gen).to(device, s.dtype)
        self.k_pe = torch.randn(tokens, s.rope, generator=gen).to(device, s.dtype)
        self.layer = Layer(s, heads, device, gen)
        self.scale = 1 / math.sqrt(s.nope + s.rope)
        self.device = device

    def impl_and_metadata(self, impl_cls: type) -> tuple[object, object]:
        s = self.s
        sizes = dict(kv_lora_rank=s.rank, qk_rope_head_dim=s.rope, qk_nope_head_dim=s.nope,
                     v_head_dim=s.v_dim)  # fmt: skip
        impl = impl_cls(self.heads, self.scale, **sizes)
        spec = MLAAttentionSpec(block_size=self.block_size, dtype=s.dtype, **sizes)
        limits = BatchLimits(max_num_reqs=len(self.seq_lens), max_num_tokens=sum(self.query_lens),
                             max_model_len=max(self.seq_lens))  # fmt: skip
        builder = impl_cls.backend.get_builder_cls()(
            spec, {"mla": impl.layer_params()}, limits, self.device
        )
        cm = make_common_attn_metadata(self.query_lens, self.seq_lens, self.table,
                                       self.block_size, self.device)  # fmt: skip
        return impl, builder.build(0, cm)


def decode_runner(step: Step, impl_cls: type) -> Callable[[], torch.Tensor]:
    impl, md = step.impl_and_metadata(impl_cls)
    rank = step.s.rank
    q_latent, q_pe = step.q[..., :rank], step.q[..., rank:]
    out = torch.empty_like(q_latent)
    return lambda: impl.forward_mqa(step.layer, q_latent, q_pe, step.kv_cache, md, out) or out


def prefill_runner(step: Step, impl_cls: type) -> Callable[[], torch.Tensor]:
    impl, md = step.impl_and_metadata(impl_cls)
    out = torch.empty(step.q_mha.shape[0], step.heads, step.s.v_dim, dtype=step.s.dtype,
                      device=step.device)  # fmt: skip
    run = impl.forward_mha
    return lambda: run(step.layer, step.q_mha, step.kv_c, step.k_pe, step.kv_cache, md, out) or out


def flashinfer_runner(step: Step) -> Callable[[], torch.Tensor]:
    """FlashInfer's MLA decode over the same pages (`plan` once, outside the timing)."""
    import flashinfer

    s, device = step.s, step.device
    rows = len(step.seq_lens)
    pages = [-(-n // step.block_size) for n in step.seq_lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.cat([step.table[r, :n] for r, n in enumerate(pages)])
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
    wrapper.plan(
        torch.arange(rows + 1, dtype=torch.int32, device=device), indptr.to(device),
        indices.to(device), torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        step.heads, s.rank, s.rope, step.block_size, False, step.scale, s.dtype, s.dtype,
    )  # fmt: skip
    ckv, kpe = step.kv_cache[..., : s.rank], step.kv_cache[..., s.rank :]
    q_nope = step.q[..., : s.rank].contiguous()
    q_pe = step.q[..., s.rank :].contiguous()
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe)


def decode_work(step: Step) -> tuple[int, int]:
    """(latent bytes, FLOPs) of a decode step: each request's cache rows read once (`L + R`
    values each), `2 * H * (2L + R)` FLOPs per key and row."""
    s, keys = step.s, sum(step.seq_lens)
    latent_bytes = keys * (s.rank + s.rope) * step.kv_cache.element_size()
    return latent_bytes, 2 * step.heads * (2 * s.rank + s.rope) * keys


def check_decode(step: Step, out: torch.Tensor) -> str:
    """'ok' or the error: the first rows against `mla_decode_ref` in float64."""
    n, rank = min(_CHECK_ROWS, len(step.seq_lens)), step.s.rank
    lens = torch.tensor(step.seq_lens[:n], dtype=torch.int32, device=step.device)
    args = (step.q[:n, :, :rank], step.q[:n, :, rank:], step.kv_cache, step.table[:n].to(
        step.device), lens, step.scale)  # fmt: skip
    ref64, _ = mla_decode_ref(*args, compute_dtype=torch.float64)
    lowp, _ = mla_decode_ref(*args, compute_dtype=step.s.dtype)
    return _judge(out[:n], ref64, lowp, step.s.dtype)


def check_prefill(step: Step, out: torch.Tensor) -> str:
    """'ok' or the error: request 0's last queries against float64 up-projected attention."""
    s, q_len = step.s, step.query_lens[0]
    rows = slice(max(0, q_len - _CHECK_ROWS), q_len)
    results = []
    for dtype in (torch.float64, s.dtype):
        kv = torch.einsum("nl,hdl->nhd", step.kv_c[:q_len].to(dtype), step.layer.kv_b.to(dtype))
        k_nope, v = kv.split((s.nope, s.v_dim), dim=-1)
        k_pe = step.k_pe[:q_len, None].to(dtype).expand(-1, step.heads, -1)
        keys = torch.cat([k_nope, k_pe], dim=-1)  # [q_len, H, P + R]
        scores = torch.einsum("qhd,khd->hqk", step.q_mha[rows].to(dtype), keys) * step.scale
        causal = torch.arange(q_len, device=step.device)[None, :] <= torch.arange(
            rows.start, rows.stop, device=step.device)[:, None]  # fmt: skip
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        results.append(torch.einsum("hqk,khv->qhv", probs, v))
    return _judge(out[rows], results[0], results[1], s.dtype)


def _judge(out: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor, dtype) -> str:
    err, bound = max_abs_error(out, ref64), error_bound(ref64, lowp, dtype)
    return "ok" if err <= bound else f"WRONG (error {err:.3g} > bound {bound:.3g})"


def measure(run: Callable[[], object], device: torch.device, reps: int) -> float:
    return statistics.median(gpu_times_us(lambda _: run(), 1, 2, reps, device))


def yardsticks(device: torch.device, reps: int) -> tuple[float, float]:
    """(device copy rate in TB/s of bytes read plus written, bf16 matmul TFLOP/s)."""
    size, n = (1 << 30, 8192) if device.type == "cuda" else (1 << 20, 128)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = measure(lambda: dst.copy_(src), device, reps)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device).to(dtype)
    matmul_us = measure(lambda: a @ a, device, reps)
    return 2 * size / copy_us / 1e6, 2 * n**3 / matmul_us / 1e6


def run_case(kind: str, step: Step, contenders: Sequence[str], reps: int) -> list[list[object]]:
    s, rows = step.s, []
    label = f"{kind} {len(step.seq_lens)} x {max(step.seq_lens)}, H={step.heads}, " + (
        f"block {step.block_size}"
    )
    if kind == "decode":
        bytes_, flops = decode_work(step)
        score_bytes = 4 * step.heads * sum(step.seq_lens) * 2
    else:
        bytes_ = 0
        flops = sum(step.heads * (s.nope + s.rope + s.v_dim) * q * (q + 1) for q in step.query_lens)
        score_bytes = 4 * step.heads * max(step.query_lens) ** 2 * 2
    for name in contenders:
        if name == "TORCH_MLA" and score_bytes > _MAX_SCORE_BYTES:
            rows.append([label, name, "skipped (scores too large)", "", "", ""])
            continue
        if name == "FLASHINFER" and kind != "decode":
            continue
        try:
            if name == "FLASHINFER":
                run = flashinfer_runner(step)
            else:
                impl_cls = _IMPLS[name]
                run = (decode_runner if kind == "decode" else prefill_runner)(step, impl_cls)
            out = run()
            synchronize(step.device)
            verdict = (check_decode if kind == "decode" else check_prefill)(step, out)
        except Exception as error:  # a contender that cannot run is reported, not fatal
            rows.append([label, name, f"failed: {type(error).__name__}: {error}"[:120], "", "", ""])
            continue
        if verdict != "ok":
            rows.append([label, name, verdict, "", "", ""])
            continue
        us = measure(run, step.device, reps)
        rows.append([label, name, f"{us:.1f}", f"{bytes_ / us / 1e6:.3f}" if bytes_ else "",
                     f"{flops / us / 1e6:.1f}", ""])  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions")
    parser.add_argument("--heads", default=None, help="comma-separated (default 16,128)")
    parser.add_argument("--blocks", default=None, help="block sizes (default 64,16)")
    parser.add_argument("--contenders", default="TRITON_MLA,FLASHINFER_MLA,FLASHINFER,TORCH_MLA")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    setting = TINY if device.type == "cpu" else FULL
    reps = 3 if args.quick else 20
    heads = [int(h) for h in (args.heads or ("4" if device.type == "cpu" else "16,128")).split(",")]
    blocks = [
        int(b) for b in (args.blocks or ("16" if device.type == "cpu" else "64,16")).split(",")
    ]
    contenders = args.contenders.split(",")
    if {"FLASHINFER", "FLASHINFER_MLA"} & set(contenders):
        try:
            import flashinfer.mla  # noqa: F401
        except ImportError:
            print("FlashInfer: not importable, skipped")
            contenders = [c for c in contenders if not c.startswith("FLASHINFER")]
    copy_rate, matmul_rate = yardsticks(device, reps)
    print(f"device copy rate {copy_rate:.3f} TB/s (read + written); matmul {matmul_rate:.1f} "
          f"TFLOP/s ({'bf16' if device.type == 'cuda' else 'float32'})")  # fmt: skip
    table = []
    for h in heads:
        for b in blocks:
            for n, length in setting.decode:
                step = Step(setting, h, b, [1] * n, [length] * n, device)
                table += run_case("decode", step, contenders, reps)
            for n, length in setting.prefill:
                step = Step(setting, h, b, [length] * n, [length] * n, device)
                table += run_case("prefill", step, contenders, reps)
            del step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for row in table:
        if row[3]:
            row[5] = f"{100 * float(row[3]) / copy_rate:.0f}% copy"
        if row[4] and not row[3]:
            row[5] = f"{100 * float(row[4]) / matmul_rate:.0f}% matmul"
        elif row[4]:
            row[5] += f", {100 * float(row[4]) / matmul_rate:.0f}% matmul"
    print(markdown_table(["case", "contender", "us", "TB/s", "TFLOP/s", "of yardstick"], table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
