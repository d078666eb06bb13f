"""anyattn's engine on a random DeepSeek-V3-shaped model, per MLA backend, against a float32
reference saved on the CPU: greedy tokens equal, or parted at a near-tie within bfloat16's bound.

`--save DIR` (CPU, needs transformers): writes the model of `deepseek_model.py` into `DIR/model`
and the reference into `DIR/reference.json` (prompts, settings, tokens, versions, the sanity
checks below) and `DIR/reference.safetensors` (per prompt: float32 logits `[new_tokens, vocab]`
of every generated token, and the bfloat16 bound `[new_tokens]` of each of those rows):
1. The reference: this engine on the CPU, float32, TORCH_MLA, greedy, EOS ignored, the prompts
   batched under a token budget (`MAX_NUM_BATCHED_TOKENS`) smaller than the longer prompts, so
   they are prefilled in chunks over their cached context, beside the others' decodes.
2. Sanity checks of it against transformers (float32, eager): its logits of the same tokens
   (teacher-forced) within 1e-3 (docs/semantics.md), and transformers' `generate` giving the
   same tokens (where it parts, the reference's top-2 gap there is reported: a near-tie).
3. The bound of each row, docs/semantics.md's low-precision rule with the reference as `ref64`
   and transformers run in bfloat16 on the same tokens as `ref_lowp`:
   `bound = 2 * max|ref_bf16 - ref32| + floor` (`anyattn.testing.error_bound`; floor: bfloat16's
   rounding noise at the logits' magnitude). A conforming bfloat16 run's logits lie within it.

`--check DIR --backends ...` (any device; imports no transformers beyond the engine's tokenizer
loading): runs the engine on each named backend with the saved settings (default: CUDA,
bfloat16; CUDA graphs stay off, the engine does not capture DeepSeek steps), the sampler's
logits caught on the way, and follows each prompt's reference tokens. Where a token differs
from the reference's, at step s (b picked where the reference picked a, from the same context):
- each logit of a conforming run lies within `bound[s]` of the reference's, so b can outrank a
  only when `gap = ref[s, a] - ref[s, b] <= 2 * bound[s]`: a near-tie, which passes (gap and
  allowed gap printed); a larger gap is a MISMATCH.
- the prompt is then resumed from the reference's context (its prompt and reference tokens up
  to step s, prefix-cached), so every step of every prompt is judged, not only those before
  the first near-tie.
Logits: over all rows judged (each from the reference's context), the row error
`max|out - ref32|` divided by the row's bound must have a median <= 1 (the median, not the max:
a bf16 rounding that flips a near-tie between experts moves a row's logits by O(1) in any
correct implementation). The max and the number of rows above their bound are printed: with the
MoE in the last layer, a routing flip moves only its own row, so more than a few such rows
point at a small systematic error (a softmax scale 2% off gives 9 of 128 on the CPU in bf16,
and passes; 10% off fails; TORCH_MLA gives none). A backend fails on a mismatch, a median above
1, or an error; backends not registered, not installed or not for this device are skipped
(printed). Exit status 1 when a backend failed or none ran; `--save` exits 1 when the reference
disagrees with transformers (logits beyond 1e-3, or `generate` parting where the top-2 gap is
above docs/semantics.md's 1e-4).

Run: `python benchmarks/deepseek_gpu_check.py --save .ds-check` on the CPU (~1 minute), then on
the GPU, with `src` and FlashInfer importable: `python benchmarks/deepseek_gpu_check.py --check
.ds-check --backends TRITON_MLA FLASHINFER_MLA TORCH_MLA`. On the CPU: add `--device cpu`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

# Prompt lengths (token ids drawn with the seed): within one block, over one block, and two
# longer than the token budget, prefilled in chunks.
PROMPT_LENS = (5, 19, 50, 113)
NEW_TOKENS = 32
BLOCK_SIZE = 16  # FLASHINFER_MLA takes 16, 32 or 64
MAX_NUM_BATCHED_TOKENS = 32
MAX_MODEL_LEN = 256
# docs/semantics.md's whole-model rule against transformers in float32
FP32_ATOL, FP32_NEAR_TIE = 1e-3, 1e-4
_PARTING = ("step", "reference_token", "token", "gap", "allowed_gap", "verdict")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, metavar="DIR", help="write model and reference")
    what.add_argument("--check", type=Path, metavar="DIR", help="check backends against DIR")
    parser.add_argument("--backends", nargs="+", default=["TRITON_MLA", "FLASHINFER_MLA"])
    parser.add_argument("--device", default=None, help="--check: default cuda if present")
    parser.add_argument("--dtype", default=None, help="--check: default bfloat16")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="--save")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=list(PROMPT_LENS))
    parser.add_argument("--seed", type=int, default=0, help="--save: model and prompts")
    parser.add_argument("--json", type=Path, default=None, help="--check: write verdicts here")
    return parser.parse_args(argv)


def _make_llm(model_dir: Path, backend: str, device: str, dtype: torch.dtype, settings: dict):
    from anyattn.engine.llm import LLM

    return LLM(
        model_dir,
        backend=backend,
        dtype=dtype,
        device=device,
        block_size=settings["block_size"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        max_model_len=settings["max_model_len"],
    )


def generate(llm, prompts: list[list[int]], new_tokens: list[int]):
    """Greedy tokens of every prompt (batched; `new_tokens` per prompt) and, per prompt, the
    float32 logits `[new_tokens, vocab]` each token was picked from (caught on their way into the
    sampler)."""
    from anyattn.engine.sampling_params import SamplingParams

    # one params object per prompt: the sampler's rows are matched to prompts by it
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in new_tokens]
    rows: dict[int, list[torch.Tensor]] = {id(p): [] for p in params}
    sample = llm.sampler.sample

    def recording_sample(logits, row_params, generators):
        for row, p in zip(logits, row_params, strict=True):
            rows[id(p)].append(row.float().cpu())
        return sample(logits, row_params, generators)

    llm.sampler.sample = recording_sample
    try:
        outputs = llm.generate(prompts, params)
    finally:
        del llm.sampler.sample
    for output in outputs:
        if output.error:
            raise RuntimeError(f"request {output.request_id} failed: {output.error}")
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return tokens, [torch.stack(rows[id(p)]) for p in params]


def follow(llm, reference: dict, ref_tensors: dict) -> list[dict]:
    """Run the reference's prompts and judge each token against the reference's, resuming from
    the reference's context after every parting (module docstring, `--check`); one record per
    prompt: `partings` (step, reference token, token, gap, allowed gap, verdict) and `ratios`
    (row error / bound of every row compared)."""
    total = reference["new_tokens"]
    records = [{"partings": [], "ratios": []} for _ in reference["prompts"]]
    start = [0] * len(records)  # the next step to compare, per prompt
    while active := [i for i in range(len(records)) if start[i] < total]:
        prompts = [reference["prompts"][i] + reference["tokens"][i][: start[i]] for i in active]
        tokens, logits = generate(llm, prompts, [total - start[i] for i in active])
        for i, got, rows in zip(active, tokens, logits, strict=True):
            ref, bound = ref_tensors[f"logits.{i}"], ref_tensors[f"bound.{i}"]
            want = reference["tokens"][i][start[i] :]
            parted = _first_difference(got, want)
            n = len(want) if parted is None else parted + 1  # rows of the reference's context
            steps = slice(start[i], start[i] + n)
            records[i]["ratios"].append((rows[:n] - ref[steps]).abs().amax(-1) / bound[steps])
            if parted is not None:
                step, a, b = start[i] + parted, want[parted], got[parted]
                gap, allowed = (ref[step, a] - ref[step, b]).item(), 2 * bound[step].item()
                verdict = "near-tie" if gap <= allowed else "MISMATCH"
                records[i]["partings"].append((step, a, b, gap, allowed, verdict))
            start[i] += n
    return records


def _versions() -> dict:
    import anyattn

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "anyattn_src": str(Path(anyattn.__file__).parent),
    }


def save(folder: Path, new_tokens: int, prompt_lens: list[int], seed: int) -> dict:
    """Write the model and the reference into `folder` (module docstring, `--save`); returns
    what went into reference.json."""
    import transformers
    from deepseek_model import V3_CONFIG, save_random_deepseek_v3
    from safetensors.torch import save_file

    from anyattn.testing import error_bound

    model_dir = folder / "model"
    save_random_deepseek_v3(model_dir, seed)
    generator = torch.Generator().manual_seed(seed + 2)
    vocab = V3_CONFIG["vocab_size"]
    prompts = [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in prompt_lens]
    settings = {
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
    }
    llm = _make_llm(model_dir, "TORCH_MLA", "cpu", torch.float32, settings)
    tokens, logits = generate(llm, prompts, [new_tokens] * len(prompts))
    del llm

    hf = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf[dtype] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="eager"
        ).eval()
    sanity, tensors = [], {}
    for index, (prompt, generated, ref) in enumerate(zip(prompts, tokens, logits, strict=True)):
        ids = torch.tensor([prompt + generated[:-1]])
        with torch.inference_mode():
            hf32 = hf[torch.float32](input_ids=ids).logits[0, len(prompt) - 1 :].float()
            hf16 = hf[torch.bfloat16](input_ids=ids).logits[0, len(prompt) - 1 :].float()
            want = hf[torch.float32].generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        pairs = zip(ref, hf16, strict=True)
        bound = torch.tensor([error_bound(r, b, torch.bfloat16) for r, b in pairs])
        parted = _first_difference(generated, want)
        top2 = ref.topk(2, dim=-1).values
        gap = None if parted is None else (top2[parted, 0] - top2[parted, 1]).item()
        sanity.append({
            "prompt": index,
            "max_logit_error_vs_transformers": (ref - hf32).abs().max().item(),
            "transformers_generate_parts_at": parted,
            "top2_gap_there": gap,
            "transformers_bf16_median_row_error": (hf16 - ref).abs().amax(-1).median().item(),
            "median_bound": bound.median().item(),
        })  # fmt: skip
        tensors[f"logits.{index}"] = ref.contiguous()
        tensors[f"bound.{index}"] = bound.float()
    save_file(tensors, str(folder / "reference.safetensors"))
    reference = {
        "prompts": prompts, "new_tokens": new_tokens, "settings": settings, "tokens": tokens,
        "seed": seed, "versions": {**_versions(), "transformers": transformers.__version__},
        "sanity": sanity,
    }  # fmt: skip
    (folder / "reference.json").write_text(json.dumps(reference, indent=1))
    return reference


def _is_sane(entry: dict) -> bool:
    """The reference agrees with transformers in float32 (docs/semantics.md's whole-model rule)."""
    gap = entry["top2_gap_there"]
    is_near_tie = gap is None or gap < FP32_NEAR_TIE
    return entry["max_logit_error_vs_transformers"] <= FP32_ATOL and is_near_tie


def _first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)


