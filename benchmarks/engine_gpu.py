"""anyattn's engine on the GPU, per attention backend, against transformers on the same weights.

The model is a random Llama (`engine_model.py`, preset `llama-1b`: hidden 2048, 16 layers,
32 / 8 heads of 64, ~1.2B parameters) built offline with a fixed seed and saved as bf16.
Prompts are token ids, lengths drawn with a fixed seed from `--prompt-len` (64-512); a batch of
B submits the first B prompts at once; every request generates `--new-tokens` (128) tokens,
greedy, EOS ignored.

1. Correctness (`--check`, fp32, the bf16 weights upcast on both sides): each backend's engine
   (CUDA graphs on and off) generates `--check-new-tokens` tokens for `--check-reqs` prompts,
   batched; transformers (eager attention, fp32) runs each prompt followed by those tokens.
   A generated token passes when it is transformers' argmax at its position, or at a near-tie:
   transformers' logit of it within 1e-3 of the top logit (the gap is reported). The first
   position where `generate` itself parts from the engine is reported too.
2. Throughput (bf16): output tokens/s and ms per token (wall time of the whole batch divided by
   the new tokens per request) of each contender at each batch size:
   `anyattn <BACKEND> graphs|eager`, `transformers generate` (left-padded batch, sdpa),
   `transformers generate_batch` (continuous batching; its span from the first request's
   creation to the last one's end when the installed version records it, else the call's wall
   time). Two untimed warm-up runs (2 new tokens) precede each timed one.
   anyattn contenders are backend names, `fastest` (`LLM(backend="fastest")`: measured under
   the engine's limits, a per-phase pair when the decode and prefill choices differ and can
   share a cache, else the overall choice; `--fastest`) and per-phase pairs `DECODE,PREFILL`
   (decodes on the first backend, prefills and the prefill rows of mixed steps on the second;
   `--pairs`), each with its own LLM; the JSON keeps each one's set-up seconds (the
   measurement included), what its layers run and why (`backend_notes`).
3. The mixed workload (`--workloads mixed`, `engine_mixed.py`): more requests than run at once,
   prompt and output lengths drawn per request, so that as requests finish new prompts are
   prefilled in chunks alongside the running decodes; tokens/s of all outputs, and the count of
   decode-only, mixed and prefill-only steps. Its own LLM per contender (its limits; prefix
   caching off). "fastest" and the pairs are compared with the best single backend of each
   workload, batch and mode (`engine_report.comparison`: within 3%, or within the spread of
   `--repeats` runs; whether a pair beats every single backend).

Writes `engine_gpu.json` (every row, versions, the check, the comparison) and, when matplotlib
imports, `engine_gpu.png` (tokens/s per contender against batch size; the mixed workload's
tokens/s per contender; date, versions and command below) into `--out` (default `$OUT`, else
`./out`). `--plot JSON` only draws the plot from an earlier run's JSON.

Run (GPU): `python benchmarks/engine_gpu.py [--src CHECKOUT] [--backends TRITON FLASHINFER]
[--fastest] [--pairs TRITON,FLASH_ATTN] [--workloads batch mixed]
[--contenders anyattn generate generate_batch] [--modes graphs eager] [--batches 1 16 64 256]`.
CPU smoke run: `--device cpu --model micro --backends TORCH --fastest --pairs
TORCH,FLEX_ATTENTION --workloads batch mixed --modes eager --batches 1 4 --new-tokens 8
--check-reqs 2 --mixed-requests 6 --mixed-max-seqs 3 --mixed-batched-tokens 16
--mixed-prompt-len 8 24 --mixed-new-tokens 2 6`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from engine_llm import (
    engine_tokens,
    free,
    label,
    make_llm,
    make_row,
    time_anyattn,
    time_anyattn_mixed,
    timed,
)
from engine_mixed import MixedWorkload
from engine_report import comparison, comparison_table, plot

GPU_BACKENDS = ["TRITON", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION"]
NEAR_TIE = 1e-3


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=None, help="checkout whose src/ to measure")
    parser.add_argument("--out", type=Path, default=None, help="default $OUT, else ./out")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--model", default="llama-1b", help="preset of engine_model.py")
    parser.add_argument(
        "--backends", nargs="+", default=None,
        help="default: the GPU backends; also 'fastest' and pairs DECODE,PREFILL",
    )  # fmt: skip
    parser.add_argument(
        "--fastest", action="store_true", help="add LLM(backend='fastest') as a contender"
    )
    parser.add_argument(
        "--pairs", nargs="+", default=[], metavar="DECODE,PREFILL",
        help="add per-phase pairs as contenders, e.g. TRITON,FLASH_ATTN",
    )  # fmt: skip
    parser.add_argument(
        "--workloads", nargs="+", default=["batch"], choices=["batch", "mixed"],
        help="batch: --batches submitted at once; mixed: engine_mixed.py",
    )  # fmt: skip
    parser.add_argument(
        "--contenders", nargs="+", default=["anyattn", "generate", "generate_batch"],
        choices=["anyattn", "generate", "generate_batch"],
    )  # fmt: skip
    parser.add_argument(
        "--modes", nargs="+", default=["graphs", "eager"], choices=["graphs", "eager"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512], metavar=("LO", "HI"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="best of this many timed runs")
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--check-reqs", type=int, default=4)
    parser.add_argument("--check-new-tokens", type=int, default=16)
    parser.add_argument("--plot", type=Path, default=None, help="only plot this JSON")
    mixed = MixedWorkload()
    parser.add_argument("--mixed-requests", type=int, default=mixed.requests)
    parser.add_argument("--mixed-max-seqs", type=int, default=mixed.max_num_seqs)
    parser.add_argument("--mixed-batched-tokens", type=int, default=mixed.max_num_batched_tokens)
    parser.add_argument("--mixed-prompt-len", type=int, nargs=2, default=list(mixed.prompt_len),
                        metavar=("LO", "HI"))  # fmt: skip
    parser.add_argument("--mixed-new-tokens", type=int, nargs=2, default=list(mixed.new_tokens),
                        metavar=("LO", "HI"))  # fmt: skip
    args = parser.parse_args(argv)
    for pair in args.pairs:
        if len([p for p in pair.split(",") if p.strip()]) != 2:
            parser.error(f"--pairs: each is DECODE,PREFILL (got {pair!r})")
    args.mixed = MixedWorkload(
        args.mixed_requests, args.mixed_max_seqs, args.mixed_batched_tokens,
        tuple(args.mixed_prompt_len), tuple(args.mixed_new_tokens),
    )  # fmt: skip
    return args


def _prompts(num: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(lo, hi + 1, size=num)
    return [rng.integers(2, vocab, size=int(n)).tolist() for n in lengths]


def check_backend(folder, hf32, backend, mode, device, prompts, new_tokens) -> dict:
    """The fp32 check of one backend and mode against transformers (module docstring, 1)."""
    import torch

    max_len = max(map(len, prompts)) + new_tokens + 16
    llm = make_llm(folder, backend, mode, device, torch.float32, len(prompts), max_len)
    tokens = engine_tokens(llm, prompts, new_tokens)
    del llm
    free()
    report = {"backend": backend, "mode": mode, "mismatches": 0, "near_ties": [], "parted": []}
    for index, (prompt, generated) in enumerate(zip(prompts, tokens, strict=True)):
        ids = torch.tensor([prompt + generated[:-1]], device=device)
        with torch.inference_mode():
            logits = hf32(input_ids=ids).logits[0, len(prompt) - 1 :].float()
            want = hf32.generate(
                torch.tensor([prompt], device=device), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False,
            )[0, len(prompt) :].tolist()  # fmt: skip
        top2 = logits.topk(2, dim=-1).values
        for pos, token in enumerate(generated):
            gap = (logits[pos].max() - logits[pos, token]).item()
            if gap == 0:
                continue
            if gap <= NEAR_TIE:
                report["near_ties"].append(
                    {"request": index, "position": pos, "gap": gap,
                     "top2_gap": (top2[pos, 0] - top2[pos, 1]).item()}
                )  # fmt: skip
            else:
                report["mismatches"] += 1
        pairs = enumerate(zip(generated, want, strict=True))
        parted = next((p for p, (a, b) in pairs if a != b), None)
        if parted is not None:
            report["parted"].append({"request": index, "position": parted})
    report["passed"] = report["mismatches"] == 0
    return report


def time_generate(hf, device, prompt_sets, new_tokens, repeats):
    import torch

    rows = []
    for prompts in prompt_sets:
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)

        def run(n: int, ids=ids, mask=mask) -> None:
            with torch.inference_mode():
                hf.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip

        run(2)
        seconds = min(timed(lambda run=run: run(new_tokens), device, repeats))
        rows.append(make_row("transformers generate", len(prompts), seconds, new_tokens))
    return rows


def time_generate_batch(hf, device, prompt_sets, new_tokens, repeats):
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    rows = []
    for prompts in prompt_sets:
        hf.generate_batch(inputs=prompts, generation_config=config, max_new_tokens=2)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = hf.generate_batch(inputs=prompts, generation_config=config)
            wall = time.perf_counter() - start
            results = list(out.values())
            assert all(len(r.generated_tokens) == new_tokens for r in results), "short output"
            spans = [getattr(r, "lifespan", (-1, -1))[1] for r in results]
            created = [getattr(r, "created_time", -1) for r in results]
            if min(spans) > 0 and min(created) > 0:
                wall = max(spans) - min(created)
            best = min(best, wall)
        rows.append(make_row("transformers generate_batch", len(prompts), best, new_tokens))
    return rows


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def time_contenders(args, backends, folder, device, dtype, prompt_sets, vocab, results) -> None:
    """Time every anyattn contender and mode on every workload into `results` (rows, what
    each LLM ran); a contender that fails is recorded in `results["errors"]` and skipped."""
    for workload in args.workloads:
        for backend in backends:
            for mode in args.modes:
                what = f"{workload} anyattn {label(backend)} {mode}"
                print(what, flush=True)
                try:
                    if workload == "batch":
                        rows, info = time_anyattn(
                            folder, backend, mode, device, dtype, prompt_sets, args.new_tokens,
                            args.repeats,
                        )  # fmt: skip
                    else:
                        rows, info = time_anyattn_mixed(
                            folder, backend, mode, device, dtype, args.mixed, vocab, args.repeats
                        )
                except Exception as error:  # a contender that cannot run here: say why
                    results["errors"].append(f"{what}: {error}")
                    print(f"{what}: skipped ({error})", flush=True)
                    free()
                    continue
                results["rows"] += rows
                results["contenders"][what] = info


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    out = args.out or Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    if args.plot is not None:
        drawn = plot(json.loads(args.plot.read_text()), out / "engine_gpu.png")
        print("plotted" if drawn else "matplotlib is not installed")
        return
    if args.src is not None:
        sys.path.insert(0, str(args.src.resolve() / "src"))
    import torch
    import transformers

    import anyattn

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_model import save_random_llama

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = args.backends or (GPU_BACKENDS if device.type == "cuda" else ["TORCH"])
    backends = list(dict.fromkeys([*backends, *(["fastest"] if args.fastest else []), *args.pairs]))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"anyattn from {Path(anyattn.__file__).parent}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {name}")  # fmt: skip
    versions = {
        "torch": torch.__version__, "triton": _version("triton"),
        "flashinfer": _version("flashinfer-python"), "flash-attn-4": _version("flash-attn-4"),
        "transformers": transformers.__version__,
    }  # fmt: skip
    results = {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "device_name": name,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python3 benchmarks/engine_gpu.py " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv),
        "anyattn_src": str(Path(anyattn.__file__).parent), "new_tokens": args.new_tokens,
        "mixed_workload": args.mixed.describe() if "mixed" in args.workloads else "",
        "checks": [], "errors": [], "rows": [], "contenders": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.model
        with torch.device(device):  # random init on the device: fast for the 1.2B model
            save_random_llama(folder, args.model, dtype=torch.bfloat16)
        free()
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompts = _prompts(max([*args.batches, args.check_reqs]), *args.prompt_len, vocab)
        load = transformers.AutoModelForCausalLM.from_pretrained
        if args.check:
            hf32 = load(folder, dtype=torch.float32, attn_implementation="eager").to(device)
            for backend in backends:
                for mode in args.modes:
                    try:
                        report = check_backend(
                            folder, hf32.eval(), backend, mode, device,
                            [p[:64] for p in prompts[: args.check_reqs]], args.check_new_tokens,
                        )  # fmt: skip
                    except Exception as error:  # a backend that cannot run here: say why
                        results["errors"].append(f"check {backend} {mode}: {error}")
                        print(f"check {backend} {mode}: skipped ({error})", flush=True)
                        continue
                    results["checks"].append(report)
                    print(f"check {backend} {mode}: {'passed' if report['passed'] else 'FAILED'} "
                          f"({report['mismatches']} mismatches, near-ties {report['near_ties']}, "
                          f"generate parts at {report['parted']})", flush=True)  # fmt: skip
            del hf32
            free()
        prompt_sets = [prompts[:batch] for batch in args.batches]
        print(f"{'contender':>34} {'batch':>5} {'tokens/s':>10} {'ms/token':>9}")
        if "anyattn" in args.contenders:
            try:
                time_contenders(args, backends, folder, device, dtype, prompt_sets, vocab, results)
            except KeyboardInterrupt:  # a timeout's SIGINT: keep the rows timed so far
                results["errors"].append("interrupted")
                print("interrupted: writing the rows timed so far", flush=True)
                args.contenders = []
        hf_contenders = [c for c in ("generate", "generate_batch") if c in args.contenders]
        if hf_contenders:
            hf = load(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
            for contender in hf_contenders:
                timer = time_generate if contender == "generate" else time_generate_batch
                try:
                    results["rows"] += timer(hf, device, prompt_sets, args.new_tokens, args.repeats)
                except Exception as error:
                    results["errors"].append(f"transformers {contender}: {error}")
                    print(f"transformers {contender}: failed ({error})", flush=True)
            del hf
            free()
    results["comparison"] = comparison(results["rows"])
    if results["comparison"]:
        print(f"\n{comparison_table(results['comparison'])}\n", flush=True)
    (out / "engine_gpu.json").write_text(json.dumps(results, indent=1))
    drawn = plot(results, out / "engine_gpu.png")
    print(f"wrote {out / 'engine_gpu.json'}" + (" and engine_gpu.png" if drawn else ""))


if __name__ == "__main__":
    main()
