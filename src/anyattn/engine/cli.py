"""`anyattn generate`: stream text from a model through the backend layer."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from rich.console import Console

__all__ = ["DEFAULT_PROMPT", "add_generate_parser", "run_generate"]

DEFAULT_PROMPT = "Give me three tips for writing clear Python code."


def add_generate_parser(
    commands: argparse._SubParsersAction, positive_int: Callable[[str], int]
) -> None:
    """Register the `generate` subcommand on the main parser's subcommands."""
    gen = commands.add_parser(
        "generate",
        help="generate text with a model (default: the embedded SmolLM2-135M-Instruct)",
        description="Stream a completion; prints the attention backend chosen and tokens/s.",
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help=f"default: {DEFAULT_PROMPT!r}")
    gen.add_argument("--model", help="a .gguf file or a Hugging Face folder")
    gen.add_argument("--backend", help="attention backend name (default: selected)")
    gen.add_argument("--max-tokens", type=positive_int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    gen.add_argument("--dtype", default=None, help="float32, float16 or bfloat16")
    gen.add_argument("-v", "--verbose", action="store_true", help="explain the backend choice")


def _explain_layers(llm, backend: str | None, console: Console) -> None:
    """The selector's verdict for each distinct layer configuration of the model."""
    from anyattn.selector import explain
    from anyattn.types import DeviceInfo

    device = DeviceInfo.current(llm.device)
    configs: dict[object, str] = {}
    for layer in llm.model.attention_layers():
        configs.setdefault(layer.config, layer.layer_name)  # the first layer of each config
    for config, first_layer in configs.items():
        result = explain(config, device, backend)
        console.print(f"selection for {first_layer} (and layers like it):")
        for verdict in result.verdicts:
            why = list(verdict.reasons) + ([verdict.unavailable] if verdict.unavailable else [])
            mark = "chosen" if verdict.name == result.chosen else "; ".join(why) or "fits"
            console.print(f"  {verdict.name}: {mark}")


def run_generate(args: argparse.Namespace) -> int:
    """Load the model, then stream one prompt or generate several; 0 on success."""
    from anyattn.engine.llm import LLM
    from anyattn.engine.sampling_params import SamplingParams

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    start = time.perf_counter()
    llm = LLM(args.model, backend=args.backend, dtype=args.dtype, device=args.device)
    layers = llm.model.attention_layers()
    err.print(
        f"model {llm.model_path.name}: {len(layers)} attention layers on {llm.device}, "
        f"{str(llm.dtype).removeprefix('torch.')}; attention backend: "
        f"{', '.join(llm.backend_names)} (loaded in {time.perf_counter() - start:.1f} s)"
    )
    if args.verbose:
        _explain_layers(llm, args.backend, err)
    prompts = args.prompts or [DEFAULT_PROMPT]
    if len(prompts) == 1:
        if args.chat:
            err.print(f"> {prompts[0]}")
        start = time.perf_counter()
        first_at = None
        for delta in llm.stream(prompts[0], params, chat=args.chat):
            first_at = first_at or time.perf_counter()
            sys.stdout.write(delta)
            sys.stdout.flush()
        elapsed = time.perf_counter() - start
        sys.stdout.write("\n")
        tokens = len(llm.last_stream_output.outputs[0].token_ids)
        if first_at is not None:
            err.print(f"first text after {first_at - start:.2f} s")
    else:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, chat=args.chat)
        elapsed = time.perf_counter() - start
        failed = 0
        for output in outputs:
            print(f"--- {output.prompt}")
            if output.error:
                failed += 1
                err.print(f"anyattn generate: error: {output.error}")
            else:
                print(output.outputs[0].text)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        if failed:
            err.print(f"{tokens} tokens; {failed} of {len(outputs)} requests failed")
            return 1
    err.print(f"{tokens} tokens in {elapsed:.2f} s: {tokens / max(elapsed, 1e-9):.1f} tokens/s")
    return 0