def judge(records: list[dict]) -> dict:
    """The verdict of one backend from `follow`'s records (module docstring, `--check`)."""
    prompts, failures = [], []
    for index, record in enumerate(records):
        partings = [dict(zip(_PARTING, p, strict=True)) for p in record["partings"]]
        mismatches = [p for p in partings if p["verdict"] == "MISMATCH"]
        failures += [
            f"prompt {index}: token {p['token']} for {p['reference_token']} at step "
            f"{p['step']}, gap {p['gap']:.4g} > {p['allowed_gap']:.4g}"
            for p in mismatches
        ]
        verdict = "MISMATCH" if mismatches else "near-tie" if partings else "same"
        ratio = torch.cat(record["ratios"])
        prompts.append({
            "prompt": index, "verdict": verdict, "partings": partings,
            "max_error_over_bound": ratio.max().item(),
        })  # fmt: skip
    ratio = torch.cat([r for record in records for r in record["ratios"]])
    median = ratio.median().item()
    if median > 1:
        failures.append(f"median logit row error / bound {median:.3g} > 1")
    return {
        "prompts": prompts,
        "median_error_over_bound": median,
        "max_error_over_bound": ratio.max().item(),
        "rows_over_bound": f"{int((ratio > 1).sum())} of {ratio.numel()}",
        "failures": failures,
        "passed": not failures,
    }


def _skip_reason(name: str, device: torch.device) -> str | None:
    from anyattn.registry import get_backend_class

    try:
        cls = get_backend_class(name)
    except (KeyError, ValueError) as exc:
        return f"not registered ({exc})"
    reason = cls.get_unavailable_reason()
    if reason is not None:
        return reason
    if device.type not in cls.supported_device_types:
        return f"does not run on {device.type} (runs on {', '.join(cls.supported_device_types)})"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if not cls.supports_compute_capability(capability):
            return f"compute capability {capability} not supported"
    return None


def check(folder: Path, backends: list[str], device: torch.device, dtype: torch.dtype) -> dict:
    """Run and judge every backend (module docstring, `--check`); returns the results."""
    from safetensors.torch import load_file

    reference = json.loads((folder / "reference.json").read_text())
    ref_tensors = load_file(str(folder / "reference.safetensors"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    results = {**_versions(), "device": name, "dtype": str(dtype).removeprefix("torch.")}
    results["reference"] = reference["versions"]
    results["backends"] = {}
    print(f"{results['date']}; {name}; torch {torch.__version__}; anyattn from "
          f"{results['anyattn_src']}; {results['dtype']} against the float32 reference of "
          f"{reference['versions']['date']}")  # fmt: skip
    for backend in backends:
        reason = _skip_reason(backend, device)
        if reason is not None:
            print(f"{backend}: skipped: {reason}")
            results["backends"][backend] = {"skipped": reason}
            continue
        start = time.perf_counter()
        try:
            llm = _make_llm(folder / "model", backend, device, dtype, reference["settings"])
            graphs = llm.runner.cuda_graph_plan.message
            records = follow(llm, reference, ref_tensors)
            del llm
        except Exception as exc:  # a backend that fails to run fails the check
            print(f"{backend}: FAILED with {type(exc).__name__}: {exc}")
            results["backends"][backend] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        verdict = judge(records)
        verdict.update(seconds=time.perf_counter() - start, cuda_graphs=graphs)
        results["backends"][backend] = verdict
    _print_table(results)
    return results


def _print_table(results: dict) -> None:
    print(f"\n{'backend':<16} {'prompt':>6} {'verdict':<9} {'max err/bound':>13}  partings "
          "(step: gap / allowed gap)")  # fmt: skip
    for backend, verdict in results["backends"].items():
        if "prompts" not in verdict:
            print(f"{backend:<16} {verdict.get('error') or 'skipped: ' + verdict['skipped']}")
            continue
        for p in verdict["prompts"]:
            partings = ", ".join(
                f"{q['step']}: {q['gap']:.3g} / {q['allowed_gap']:.3g}" for q in p["partings"]
            )
            print(f"{backend:<16} {p['prompt']:>6} {p['verdict']:<9} "
                  f"{p['max_error_over_bound']:>13.3g}  {partings or '-'}")  # fmt: skip
        state = "PASS" if verdict["passed"] else "FAIL: " + "; ".join(verdict["failures"])
        print(f"{backend:<16} row error / bound: median {verdict['median_error_over_bound']:.3g}, "
              f"max {verdict['max_error_over_bound']:.3g}, {verdict['rows_over_bound']} rows above "
              f"their bound; {verdict['seconds']:.1f} s; "
              f"{verdict['cuda_graphs']}; {state}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    here = str(Path(__file__).resolve().parent)  # deepseek_model, engine_model
    if here not in sys.path:
        sys.path.insert(0, here)
    if args.save is not None:
        reference = save(args.save, args.new_tokens, args.prompt_lens, args.seed)
        for entry in reference["sanity"]:
            print(json.dumps(entry))
        return 0 if all(_is_sane(entry) for entry in reference["sanity"]) else 1
    from anyattn.types import parse_dtype

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = parse_dtype(args.dtype or "bfloat16", argument="--dtype")
    results = check(args.check, args.backends, device, dtype)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    verdicts = results["backends"].values()
    ran = [v for v in verdicts if "skipped" not in v]
    return 0 if ran and all(v.get("passed") for v in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
